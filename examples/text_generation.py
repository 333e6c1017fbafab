"""A character-level language model that decodes with a key/value cache.

The model: `Embedding` -> decoder blocks -> `Dense(vocabulary)`, each block
`SelfAttention(causal=True, rope_max_wavelength=10000,
num_key_value_heads=HEADS // 2, output_dim=WIDTH, use_bias=True)` + residual +
LayerNorm, then a Dense MLP + residual + LayerNorm. It is trained briefly on
text that ships with an installed package (Keras's own LICENSE file, read
through `importlib.metadata`; nothing is downloaded).

Then it greedily generates characters from a prompt twice, with the same
layers and weights:

- uncached: every step re-runs the full causal forward on the whole
  sequence so far (right-padded to a multiple of BUCKET positions, so a
  compiled forward sees a few shapes; causal attention keeps the padding
  from changing the last real position) and keeps that position's logits;
- cached: the prompt runs once into one cache per attention layer
  (`layer.empty_cache(batch, max_length)`), then each step runs only the new
  position, `layer(x, cache=cache, cache_update_index=position)`.

It checks that both produce the same tokens, prints tokens/s of each and
the speedup, and writes `text_generation.json`. Both run through
`predict_on_batch`, so Keras compiles them alike: `jax.jit` on JAX,
`tf.function` on TensorFlow, eager on PyTorch. Each generation runs once
untimed first (compilation of every shape), then 3 times (1 with `--fast`)
in alternating order; the speedup is the median of the per-round ratios.
The model is tiny, so per-call overhead is most of a step's time and the
speedup is modest; `python -m benchmarks.decode` measures it at contexts
512 and 2048.

Run: `.venv/bin/python examples/text_generation.py [--fast] [--out DIR]`.
"""

from __future__ import annotations

import importlib.metadata
import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import _common
import keras
import numpy as np
from keras import ops

from keras_selfattn import SelfAttention

TEXT_PACKAGE = "keras"
WIDTH = 64
HEADS = 4
KEY_VALUE_HEADS = HEADS // 2
BLOCKS = 2
SEQUENCE = 64
BATCH = 32
PROMPT = "Licensed under the Apache License"
BUCKET = 64


@keras.saving.register_keras_serializable(package="examples")
class DecoderBlock(keras.layers.Layer):
    """Causal self-attention + residual + LayerNorm, then an MLP + the same.

    Called as `block(x)` on a whole sequence, or as
    `block(x, cache=cache, cache_update_index=index)` on the positions
    `index ..` of a sequence whose earlier keys and values are in `cache`;
    then it returns `(outputs, updated cache)`.

    Args:
        width: Features in and out.
        num_heads: Query heads of the attention.
        num_key_value_heads: Key/value heads (grouped-query attention).
        **kwargs: Base layer arguments.
    """

    def __init__(self, width: int, num_heads: int, num_key_value_heads: int, **kwargs):
        super().__init__(**kwargs)
        self.width = width
        self.num_heads = num_heads
        self.num_key_value_heads = num_key_value_heads
        self.attention = SelfAttention(
            num_heads=num_heads,
            causal=True,
            num_key_value_heads=num_key_value_heads,
            rope_max_wavelength=10000,
            output_dim=width,
            use_bias=True,
            name="attention",
        )
        self.norm_1 = keras.layers.LayerNormalization(name="norm_1")
        self.mlp_in = keras.layers.Dense(4 * width, activation="gelu", name="mlp_in")
        self.mlp_out = keras.layers.Dense(width, name="mlp_out")
        self.norm_2 = keras.layers.LayerNormalization(name="norm_2")

    def build(self, input_shape):
        self.attention.build(input_shape)
        self.norm_1.build(input_shape)
        self.mlp_in.build(input_shape)
        self.mlp_out.build((*input_shape[:-1], 4 * self.width))
        self.norm_2.build(input_shape)

    def call(self, x, cache=None, cache_update_index=None):
        if cache is None:
            attended = self.attention(x)
        else:
            attended, cache = self.attention(
                x, cache=cache, cache_update_index=cache_update_index
            )
        h = self.norm_1(ops.add(x, attended))
        h = self.norm_2(ops.add(h, self.mlp_out(self.mlp_in(h))))
        return h if cache is None else (h, cache)

    def get_config(self) -> dict:
        return {
            **super().get_config(),
            "width": self.width,
            "num_heads": self.num_heads,
            "num_key_value_heads": self.num_key_value_heads,
        }


