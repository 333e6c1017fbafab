"""The generators against a runtime's own generation loop: onnxruntime-genai.

One transformers `LlamaForCausalLM` checkpoint with random weights (and a
word-level tokenizer) in a folder (`peers_child`, SIZES); onnxruntime-genai's
model builder writes its fp32 CPU model from the folder; keras-hub loads the
same folder (`LlamaCausalLM.from_preset(folder)`), converted by
`keras_selfattn.convert_causal_lm` and exported as each generator (their own
fresh-process checks skipped: every candidate's tokens are compared with
transformers' greedy tokens here). Greedy, interleaved rounds in one process
tree (onnxruntime-genai in a child process of the peers' own virtualenv,
answering one generation per request):

- onnxruntime-genai (`-p fp32 -e cpu`), its C++ loop;
- the ONNX generator (`export_generator(..., "onnx")`) in onnxruntime, with
  the default session options and with `session.intra_op.allow_spinning`
  "0" (its idle threads sleep instead of spinning: on a shared machine);
- the SavedModel generator, XLA off (TF Serving's default on a CPU) and
  written with `jit_compile=True`; the LiteRT generator (`--generators`);
- `keras_selfattn.generate` on TensorFlow;
- keras-hub's own `generate` (greedy sampler).

`--quantize int4` (or int8) quantizes the converted model with Keras
(`model.quantize`, its defaults: int4 weight-only in blocks of 128 inputs
with zero points) and compares onnxruntime-genai's own quantized model of
the same checkpoint (`-p int4 -e cpu`, `GENAI_QUANTIZED`: blocks of 128,
its CPU default accuracy level 4, int8 activations;
`--genai-accuracy-level 1` builds it with float activations, as Keras's
int4 computes) with the ONNX
generator (and any `--generators`) and `keras_selfattn.generate` of the
quantized model, whose tokens are the reference (onnxruntime-genai's
quantized tokens differ: its own rounding; reported, not required; int8's
tokens part from any other computation's within a few tokens on this
model, its per-token activation rounding: `benchmarks.forced_tokens`
compares them on the same prefixes);
keras-hub's `generate` is left out (its attention stays float). With
int4, the ONNX generator is also written with `int4_inputs="int8"`: its
4-bit layers' inputs rounded to int8 in blocks, as onnxruntime-genai's
level 4 rounds them (each row gives its share of onnxruntime-genai's
tokens too).
`--batch`, `--prompt` and `--new` set the request (default batch 1, a
16-token prompt, 64 new tokens); `--busy K` keeps K other processes
computing (a numpy matmul loop each, one thread) while the candidates are
timed: a shared machine. The machine (CPU, cores, load average) is in the
results file (`benchmarks/results/peers_SIZE[_GENERATORS][_QUANTIZE]...`:
the generators named where `--generators` chose some; Markdown by
`peers_report`).

    make bench-peers                       # the 153M model (issue 56)
    .venv/bin/python -m benchmarks.peers --size tiny --rounds 5 \\
        --peers-python /work/peers-venv/bin/python --batch 8 --busy 2
    make bench-peers PEERS_ARGS="--quantize int4"
    make bench-peers PEERS_ARGS="--quantize int4 --genai-accuracy-level 1"
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys

import numpy as np

from benchmarks import machine, report, timing
from benchmarks.generation import greedy_request
from benchmarks.peers_report import TRANSFORMERS, to_markdown

CANDIDATES = (
    ("onnxruntime_genai", "onnxruntime-genai (fp32, cpu)"),
    ("onnx_generator", "ONNX generator in onnxruntime"),
    ("onnx_generator_no_spin", "ONNX generator, threads not spinning"),
    ("onnx_int8_inputs_generator", 'ONNX generator, int4_inputs="int8"'),
    (
        "onnx_int8_inputs_generator_no_spin",
        'ONNX generator, int4_inputs="int8", threads not spinning',
    ),
    ("saved_model_generator", "SavedModel generator (XLA off)"),
    ("saved_model_generator_xla", "SavedModel generator, jit_compile=True"),
    ("litert_generator", "LiteRT generator"),
    ("keras_selfattn_generate", "keras_selfattn.generate (TensorFlow)"),
    ("keras_hub_generate", "keras-hub generate"),
)
# The exported generators `--generators` may name: (format, export options).
GENERATORS = {
    "onnx": ("onnx", {}),
    "onnx_int8_inputs": ("onnx", {"int4_inputs": "int8"}),
    "saved_model": ("saved_model", {"name": "lm"}),
    "saved_model_xla": ("saved_model", {"name": "lm", "jit_compile": True}),
    "litert": ("litert", {}),
}
# What a float model's run exports (`int4_inputs` changes only 4-bit layers).
FLOAT_GENERATORS = ("onnx", "saved_model", "saved_model_xla", "litert")
# onnxruntime-genai's builder options for a quantized model: Keras's int4
# block size (the builder's default is 32); its accuracy level is its CPU
# default (4: int8 activations).
GENAI_QUANTIZED = {"int4": ["block_size=128"], "int8": ["block_size=128"]}
# A busy process: one thread multiplying matrices until it is killed.
BUSY = (
    "import os; os.environ['OMP_NUM_THREADS'] = '1'; "
    "import numpy as np; a = np.random.rand(384, 384)\n"
    "while True: a = (a @ a) / 384"
)


def _child(python: str, *args: str) -> str:
    return subprocess.run(
        [python, "-m", "benchmarks.peers_child", *args],
        check=True,
        capture_output=True,
        text=True,
    ).stdout


def genai_options(quantize: str | None, accuracy_level: int | None) -> list[str]:
    """onnxruntime-genai's builder's extra options for a `quantize` model:
    `GENAI_QUANTIZED`'s, and `accuracy_level` where given (1: float
    activations, as Keras's int4 and the ONNX generator compute; 4: int8)."""
    if not quantize:
        return []
    level = [] if accuracy_level is None else [f"accuracy_level={accuracy_level}"]
    return [*GENAI_QUANTIZED[quantize], *level]


