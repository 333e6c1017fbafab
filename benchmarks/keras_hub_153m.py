"""Issue 56's 153 M Llama converted against keras-hub's own, on the current
backend: `keras_selfattn.generate` against keras-hub's `generate` (greedy),
and the forward pass, the same random weights, tokens compared.

The model is `make bench-peers`' default's shape (hidden 768, 12 layers,
12/4 heads, intermediate 3072, vocabulary 32000), built in keras-hub with
random weights (no checkpoint); batch 1 and batch 8, 16-token prompts, 64
new tokens, as `benchmarks.keras_hub` times its small models. Each row also
gives the step's matmuls alone (`matmul_bound`: the same shapes, compiled
as the loop is) as tokens a second, and the most `generate` speedup over
keras-hub that leaves room for: keras-hub's time a token over the matmuls'
alone (below 1.5, no loop on this backend and machine reaches the target).

Run: `python -m benchmarks.keras_hub_153m [--quick] [--rounds N] [--out DIR]`
(under `KERAS_BACKEND=jax` or `torch` for those backends; `--quick`: batch
1 only). It needs about 3 GiB.
"""

from __future__ import annotations

from benchmarks import keras_hub, matmul_bound, per_backend

SIZES = keras_hub.Sizes(vocabulary=32000, intermediate_ratio=4, new_tokens=64)
# (family, hidden, query heads, key/value heads, layers, batch)
CASES = (("Llama", 768, 12, 4, 12, 1), ("Llama", 768, 12, 4, 12, 8))
COLUMNS = [
    *keras_hub.COLUMNS,
    ("matmuls_alone_tokens_per_s", "matmuls alone tokens/s"),
    ("speedup_bound", "most speedup the matmuls leave"),
]
TITLE = "The 153 M Llama converted vs keras-hub's own"
TARGETS = (
    "Target (issue 56): generate speedup (keras-hub time / converted time) "
    "at least 1.5 on TensorFlow, JAX and PyTorch."
)


def run(quick: bool = False, rounds: int | None = None) -> dict:
    results = keras_hub.run_cases(CASES, SIZES, quick, rounds)
    for row, case in zip(results["rows"], CASES, strict=False):
        _, hidden, heads, kv_heads, layers, batch = case
        shapes = matmul_bound.llama_kernels(
            hidden,
            heads,
            kv_heads,
            layers,
            SIZES.intermediate_ratio * hidden,
            SIZES.vocabulary,
        )
        steps = matmul_bound.steps_per_second(shapes, batch, results["rounds"])
        keras_hub_tokens = row["converted_tokens_per_s"] / row["generate_speedup"]
        row["matmuls_alone_tokens_per_s"] = batch * steps
        row["speedup_bound"] = batch * steps / keras_hub_tokens
    return results


def to_markdown(results: dict) -> str:
    """`run`'s results as Markdown (`per_backend.to_markdown`)."""
    return per_backend.to_markdown(results, TITLE, SIZES.setting(), TARGETS, COLUMNS)


if __name__ == "__main__":
    per_backend.main(__doc__, run, to_markdown, "keras_hub_153m")