@keras.saving.register_keras_serializable(package="examples")
class CharLanguageModel(keras.Model):
    """Next-character logits from character ids, with or without caches.

    `model(tokens)` runs the full causal forward: (batch, time) ids ->
    (batch, time, vocabulary) logits; `fit` trains it. `model(tokens,
    caches=caches, cache_update_index=index)` runs the positions `index ..`
    only and returns `(logits, updated caches)`, one cache per block from
    `empty_caches`.

    Args:
        vocabulary_size: Number of distinct characters.
        width: Embedding and block width.
        num_heads: Query heads per attention layer.
        num_key_value_heads: Key/value heads per attention layer.
        blocks: Number of decoder blocks.
        **kwargs: Base model arguments.
    """

    def __init__(
        self,
        vocabulary_size: int,
        width: int = WIDTH,
        num_heads: int = HEADS,
        num_key_value_heads: int = KEY_VALUE_HEADS,
        blocks: int = BLOCKS,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.vocabulary_size = vocabulary_size
        self.width = width
        self.num_heads = num_heads
        self.num_key_value_heads = num_key_value_heads
        self.blocks = blocks
        self.embed = keras.layers.Embedding(vocabulary_size, width, name="embed")
        self.decoder_blocks = [
            DecoderBlock(width, num_heads, num_key_value_heads, name=f"block_{i}")
            for i in range(blocks)
        ]
        self.next_character = keras.layers.Dense(vocabulary_size, name="logits")

    def call(self, tokens, caches=None, cache_update_index=None):
        h = self.embed(tokens)
        if caches is None:
            for block in self.decoder_blocks:
                h = block(h)
            return self.next_character(h)
        updated = []
        for block, cache in zip(self.decoder_blocks, caches, strict=True):
            h, cache = block(h, cache=cache, cache_update_index=cache_update_index)
            updated.append(cache)
        return self.next_character(h), updated

    def empty_caches(self, batch_size: int, max_length: int) -> list:
        """One zero cache per attention layer, for `max_length` positions."""
        return [
            block.attention.empty_cache(batch_size, max_length)
            for block in self.decoder_blocks
        ]

    def get_config(self) -> dict:
        return {
            **super().get_config(),
            "vocabulary_size": self.vocabulary_size,
            "width": self.width,
            "num_heads": self.num_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "blocks": self.blocks,
        }


@dataclass(frozen=True)
class Generation:
    """One greedy generation: the new token ids and the wall time."""

    tokens: list[int]
    seconds: float


@dataclass(frozen=True)
class Comparison:
    """Timed runs of both generations, `rounds` each, alternating.

    Attributes:
        uncached: The uncached runs.
        cached: The cached runs, one per uncached run, in the same rounds.
    """

    uncached: list[Generation]
    cached: list[Generation]

    @property
    def tokens_equal(self) -> bool:
        """Whether every run of both produced the same tokens."""
        first = self.uncached[0].tokens
        return all(run.tokens == first for run in self.uncached + self.cached)

    @property
    def speedup(self) -> float:
        """Median over rounds of uncached time / cached time."""
        return statistics.median(
            u.seconds / c.seconds
            for u, c in zip(self.uncached, self.cached, strict=True)
        )

    @staticmethod
    def tokens_per_second(runs: list[Generation]) -> float:
        """Tokens per second of the run with the median time."""
        return len(runs[0].tokens) / statistics.median(r.seconds for r in runs)


def training_text(package: str = TEXT_PACKAGE) -> tuple[str, str]:
    """(text, description) of the LICENSE file shipped with `package`."""
    distribution = importlib.metadata.distribution(package)
    for file in distribution.files or []:
        if file.name.upper().startswith("LICENSE"):
            text = file.read_text(encoding="utf-8")
            return text, f"{package} {distribution.version} {file.name}"
    raise FileNotFoundError(f"{package} ships no LICENSE file")


class Vocabulary:
    """Characters <-> ids, ids in order of the sorted distinct characters."""

    def __init__(self, text: str):
        self.characters = sorted(set(text))
        self._ids = {c: i for i, c in enumerate(self.characters)}

    def __len__(self) -> int:
        return len(self.characters)

    def encode(self, text: str) -> np.ndarray:
        return np.array([self._ids[c] for c in text], dtype="int32")

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self.characters[i] for i in ids)


