"""The generators against a runtime's own generation loop: onnxruntime-genai.

One transformers `LlamaForCausalLM` checkpoint with random weights (and a
word-level tokenizer) in a folder (`peers_child`, SIZES); onnxruntime-genai's
model builder writes its fp32 CPU model from the folder; keras-hub loads the
same folder (`LlamaCausalLM.from_preset(folder)`), converted by
`keras_selfattn.convert_causal_lm` and exported as the ONNX generator. Greedy,
batch 1, a 16-token prompt, 64 new tokens, interleaved rounds in one process
tree (onnxruntime-genai in a child process of the peers' own virtualenv,
answering one generation per request):

- onnxruntime-genai (`-p fp32 -e cpu`), its C++ loop;
- the ONNX generator (`export_generator(..., "onnx")`) in onnxruntime, with
  the default session options and with `session.intra_op.allow_spinning`
  "0" (its idle threads sleep instead of spinning: on a shared machine);
- `keras_selfattn.generate` on TensorFlow;
- keras-hub's own `generate` (greedy sampler).

Every candidate's tokens are compared with transformers' own greedy tokens.
The machine (CPU, cores, load average) is in the results file.

    make bench-peers                       # the 153M model (issue 56)
    .venv/bin/python -m benchmarks.peers --size tiny --rounds 5 \\
        --peers-python /work/peers-venv/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import numpy as np

from benchmarks import machine, report, timing

PROMPT, NEW_TOKENS = 16, 64
CANDIDATES = (
    ("onnxruntime_genai", "onnxruntime-genai (fp32, cpu)"),
    ("onnx_generator", "ONNX generator in onnxruntime"),
    ("onnx_generator_no_spin", "ONNX generator, threads not spinning"),
    ("keras_selfattn_generate", "keras_selfattn.generate (TensorFlow)"),
    ("keras_hub_generate", "keras-hub generate"),
)


def _child(python: str, *args: str) -> str:
    return subprocess.run(
        [python, "-m", "benchmarks.peers_child", *args],
        check=True,
        capture_output=True,
        text=True,
    ).stdout


def _prepare(python: str, work: str, size: str) -> tuple[str, str]:
    """The checkpoint folder and onnxruntime-genai's model folder (made once
    per work folder)."""
    folder, genai = os.path.join(work, "checkpoint"), os.path.join(work, "genai")
    if not os.path.exists(os.path.join(folder, "config.json")):
        _child(python, "checkpoint", folder, size)
    if not os.path.exists(os.path.join(genai, "genai_config.json")):
        subprocess.run(
            [python, "-m", "onnxruntime_genai.models.builder"]
            + ["-i", folder, "-o", genai, "-p", "fp32", "-e", "cpu"]
            + ["-c", os.path.join(work, "builder_cache")],
            check=True,
            capture_output=True,
        )
    return folder, genai


class _GenaiChild:
    """onnxruntime-genai in the peers' Python: one generation per call."""

    def __init__(self, python: str, genai: str):
        self.process = subprocess.Popen(
            [python, "-m", "benchmarks.peers_child", "serve", genai, str(NEW_TOKENS)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.version = json.loads(self.process.stdout.readline())["ready"]

    def __call__(self, prompts: np.ndarray) -> np.ndarray:
        self.process.stdin.write(json.dumps(prompts.tolist()) + "\n")
        self.process.stdin.flush()
        return np.asarray(json.loads(self.process.stdout.readline())["tokens"])

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait()


def _candidates(folder: str, work: str, genai_child, prompts, outputs: dict):
    import keras_hub
    import onnxruntime

    from keras_selfattn import convert_causal_lm, generate
    from keras_selfattn.export import export_generator

    lm = keras_hub.models.LlamaCausalLM.from_preset(folder, preprocessor=None)
    lm.compile(sampler="greedy")
    converted = convert_causal_lm(lm)
    path = os.path.join(work, "generator.onnx")
    if os.path.exists(path):
        os.remove(path)
    export_generator(converted, path, "onnx", max_length=PROMPT + NEW_TOKENS)
    session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
    options = onnxruntime.SessionOptions()
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    sleeping = onnxruntime.InferenceSession(
        path, options, providers=["CPUExecutionProvider"]
    )
    request = {
        "prompt_tokens": prompts,
        "prompt_lengths": np.full(len(prompts), PROMPT, np.int32),
        "max_new_tokens": np.asarray(NEW_TOKENS, np.int32),
        "temperature": np.asarray(0.0, np.float32),
        "top_k": np.asarray(lm.backbone.vocabulary_size, np.int32),
        "top_p": np.asarray(1.0, np.float32),
        "seed": np.asarray(0, np.int32),
        "end_token": np.asarray(-1, np.int32),
    }
    ids = np.zeros((len(prompts), PROMPT + NEW_TOKENS), np.int32)
    ids[:, :PROMPT] = prompts
    hub_request = {"token_ids": ids, "padding_mask": ids != 0}
    hub_request["padding_mask"][:, :PROMPT] = True

    def store(name, fn):
        def call():
            outputs[name] = np.asarray(fn())

        return call

    return {
        "onnxruntime_genai": store("onnxruntime_genai", lambda: genai_child(prompts)),
        "onnx_generator": store(
            "onnx_generator", lambda: session.run(["tokens"], request)[0]
        ),
        "onnx_generator_no_spin": store(
            "onnx_generator_no_spin", lambda: sleeping.run(["tokens"], request)[0]
        ),
        "keras_selfattn_generate": store(
            "keras_selfattn_generate",
            lambda: generate(converted, prompts, NEW_TOKENS).tokens,
        ),
        "keras_hub_generate": store(
            "keras_hub_generate",
            lambda: lm.generate(
                hub_request, max_length=PROMPT + NEW_TOKENS, stop_token_ids=None
            )["token_ids"][:, PROMPT:],
        ),
    }


def run(size: str, rounds: int, python: str, work: str) -> dict:
    """Times every candidate (module docstring) at `size`."""
    os.makedirs(work, exist_ok=True)
    folder, genai = _prepare(python, work, size)
    vocabulary = json.load(open(os.path.join(folder, "config.json")))["vocab_size"]
    prompts = np.random.default_rng(0).integers(4, vocabulary, (1, PROMPT))
    prompts = prompts.astype(np.int32)
    want = json.loads(
        _child(python, "reference", folder, json.dumps(prompts[0].tolist()), "64")
    )
    child = _GenaiChild(python, genai)
    outputs: dict[str, np.ndarray] = {}
    try:
        candidates = _candidates(folder, work, child, prompts, outputs)
        before = machine.describe()["load_average_1_5_15min"]
        timed = timing.interleave(candidates, rounds=rounds, warmup=1)
    finally:
        child.close()
    rows = [
        {
            "candidate": title,
            "tokens_per_s": NEW_TOKENS * len(prompts) / timed.median(name),
            "vs_onnxruntime_genai": timed.speedup("onnxruntime_genai", name),
            "ratio_quartiles": timed.quartiles("onnxruntime_genai", name),
            "same_tokens_as_transformers": bool(
                (np.asarray(outputs[name]).reshape(-1) == np.asarray(want)).all()
            ),
        }
        for name, title in CANDIDATES
    ]
    return {
        "machine": machine.describe(),
        "load_average_before_timing": before,
        "onnxruntime_genai": child.version,
        "size": size,
        "request": f"batch 1, {PROMPT}-token prompt, {NEW_TOKENS} new greedy tokens",
        "rounds": rounds,
        "rows": rows,
    }


def to_markdown(results: dict) -> str:
    info = results["machine"]
    lines = [
        f"# Generators vs onnxruntime-genai ({results['size']} Llama)",
        "",
        f"{info['cpu']}, {info['cores']} cores; load average (1/5/15 min) "
        f"before timing {results['load_average_before_timing']}, after "
        f"{info['load_average_1_5_15min']}; onnxruntime-genai "
        f"{results['onnxruntime_genai']}; {results['request']}; "
        f"{results['rounds']} interleaved rounds, medians.",
        "",
        *report.table(
            [
                ("candidate", "candidate"),
                ("tokens_per_s", "tokens/s"),
                ("vs_onnxruntime_genai", "vs onnxruntime-genai"),
                ("same_tokens_as_transformers", "transformers' tokens"),
            ],
            results["rows"],
        ),
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    from benchmarks.peers_child import SIZES

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="153m")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--peers-python", default=".venv-peers/bin/python")
    parser.add_argument("--work", default=None, help="checkpoint and models")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    work = args.work or os.path.join("/tmp", f"keras_selfattn_peers_{args.size}")
    results = run(args.size, args.rounds, args.peers_python, work)
    paths = report.write(
        results, args.out, stem=f"peers_{args.size}", markdown=to_markdown
    )
    sys.stdout.write(to_markdown(results) + f"\n{paths[0]}\n")


if __name__ == "__main__":
    main()
