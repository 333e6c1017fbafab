"""What is benchmarked: shapes, the two layers at equal configuration, FLOPs.

`SelfAttention` and `keras.layers.MultiHeadAttention` get the same weights
(`pairs.build_layer`), so both compute the same function and only speed
differs. TensorFlow callables: this is `python -m benchmarks.cpu`'s side.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import astuple, dataclass

import keras
import numpy as np
import tensorflow as tf

from benchmarks import pairs
from keras_selfattn import SelfAttention

MASK_KINDS = ("none", "padding", "causal")


@dataclass(frozen=True)
class Shape:
    """An input shape (batch, time, features)."""

    batch: int
    time: int
    features: int

    @property
    def label(self) -> str:
        return f"({self.batch}, {self.time}, {self.features})"


@dataclass(frozen=True)
class AttentionConfig:
    """The configuration shared by both layers (biases always on)."""

    num_heads: int = 4
    key_dim: int = 64
    output_dim: int = 256


@dataclass(frozen=True)
class Plan:
    """Sizes and repetitions of one run."""

    config: AttentionConfig
    forward_shapes: list[Shape]
    export_shapes: list[Shape]
    memory_times: list[int]
    long_time: int
    long_window: int
    long_chunk: int
    rounds: int
    min_round_s: float
    long_rounds: int
    in_process: bool = False
    # Whether the issues' speed targets are judged on forward_shapes (only
    # at the full sizes: tiny shapes measure overhead, not the kernels).
    judges_targets: bool = False


FULL = Plan(
    config=AttentionConfig(num_heads=4, key_dim=64, output_dim=256),
    forward_shapes=[
        Shape(8, 128, 256),
        Shape(2, 1024, 256),
        Shape(1, 4096, 256),
    ],
    export_shapes=[Shape(8, 512, 256), Shape(1, 4096, 256)],
    memory_times=[4096, 8192],
    long_time=32768,
    long_window=256,
    long_chunk=512,
    rounds=15,
    min_round_s=0.1,
    long_rounds=3,
    judges_targets=True,
)

QUICK = Plan(
    config=AttentionConfig(num_heads=2, key_dim=8, output_dim=16),
    forward_shapes=[Shape(2, 16, 16)],
    export_shapes=[Shape(2, 16, 16)],
    memory_times=[64],
    long_time=256,
    long_window=16,
    long_chunk=64,
    rounds=3,
    min_round_s=0.0,
    long_rounds=2,
    in_process=True,
)


def row(shape: Shape, config: AttentionConfig, causal: bool = False) -> pairs.Row:
    """The `pairs.Row` of `shape` and `config` (mask "causal" or "none").

    Row's fields after the name are Shape's, then AttentionConfig's.
    """
    mask = "causal" if causal else "none"
    return pairs.Row(shape.label, *astuple(shape), *astuple(config), mask=mask)


def forward_flops(shape: Shape, config: AttentionConfig) -> int:
    """FLOPs of one forward pass: `pairs.forward_flops` (causal in full)."""
    return pairs.forward_flops(row(shape, config))


def training_flops(shape: Shape, config: AttentionConfig) -> int:
    """FLOPs of forward + backward, taken as 3x the forward (2x for backward)."""
    return pairs.train_flops(row(shape, config))


def matmul_size(flops: int) -> int:
    """Side n (a multiple of 64, >= 64) of a square matmul with about `flops`."""
    return max(64, int(round((flops / 2) ** (1 / 3) / 64)) * 64)


def matmul_fn(n: int, seed: int = 0) -> Callable[[], object]:
    """A zero-argument tf.function call of an n x n float32 matmul."""
    a = tf.constant(np.random.default_rng(seed).normal(size=(n, n)), tf.float32)
    matmul = tf.function(tf.matmul, autograph=False)
    return lambda: matmul(a, a)


def random_input(shape: Shape, seed: int = 0) -> tf.Tensor:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(shape.batch, shape.time, shape.features))
    return tf.constant(x, tf.float32)


def padding_mask(shape: Shape, seed: int = 0) -> tf.Tensor:
    """(batch, time) bool, True for real tokens (`pairs.padding_mask`)."""
    rng = np.random.default_rng(seed)
    return tf.constant(pairs.padding_mask(shape.batch, shape.time, rng))


def build_layers(
    shape: Shape, config: AttentionConfig, seed: int = 0, causal: bool = False
) -> tuple[SelfAttention, keras.layers.MultiHeadAttention]:
    """A SelfAttention and a MultiHeadAttention with the same weights
    (`pairs.build_layer`), float32; `causal` for SelfAttention."""
    pair_row = row(shape, config, causal)
    return (
        pairs.build_layer(pairs.SA, pair_row, seed=seed),
        pairs.build_layer(pairs.MHA, pair_row, seed=seed),
    )


def forward_calls(
    ours: SelfAttention,
    mha: keras.layers.MultiHeadAttention,
    x: tf.Tensor,
    mask_kind: str,
    mask: tf.Tensor | None = None,
) -> dict[str, Callable[[], tf.Tensor]]:
    """Zero-argument tf.function forward calls {"mha": ..., "ours": ...}.

    `ours` must have been built with `causal=True` for mask_kind "causal".
    For "padding", MultiHeadAttention gets the mask as query_mask and
    value_mask, as Keras' own mask propagation would pass it.
    """
    if mask_kind not in MASK_KINDS:
        raise ValueError(f"mask_kind must be one of {MASK_KINDS}: {mask_kind!r}")
    if mask_kind == "padding":
        if mask is None:
            raise ValueError("mask_kind='padding' needs `mask`")
        f_ours = tf.function(lambda x, m: ours(x, mask=m), autograph=False)
        f_mha = tf.function(
            lambda x, m: mha(x, x, query_mask=m, value_mask=m), autograph=False
        )
        return {"mha": lambda: f_mha(x, mask), "ours": lambda: f_ours(x, mask)}
    causal = mask_kind == "causal"
    f_ours = tf.function(lambda x: ours(x), autograph=False)
    f_mha = tf.function(lambda x: mha(x, x, use_causal_mask=causal), autograph=False)
    return {"mha": lambda: f_mha(x), "ours": lambda: f_ours(x)}


def _gradient_step(layer: keras.layers.Layer, apply: Callable) -> Callable:
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(apply(x)))
        return tape.gradient(loss, layer.trainable_variables)

    return tf.function(step, autograph=False)


def training_calls(
    ours: SelfAttention, mha: keras.layers.MultiHeadAttention, x: tf.Tensor
) -> dict[str, Callable[[], object]]:
    """Zero-argument tf.function calls of forward + gradients of all weights."""
    f_ours = _gradient_step(ours, lambda x: ours(x, training=True))
    f_mha = _gradient_step(mha, lambda x: mha(x, x, training=True))
    return {"mha": lambda: f_mha(x), "ours": lambda: f_ours(x)}