def windows(
    ids: np.ndarray, count: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """`count` random (inputs, next characters) windows of SEQUENCE ids."""
    starts = rng.integers(0, len(ids) - SEQUENCE - 1, size=count)
    stream = np.stack([ids[s : s + SEQUENCE + 1] for s in starts])
    return stream[:, :-1], stream[:, 1:]


def train(
    model: CharLanguageModel, ids: np.ndarray, steps: int, rng: np.random.Generator
) -> keras.callbacks.History:
    """Fits next-character prediction on `steps` batches of random windows."""
    x, y = windows(ids, steps * BATCH, rng)
    model.compile(
        keras.optimizers.Adam(3e-3),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model.fit(x, y, batch_size=BATCH, epochs=1, verbose=2)


class CachedStep(keras.Model):
    """The cached call of a `CharLanguageModel` as a model of its own.

    `step.predict_on_batch((tokens, caches, index))` returns `(logits,
    caches)` as numpy arrays; `predict_on_batch` compiles the call where
    Keras does (JAX: `jax.jit`; TensorFlow: `tf.function`; PyTorch: eager),
    once per input shape: the prompt, then one token.

    Args:
        language_model: The model whose layers and weights it runs.
        **kwargs: Base model arguments.
    """

    def __init__(self, language_model: CharLanguageModel, **kwargs):
        super().__init__(**kwargs)
        self.language_model = language_model

    def call(self, inputs):
        tokens, caches, index = inputs
        return self.language_model(
            tokens, caches=caches, cache_update_index=index, training=False
        )


def generate_uncached(
    model: CharLanguageModel, prompt: np.ndarray, steps: int
) -> Generation:
    """Greedy decoding that re-runs the full causal forward on the sequence
    so far at every step.

    The sequence is right-padded to a multiple of BUCKET positions, so
    compiled backends see a few shapes instead of one per length; padding
    after the last position cannot change its logits (causal attention).
    """
    sequence = [int(i) for i in prompt]
    start = time.perf_counter()
    for _ in range(steps):
        length = len(sequence)
        padded = np.zeros((1, -(-length // BUCKET) * BUCKET), dtype="int32")
        padded[0, :length] = sequence
        logits = model.predict_on_batch(padded)
        sequence.append(int(np.argmax(logits[0, length - 1])))
    return Generation(sequence[len(prompt) :], time.perf_counter() - start)


def generate_cached(step: CachedStep, prompt: np.ndarray, steps: int) -> Generation:
    """Greedy decoding with one key/value cache per attention layer: the
    prompt runs once into the caches, then each step runs only the newest
    position."""
    start = time.perf_counter()
    caches = [
        ops.convert_to_numpy(cache)
        for cache in step.language_model.empty_caches(1, len(prompt) + steps)
    ]
    logits, caches = step.predict_on_batch(
        (prompt[None, :], caches, np.array(0, dtype="int32"))
    )
    generated = [int(np.argmax(logits[0, -1]))]
    for position in range(len(prompt), len(prompt) + steps - 1):
        token = np.array([[generated[-1]]], dtype="int32")
        index = np.array(position, dtype="int32")
        logits, caches = step.predict_on_batch((token, caches, index))
        generated.append(int(np.argmax(logits[0, -1])))
    return Generation(generated, time.perf_counter() - start)


def compare(
    model: CharLanguageModel, prompt: np.ndarray, new_tokens: int, rounds: int
) -> Comparison:
    """Runs each generation once untimed (compiling every shape), then
    `rounds` timed runs of both, alternating which goes first."""
    step = CachedStep(model)
    runs = {
        "uncached": lambda: generate_uncached(model, prompt, new_tokens),
        "cached": lambda: generate_cached(step, prompt, new_tokens),
    }
    for run in runs.values():
        run()
    timed: dict[str, list[Generation]] = {name: [] for name in runs}
    for round_index in range(rounds):
        order = list(runs) if round_index % 2 == 0 else list(runs)[::-1]
        for name in order:
            timed[name].append(runs[name]())
    return Comparison(**timed)


def first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    """The first index where `a` and `b` differ (or the shorter length)."""
    for index, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return index
    return min(len(a), len(b))


def report(comparison: Comparison, vocabulary: Vocabulary) -> dict:
    """Prints the speed and equality lines; returns them for the JSON."""
    rounds = len(comparison.cached)
    which = "1 timed run" if rounds == 1 else f"median of {rounds} timed runs"
    for name, runs in (
        ("uncached", comparison.uncached),
        ("cached", comparison.cached),
    ):
        seconds = statistics.median(run.seconds for run in runs)
        print(
            f"{name:>8}: {len(runs[0].tokens)} tokens in {seconds:.3f} s, "
            f"{Comparison.tokens_per_second(runs):.1f} tokens/s "
            f"({which})"
        )
    print(f"speedup with the cache: {comparison.speedup:.2f}x")
    print(f"cached tokens == uncached tokens: {comparison.tokens_equal}")
    generated = vocabulary.decode(comparison.cached[0].tokens)
    print(f"generated: {generated!r}")
    return {
        "uncached": [asdict(run) for run in comparison.uncached],
        "cached": [asdict(run) for run in comparison.cached],
        "speedup": comparison.speedup,
        "tokens_equal": comparison.tokens_equal,
        "generated": generated,
    }


def main() -> None:
    args = _common.parse_args(
        __doc__.splitlines()[0],
        fast_help="train 20 steps, generate 24 characters, 1 timed run (seconds)",
    )
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    text, source = training_text()
    vocabulary = Vocabulary(text)
    print(
        f"training text: {source}, {len(text)} characters, {len(vocabulary)} distinct"
    )
    steps, new_tokens, rounds = (20, 24, 1) if args.fast else (600, 200, 3)
    model = CharLanguageModel(len(vocabulary))
    start = time.perf_counter()
    history = train(model, vocabulary.encode(text), steps, rng)
    loss = history.history["loss"][-1]
    print(
        f"trained {steps} steps in {time.perf_counter() - start:.1f} s, loss {loss:.3f}"
    )

    print(f"prompt: {PROMPT!r}, greedy, {new_tokens} new characters")
    comparison = compare(model, vocabulary.encode(PROMPT), new_tokens, rounds)
    results = {
        "backend": keras.backend.backend(),
        "text": source,
        "prompt": PROMPT,
        "training_steps": steps,
        "final_loss": loss,
        **report(comparison, vocabulary),
    }
    path = _common.write_replacing(
        args.out / "text_generation.json",
        lambda tmp: tmp.write_text(json.dumps(results, indent=2) + "\n"),
    )
    print(f"results: {path}")
    if not comparison.tokens_equal:
        first = first_difference(
            comparison.uncached[0].tokens, comparison.cached[0].tokens
        )
        raise SystemExit(f"cached and uncached tokens differ from token {first} on")


if __name__ == "__main__":
    main()
