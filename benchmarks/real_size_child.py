"""One step of `benchmarks.real_size`, in its own process.

    python -m benchmarks.real_size_child STEP MODEL WORK

STEP is "generate" (build, `convert_causal_lm`, `keras_selfattn.generate`
against keras-hub's greedy `generate`) or a format of `export_generator`
("saved_model", "onnx", "litert": build, convert, export with its
fresh-process check), optionally with a Keras quantization mode after a
dash ("onnx-int8": the converted model quantized by `model.quantize("int8")`
before the export). Every step builds the keras-hub Llama from the same
seed. The last line of stdout is the step's JSON: phase times, parameters,
and whether the tokens agreed.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

# LlamaBackbone arguments; "weights_gib" in the results is measured.
MODELS = {
    "tiny": dict(
        vocabulary_size=1000,
        num_layers=2,
        num_query_heads=4,
        num_key_value_heads=2,
        hidden_dim=64,
        intermediate_dim=128,
    ),
    # 0.59 B parameters, 2.21 GiB float32: the shape of issue 54's user.
    "llama-0.6b": dict(
        vocabulary_size=32000,
        num_layers=28,
        num_query_heads=16,
        num_key_value_heads=8,
        hidden_dim=1024,
        intermediate_dim=5120,
    ),
    # Llama 3.2 1B's shape: 1.24 B parameters, 4.6 GiB float32.
    "llama-3.2-1b": dict(
        vocabulary_size=128256,
        num_layers=16,
        num_query_heads=32,
        num_key_value_heads=8,
        hidden_dim=2048,
        intermediate_dim=8192,
        rope_max_wavelength=500000,
        tie_word_embeddings=True,
    ),
}
PROMPT, NEW_TOKENS, MAX_LENGTH, SEED = 8, 8, 32, 0
FILES = {"saved_model": "saved_model", "onnx": "generator.onnx", "litert": "g.tflite"}


def _prompts(vocabulary: int):
    import numpy as np

    rng = np.random.default_rng(SEED)
    return rng.integers(1, vocabulary, (1, PROMPT)).astype("int32")


def _build(model: str):
    import keras
    import keras_hub

    keras.utils.set_random_seed(SEED)
    backbone = keras_hub.models.LlamaBackbone(**MODELS[model])
    lm = keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)
    lm.compile(sampler="greedy")
    return lm


def _keras_hub_tokens(lm, prompts):
    import numpy as np

    length = PROMPT + NEW_TOKENS
    ids = np.zeros((len(prompts), length), "int32")
    ids[:, :PROMPT] = prompts
    padding = np.zeros(ids.shape, bool)
    padding[:, :PROMPT] = True
    out = lm.generate(
        {"token_ids": ids, "padding_mask": padding},
        max_length=length,
        stop_token_ids=None,
    )
    return np.asarray(out["token_ids"])[:, PROMPT:]


def run(step: str, model: str, work: str) -> dict:
    """Runs STEP on MODEL (module docstring); returns its record."""
    import numpy as np

    from keras_selfattn import convert_causal_lm, generate

    times: dict[str, float] = {}
    start = time.perf_counter()
    lm = _build(model)
    times["build_s"] = time.perf_counter() - start
    parameters = int(sum(np.prod(w.shape) for w in lm.backbone.weights))
    prompts = _prompts(lm.backbone.vocabulary_size)
    record = {"parameters": parameters, "weights_gib": 4 * parameters / 2**30}
    step, _, mode = step.partition("-")
    if step == "generate":
        start = time.perf_counter()
        want = _keras_hub_tokens(lm, prompts)
        times["keras_hub_generate_s"] = time.perf_counter() - start
    start = time.perf_counter()
    # Copies, not shared layers: a layer shared by two models keeps both
    # graphs alive (Keras's nodes), and with them keras-hub's attention
    # weights, after `lm` is dropped (docs/export.md, "Large models").
    converted = convert_causal_lm(lm, share_weights=False)
    times["convert_s"] = time.perf_counter() - start
    del lm
    gc.collect()
    if mode:
        start = time.perf_counter()
        converted.quantize(mode)
        gc.collect()
        times["quantize_s"] = time.perf_counter() - start
    if step == "generate":
        start = time.perf_counter()
        got = np.asarray(generate(converted, prompts, NEW_TOKENS).tokens)
        times["generate_s"] = time.perf_counter() - start
        record["tokens_equal"] = bool((got == want).all())
        record["tokens"] = got[0].tolist()
    else:
        from keras_selfattn.export import export_generator

        path = os.path.join(work, f"{mode}_{FILES[step]}" if mode else FILES[step])
        kwargs = {"name": "generator"} if step == "saved_model" else {}
        start = time.perf_counter()
        export_generator(converted, path, step, max_length=MAX_LENGTH, **kwargs)
        times["export_and_check_s"] = time.perf_counter() - start
        record["checked_in_fresh_process"] = True
        record["written_gib"] = _size(path) / 2**30
    record.update(times)
    return record


def _size(path: str) -> int:
    if os.path.isfile(path):
        folder, prefix = os.path.dirname(path), os.path.basename(path)
        return sum(
            os.path.getsize(os.path.join(folder, name))
            for name in os.listdir(folder)
            if name.startswith(prefix)
        )
    return sum(
        os.path.getsize(os.path.join(root, name))
        for root, _, names in os.walk(path)
        for name in names
    )


def main(argv: list[str]) -> None:
    # If memory runs out, let the kernel pick this process, not a neighbour.
    with open("/proc/self/oom_score_adj", "w", encoding="utf-8") as adj:
        adj.write("1000")
    step, model, work = argv
    print(json.dumps(run(step, model, work)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
