"""Dropout on attention weights from one seed drawn per call.

The layer draws a seed once per call from its seed generator, outside any
loop; each block of the chunked path derives its own seed from it and its
position. So a block's mask is the same when the backward pass recomputes
the block (rematerialization), and no seed state is updated inside a traced
loop (which JAX rejects).
"""

from __future__ import annotations

import keras
from keras import ops


def _uniform(shape, seed, offset):
    """Uniform [0, 1) float32 noise of `shape` from a (2,) seed tensor and an
    int offset (a Python int or a scalar int tensor), statelessly."""
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        key = jax.random.fold_in(ops.cast(seed, "uint32"), offset)
        return jax.random.uniform(key, shape, dtype="float32")
    if backend == "tensorflow":
        import tensorflow as tf

        seed = tf.cast(seed, "int64") + tf.stack(
            [tf.constant(0, "int64"), tf.cast(offset, "int64")]
        )
        return tf.random.stateless_uniform(shape, seed=seed, dtype="float32")
    if backend == "torch":
        import torch

        first, second = (int(value) for value in ops.convert_to_numpy(seed))
        generator = torch.Generator(device=seed.device)
        generator.manual_seed(
            (first * 1_000_003 + second + int(offset)) & 0xFFFFFFFFFFFF
        )
        return torch.rand(tuple(shape), generator=generator, device=seed.device)
    raise ValueError(
        "SelfAttention's dropout runs on the tensorflow, jax and torch "
        f"backends. Received: backend={backend!r}"
    )


class SeededDropout:
    """Dropout of rate `rate` whose noise depends only on `seed` and an offset.

    Args:
        rate: Fraction of the weights to drop, in (0, 1).
        seed: A (2,) int tensor, drawn once per call (e.g. from
            `keras.random.SeedGenerator.next()`).

    Call arguments:
        weights: The attention weights of one block.
        offset: Which block (an int or scalar int tensor); blocks with
            different offsets draw independent masks.

    Returns:
        The weights with dropped entries at 0 and the rest scaled by
        `1 / (1 - rate)`, in the weights' dtype.
    """

    def __init__(self, rate: float, seed):
        self.rate = rate
        self.seed = seed

    def __call__(self, weights, offset=0):
        noise = _uniform(ops.shape(weights), self.seed, offset)
        kept = ops.divide(weights, ops.cast(1.0 - self.rate, weights.dtype))
        return ops.where(
            ops.greater_equal(noise, self.rate), kept, ops.zeros_like(weights)
        )
