"""A quantized model's ONNX generator against the quantized Keras model, one
prefix at a time: where greedy tokens can be compared at all.

Keras's int8 scheme quantizes each layer's input per token, so a last-ulp
difference in the float ops before it (a norm, the attention) moves a
value across a rounding boundary and changes an integer. Over a 153 M
Llama with random weights, whose top two logits are often a few hundredths
apart, that changes greedy tokens: Keras's own computations disagree with
each other, and a free-running generation diverges for good at its first
disagreement (`benchmarks.peers --quantize int8` then compares little
more than the first token). Here every candidate continues the same
prefixes instead (teacher forcing): the prompt, then the uncached forward
pass's own greedy tokens. At each prefix the next token of

- the quantized Keras model's uncached forward pass (the reference, with
  the gap between its top two logits),
- `keras_selfattn.generate` of that model (TensorFlow, its default XLA),
- the ONNX generator of that model (`export_generator`, in onnxruntime),

is recorded, and the results file counts agreements by the reference's gap.

    make bench-peers PEERS_ARGS="--quantize int8"   # makes the checkpoint
    .venv/bin/python -m benchmarks.forced_tokens --quantize int8 [--size 153m]
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

from benchmarks import machine, report
from benchmarks.peers_child import SIZES

# The reference's top-two gaps the summary splits at.
GAPS = (0.05, 0.1, 0.15)


def _next_tokens(model, onnx_generator, prefix: np.ndarray, vocabulary: int):
    """(reference token, its top-two gap, generate's, the ONNX file's)."""
    import keras

    import keras_selfattn

    logits = keras.ops.convert_to_numpy(model(prefix))[0, -1]
    second, first = np.argsort(logits)[-2:]
    length = prefix.shape[1]
    generated = keras_selfattn.generate(model, prefix, 1, max_length=length + 2)
    request = {
        "prompt_tokens": prefix,
        "prompt_lengths": np.array([length], np.int32),
        "max_new_tokens": np.array(1, np.int32),
        "temperature": np.array(0.0, np.float32),
        "top_k": np.array(vocabulary, np.int32),
        "top_p": np.array(1.0, np.float32),
        "seed": np.array(0, np.int32),
        "end_token": np.array(-1, np.int32),
    }
    onnx_tokens = onnx_generator(request)["tokens"]
    gap = float(logits[first] - logits[second])
    return int(first), gap, int(generated.tokens[0, 0]), int(onnx_tokens[0, 0])


def run(args: argparse.Namespace) -> dict:
    """Exports the quantized model's ONNX generator, then compares every
    prefix's next token (module docstring)."""
    import keras_hub

    import keras_selfattn_runtimes as runtimes
    from keras_selfattn import convert_causal_lm
    from keras_selfattn.export import export_generator

    folder = os.path.join(args.work, "checkpoint")
    lm = keras_hub.models.LlamaCausalLM.from_preset(folder, preprocessor=None)
    model = convert_causal_lm(lm)
    model.quantize(args.quantize)
    vocabulary = lm.backbone.vocabulary_size
    max_length = args.prompt + args.tokens + 1
    path = os.path.join(args.work, f"forced_{args.quantize}.onnx")
    for name in os.listdir(args.work):  # this benchmark's file of a run before
        if name.startswith(os.path.basename(path)):
            os.remove(os.path.join(args.work, name))
    export_generator(model, path, "onnx", max_length=max_length, check=False)
    onnx_generator = runtimes.load("onnx", path)  # as benchmarks.peers
    prefix = np.random.default_rng(0).integers(4, vocabulary, (1, args.prompt))
    prefix = prefix.astype(np.int32)
    rows = []
    for index in range(args.tokens):
        reference, gap, generated, onnx_token = _next_tokens(
            model, onnx_generator, prefix, vocabulary
        )
        rows.append(
            {
                "prefix": prefix.shape[1],
                "gap": gap,
                "generate_agrees": generated == reference,
                "onnx_agrees": onnx_token == reference,
            }
        )
        prefix = np.concatenate([prefix, [[reference]]], axis=1).astype(np.int32)
        print(index, rows[-1], flush=True)
    return {
        "machine": machine.describe(),
        "quantize": args.quantize,
        "size": args.size,
        "rows": rows,
        "summary": _summary(rows),
    }


def _summary(rows: list[dict]) -> list[dict]:
    """Agreements with the reference, all prefixes and by its gap."""
    groups = [("all", rows)]
    for low in GAPS:
        groups.append((f"gap < {low}", [r for r in rows if r["gap"] < low]))
        groups.append((f"gap >= {low}", [r for r in rows if r["gap"] >= low]))
    return [
        {
            "prefixes": name,
            "count": len(group),
            "generate": sum(r["generate_agrees"] for r in group),
            "onnx_generator": sum(r["onnx_agrees"] for r in group),
        }
        for name, group in groups
    ]


def to_markdown(results: dict) -> str:
    info = results["machine"]
    return (
        "\n".join(
            [
                f"# Next tokens on the same prefixes ({results['size']} Llama, "
                f"{results['quantize']})",
                "",
                f"{info['cpu']}, {info['cores']} cores; commit {info['git_commit']}; "
                f"{info['date_utc']}. The quantized Keras model's uncached forward "
                "pass is the reference; each row counts the prefixes where a "
                "candidate's next token equals it.",
                "",
                *report.table(
                    [
                        ("prefixes", "prefixes (reference's top-two logit gap)"),
                        ("count", "count"),
                        ("generate", "keras_selfattn.generate agrees"),
                        ("onnx_generator", "ONNX generator agrees"),
                    ],
                    results["summary"],
                ),
                "",
                *report.table(
                    [
                        ("prefix", "prefix length"),
                        (lambda r: f"{r['gap']:.4f}", "gap"),
                        ("generate_agrees", "generate agrees"),
                        ("onnx_agrees", "ONNX agrees"),
                    ],
                    results["rows"],
                ),
            ]
        )
        + "\n"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="153m")
    parser.add_argument("--quantize", choices=("int8", "int4"), default="int8")
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=48, help="prefixes compared")
    parser.add_argument(
        "--work", default=None, help="benchmarks.peers' folder (its checkpoint/)"
    )
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    args.work = args.work or os.path.join("/tmp", f"keras_selfattn_peers_{args.size}")
    results = run(args)
    stem = f"forced_tokens_{args.size}_{args.quantize}"
    paths = report.write(results, args.out, stem=stem, markdown=to_markdown)
    sys.stdout.write(to_markdown(results) + f"\n{paths[0]}\n")


if __name__ == "__main__":
    main()
