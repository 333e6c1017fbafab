"""`generate` on a model whose SelfAttention layers sit inside subclassed
blocks, against the same layers and weights written flat.

The nested model is keras.io's shape: `Embedding` -> subclassed
`Block`s (each holding `SelfAttention(causal=True, rope)`, a Dense MLP,
residual Adds and LayerNormalization) -> `Dense(vocabulary)`. The flat
model calls the very same layer objects at the top level of a Functional
graph, so both compute the same tokens with the same weights; only where
the SelfAttention layers sit differs. Both are timed by
`keras_selfattn.generate` (greedy) on the backend the benchmark runs on,
interleaved, as medians of per-round ratios (`benchmarks.timing`).

Run: `python -m benchmarks.nested [--quick] [--rounds N] [--out DIR]`
(under `KERAS_BACKEND=jax` or `torch` for those backends).
"""

from __future__ import annotations

import keras
import numpy as np

from benchmarks import per_backend, timing
from keras_selfattn import SelfAttention, generate

VOCABULARY = 256
PROMPT = 16
NEW_TOKENS = 64
# (width, heads, blocks, batch)
CASES = ((64, 4, 2, 4), (256, 8, 4, 1))
# The Markdown's heading, the setting on its machine line, its targets.
TITLE = "generate: nested blocks vs the same layers flat"
SETTING = f"prompt {PROMPT}, {NEW_TOKENS} new tokens, greedy."
TARGETS = "Time ratio nested / flat (below 1.05: the target)."
COLUMNS = [
    ("model", "model"),
    ("nested_over_flat", "nested / flat time"),
    ("flat_tokens_per_s", "flat tokens/s"),
    ("same_tokens", "same tokens"),
]


class Block(keras.layers.Layer):
    """keras.io's transformer block, SelfAttention inside."""

    def __init__(self, width: int, heads: int, **kwargs):
        super().__init__(**kwargs)
        self.att = SelfAttention(
            num_heads=heads, causal=True, rope_max_wavelength=10000
        )
        self.mlp_in = keras.layers.Dense(4 * width, activation="gelu")
        self.mlp_out = keras.layers.Dense(width)
        self.norm1 = keras.layers.LayerNormalization()
        self.norm2 = keras.layers.LayerNormalization()

    def call(self, x):
        x = self.norm1(x + self.att(x))
        return self.norm2(x + self.mlp_out(self.mlp_in(x)))


def models(width: int, heads: int, blocks: int) -> tuple[keras.Model, keras.Model]:
    """(nested, flat): the same layer objects, inside blocks or top-level."""
    keras.utils.set_random_seed(0)
    embed = keras.layers.Embedding(VOCABULARY, width)
    head = keras.layers.Dense(VOCABULARY)
    stack = [Block(width, heads) for _ in range(blocks)]
    tokens = keras.Input((None,), dtype="int32", name="tokens")
    h = embed(tokens)
    for block in stack:
        h = block(h)
    nested = keras.Model(tokens, head(h), name="nested")
    tokens = keras.Input((None,), dtype="int32", name="tokens")
    h = embed(tokens)
    for block in stack:
        h = block.norm1(keras.layers.Add()([h, block.att(h)]))
        mlp = block.mlp_out(block.mlp_in(h))
        h = block.norm2(keras.layers.Add()([h, mlp]))
    flat = keras.Model(tokens, head(h), name="flat")
    return nested, flat


def _timed(model: keras.Model, prompts: np.ndarray, outputs: dict, name: str):
    def call():
        outputs[name] = generate(model, prompts, NEW_TOKENS).tokens

    return call


def run(quick: bool = False, rounds: int | None = None) -> dict:
    rounds = per_backend.rounds(quick, rounds)
    rows = []
    for width, heads, blocks, batch in CASES[:1] if quick else CASES:
        nested, flat = models(width, heads, blocks)
        prompts = np.random.default_rng(0).integers(0, VOCABULARY, (batch, PROMPT))
        outputs: dict[str, np.ndarray] = {}
        result = timing.interleave(
            {
                name: _timed(model, prompts, outputs, name)
                for name, model in (("flat", flat), ("nested", nested))
            },
            rounds=rounds,
            warmup=1,
        )
        rows.append(
            {
                "model": f"{blocks} blocks, D={width}, batch {batch}",
                "nested_over_flat": result.speedup("nested", "flat"),
                "flat_tokens_per_s": batch * NEW_TOKENS / result.median("flat"),
                "same_tokens": bool((outputs["flat"] == outputs["nested"]).all()),
            }
        )
    return per_backend.results(rounds, rows)


def to_markdown(results: dict) -> str:
    """`run`'s results as Markdown (`per_backend.to_markdown`)."""
    return per_backend.to_markdown(results, TITLE, SETTING, TARGETS, COLUMNS)


if __name__ == "__main__":
    per_backend.main(__doc__, run, to_markdown, "nested")