def _prepare(
    python: str,
    work: str,
    size: str,
    quantize: str | None = None,
    accuracy_level: int | None = None,
) -> tuple[str, str]:
    """The checkpoint folder and onnxruntime-genai's model folder (fp32, or
    `quantize` with `genai_options`; made once per work folder)."""
    folder = os.path.join(work, "checkpoint")
    genai = os.path.join(work, f"genai_{quantize}" if quantize else "genai")
    if quantize and accuracy_level is not None:
        genai += f"_level{accuracy_level}"
    if not os.path.exists(os.path.join(folder, "config.json")):
        _child(python, "checkpoint", folder, size)
    if not os.path.exists(os.path.join(genai, "genai_config.json")):
        options = genai_options(quantize, accuracy_level)
        extra = ["--extra_options", *options] if options else []
        subprocess.run(
            [python, "-m", "onnxruntime_genai.models.builder"]
            + ["-i", folder, "-o", genai, "-p", quantize or "fp32", "-e", "cpu"]
            + ["-c", os.path.join(work, "builder_cache"), *extra],
            check=True,
            capture_output=True,
        )
    return folder, genai


class _GenaiChild:
    """onnxruntime-genai in the peers' Python: one generation per call."""

    def __init__(self, python: str, genai: str, new: int):
        self.process = subprocess.Popen(
            [python, "-m", "benchmarks.peers_child", "serve", genai, str(new)],
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


@contextlib.contextmanager
def _busy(count: int):
    """`count` processes keeping cores busy while the block runs."""
    processes = [
        subprocess.Popen([sys.executable, "-c", BUSY], env={**os.environ})
        for _ in range(count)
    ]
    try:
        yield
    finally:
        for process in processes:
            process.kill()
            process.wait()


def _exported(
    converted, work: str, generators: list[str], max_length: int, tag: str = ""
):
    """Each generator of `generators` (GENERATORS' names), loaded: name ->
    a callable from the request to its outputs (files named with `tag`)."""
    import keras_selfattn_runtimes as runtimes
    from keras_selfattn.export import export_generator

    loaded = {}
    for name in generators:
        export_format, options = GENERATORS[name]
        suffix = {"onnx": ".onnx", "litert": ".tflite", "saved_model": ""}
        path = os.path.join(work, f"generator_{name}{tag}{suffix[export_format]}")
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)
        written = export_generator(
            converted,
            path,
            export_format,
            max_length=max_length,
            check=False,
            **options,
        )
        if export_format == "onnx":
            key = f"{name}_generator"  # onnx_generator, onnx_int8_inputs_generator
            loaded[key] = runtimes.load("onnx", written)
            loaded[f"{key}_no_spin"] = runtimes.load("onnx", written, spinning=False)
        elif export_format == "saved_model":
            # TensorFlow's XLA as it is: the jit_compile generator needs it.
            key = name.replace("saved_model", "saved_model_generator")
            loaded[key] = runtimes.load(
                "saved_model", written, "generate", tf_serving=False
            )
        else:
            loaded["litert_generator"] = runtimes.load("litert", written, "generate")
    return loaded


