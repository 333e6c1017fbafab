"""Issue 56's 153 M Llama converted against keras-hub's own, on the current
backend: `keras_selfattn.generate` against keras-hub's `generate` (greedy),
and the forward pass, the same random weights, tokens compared.

The model is `make bench-peers`' default's shape (hidden 768, 12 layers,
12/4 heads, intermediate 3072, vocabulary 32000), built in keras-hub with
random weights (no checkpoint); batch 1 and batch 8, 16-token prompts, 64
new tokens, as `benchmarks.keras_hub` times its small models.

Run: `python -m benchmarks.keras_hub_153m [--quick] [--rounds N] [--out DIR]`
(under `KERAS_BACKEND=jax` or `torch` for those backends; `--quick`: batch
1 only). It needs about 3 GiB.
"""

from __future__ import annotations

from benchmarks import keras_hub, per_backend

SIZES = keras_hub.Sizes(vocabulary=32000, intermediate_ratio=4, new_tokens=64)
# (family, hidden, query heads, key/value heads, layers, batch)
CASES = (("Llama", 768, 12, 4, 12, 1), ("Llama", 768, 12, 4, 12, 8))
TITLE = "The 153 M Llama converted vs keras-hub's own"
TARGETS = (
    "Target (issue 56): generate speedup (keras-hub time / converted time) "
    "at least 1.5 on TensorFlow, JAX and PyTorch."
)


def run(quick: bool = False, rounds: int | None = None) -> dict:
    return keras_hub.run_cases(CASES, SIZES, quick, rounds)


def to_markdown(results: dict) -> str:
    """`run`'s results as Markdown (`per_backend.to_markdown`)."""
    return per_backend.to_markdown(
        results, TITLE, SIZES.setting(), TARGETS, keras_hub.COLUMNS
    )


if __name__ == "__main__":
    per_backend.main(__doc__, run, to_markdown, "keras_hub_153m")