def _candidates(folder, work, genai_child, prompts, new, generators, outputs, mode):
    """The timed callables; a `mode` ("int4", "int8") quantizes the
    converted model first (keras-hub's `generate` then left out)."""
    import keras_hub

    from keras_selfattn import convert_causal_lm, generate

    lm = keras_hub.models.LlamaCausalLM.from_preset(folder, preprocessor=None)
    lm.compile(sampler="greedy")
    converted = convert_causal_lm(lm)
    if mode:
        converted.quantize(mode)
    batch, prompt = prompts.shape
    tag = f"_{mode}" if mode else ""
    loaded = _exported(converted, work, generators, prompt + new, tag)
    request = greedy_request(prompts, new, lm.backbone.vocabulary_size)
    ids = np.zeros((batch, prompt + new), np.int32)
    ids[:, :prompt] = prompts
    hub_request = {"token_ids": ids, "padding_mask": ids != 0}
    hub_request["padding_mask"][:, :prompt] = True

    def store(name, fn):
        def call():
            outputs[name] = np.asarray(fn())

        return call

    def tokens(runner):
        return lambda: runner(request)["tokens"]

    hub = {
        "keras_hub_generate": store(
            "keras_hub_generate",
            lambda: lm.generate(
                hub_request, max_length=prompt + new, stop_token_ids=None
            )["token_ids"][:, prompt:],
        ),
    }
    return {
        "onnxruntime_genai": store("onnxruntime_genai", lambda: genai_child(prompts)),
        **{name: store(name, tokens(runner)) for name, runner in loaded.items()},
        "keras_selfattn_generate": store(
            "keras_selfattn_generate",
            lambda: generate(converted, prompts, new).tokens,
        ),
        **({} if mode else hub),
    }


def run(args: argparse.Namespace, work: str) -> dict:
    """Times every candidate (module docstring) as `args` say."""
    os.makedirs(work, exist_ok=True)
    python = args.peers_python
    folder, genai = _prepare(
        python, work, args.size, args.quantize, args.genai_accuracy_level
    )
    vocabulary = json.load(open(os.path.join(folder, "config.json")))["vocab_size"]
    prompts = np.random.default_rng(0).integers(
        4, vocabulary, (args.batch, args.prompt)
    )
    prompts = prompts.astype(np.int32)
    want = None
    if not args.quantize:
        want = np.asarray(
            json.loads(
                _child(
                    python,
                    "reference",
                    folder,
                    json.dumps(prompts.tolist()),
                    str(args.new),
                )
            )
        )
    child = _GenaiChild(python, genai, args.new)
    outputs: dict[str, np.ndarray] = {}
    try:
        candidates = _candidates(
            folder,
            work,
            child,
            prompts,
            args.new,
            args.generators,
            outputs,
            args.quantize,
        )
        with _busy(args.busy):
            before = machine.describe()["load_average_1_5_15min"]
            timed = timing.interleave(candidates, rounds=args.rounds, warmup=1)
            during = machine.describe()["load_average_1_5_15min"]
    finally:
        child.close()
    if args.quantize:  # the quantized Keras model's own tokens
        want = outputs["keras_selfattn_generate"]
    genai_tokens = np.asarray(outputs["onnxruntime_genai"]).reshape(want.shape)
    rows = [
        {
            "candidate": title.replace("fp32", args.quantize or "fp32"),
            "tokens_per_s": args.new * args.batch / timed.median(name),
            "vs_onnxruntime_genai": timed.speedup("onnxruntime_genai", name),
            "ratio_quartiles": timed.quartiles("onnxruntime_genai", name),
            "same_tokens_as_reference": bool(
                np.array_equal(np.asarray(outputs[name]).reshape(want.shape), want)
            ),
            "share_of_reference_tokens": float(
                np.mean(np.asarray(outputs[name]).reshape(want.shape) == want)
            ),
            "share_of_onnxruntime_genai_tokens": float(
                np.mean(np.asarray(outputs[name]).reshape(want.shape) == genai_tokens)
            ),
        }
        for name, title in CANDIDATES
        if name in candidates
    ]
    return {
        "machine": machine.describe(),
        "load_average_before_timing": before,
        "load_average_end_of_timing": during,
        "busy_processes": args.busy,
        "onnxruntime_genai": child.version,
        "quantize": args.quantize,
        "onnxruntime_genai_builder": f"-p {args.quantize or 'fp32'} -e cpu"
        + (
            " --extra_options "
            + " ".join(genai_options(args.quantize, args.genai_accuracy_level))
            if args.quantize
            else ""
        ),
        "reference_tokens": f"keras_selfattn.generate of the {args.quantize} model"
        if args.quantize
        else TRANSFORMERS,
        "size": args.size,
        "request": f"batch {args.batch}, {args.prompt}-token prompts, "
        f"{args.new} new greedy tokens",
        "rounds": args.rounds,
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> None:
    from benchmarks.peers_child import SIZES

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="153m")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--busy", type=int, default=0, help="busy processes beside")
    parser.add_argument(
        "--quantize",
        choices=sorted(GENAI_QUANTIZED),
        default=None,
        help="Keras's model.quantize(MODE) against onnxruntime-genai's MODE model",
    )
    parser.add_argument(
        "--genai-accuracy-level",
        type=int,
        choices=(1, 2, 3, 4),
        default=None,
        help="with --quantize: onnxruntime-genai's MatMulNBits accuracy level "
        "(1: float activations, as Keras's; its CPU default is 4: int8)",
    )
    parser.add_argument(
        "--generators",
        type=lambda text: text.split(","),
        default=None,
        help=f"comma-separated, of {','.join(GENERATORS)}",
    )
    parser.add_argument("--peers-python", default=".venv-peers/bin/python")
    parser.add_argument("--work", default=None, help="checkpoint and models")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    chosen = args.generators
    if args.generators is None:  # LiteRT refuses a quantized model's loop
        args.generators = ["onnx"] if args.quantize else list(FLOAT_GENERATORS)
        if args.quantize == "int4":
            args.generators.append("onnx_int8_inputs")
    unknown = sorted(set(args.generators) - set(GENERATORS))
    if unknown:
        parser.error(f"--generators: unknown {unknown}; of {sorted(GENERATORS)}")
    if args.genai_accuracy_level is not None and not args.quantize:
        parser.error("--genai-accuracy-level is for a --quantize model")
    work = args.work or os.path.join("/tmp", f"keras_selfattn_peers_{args.size}")
    results = run(args, work)
    # A run of some generators only (`--generators`) names them.
    stem = f"peers_{args.size}" + "".join(f"_{name}" for name in chosen or ())
    stem += f"_{args.quantize}" if args.quantize else ""
    if args.quantize and args.genai_accuracy_level is not None:
        stem += f"_genai_level{args.genai_accuracy_level}"
    if (args.batch, args.prompt, args.new) != (1, 16, 64):
        stem += f"_b{args.batch}_p{args.prompt}_n{args.new}"
    if args.busy:
        stem += f"_busy{args.busy}"
    paths = report.write(results, args.out, stem=stem, markdown=to_markdown)
    sys.stdout.write(to_markdown(results) + f"\n{paths[0]}\n")


if __name__ == "__main__":
    main()
