"""The matmuls of a decoder's one-token step alone, compiled as
`keras_selfattn.generate` compiles its loop on the current backend: the
fastest any generation loop could make a token there, whatever the rest
of the step costs.

A Llama's step multiplies each new position by every layer's query, key,
value, output, gate, up and down kernels and by the LM head: at batch 1
each weight is read once a token, so the step is bound by how fast the
machine reads them. Here random float32 kernels of those shapes (weights
as arguments, not constants) are multiplied by random inputs in one
compiled function: `jax.jit` on JAX, `tf.function(jit_compile=True)` on
TensorFlow, eager under `torch.no_grad` on PyTorch.
"""

from __future__ import annotations

import time

import keras
import numpy as np


def llama_kernels(
    hidden: int,
    heads: int,
    kv_heads: int,
    layers: int,
    intermediate: int,
    vocabulary: int,
) -> list[tuple[int, int]]:
    """The (in, out) shapes a Llama step multiplies by, layer by layer,
    then the LM head."""
    head_dim = hidden // heads
    per_layer = [
        (hidden, heads * head_dim),
        (hidden, kv_heads * head_dim),
        (hidden, kv_heads * head_dim),
        (heads * head_dim, hidden),
        (hidden, intermediate),
        (hidden, intermediate),
        (intermediate, hidden),
    ]
    return per_layer * layers + [(hidden, vocabulary)]


def _compiled(function):
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        return jax.jit(function)
    if backend == "tensorflow":
        import tensorflow as tf

        return tf.function(function, jit_compile=True)
    import torch

    def eager(*arrays):
        with torch.no_grad():
            return function(*arrays)

    return eager


def steps_per_second(shapes: list[tuple[int, int]], batch: int, rounds: int) -> float:
    """Median steps a second of the step's matmuls (module docstring), over
    `rounds` rounds of 16 steps after one warm-up step."""
    from keras import ops

    rng = np.random.default_rng(0)
    kernels = [
        ops.convert_to_tensor(rng.standard_normal(s, dtype=np.float32) * 0.02)
        for s in shapes
    ]
    widths = sorted({s[0] for s in shapes})
    inputs = [
        ops.convert_to_tensor(rng.standard_normal((batch, w), dtype=np.float32))
        for w in widths
    ]

    def step(inputs, kernels):
        by_width = dict(zip(widths, inputs, strict=True))
        # Every product is kept (summed), so no compiler drops one.
        sums = [ops.sum(ops.matmul(by_width[k.shape[0]], k)) for k in kernels]
        return ops.sum(ops.stack(sums))

    compiled = _compiled(step)
    ops.convert_to_numpy(compiled(inputs, kernels))
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(16):
            result = compiled(inputs, kernels)
        ops.convert_to_numpy(result)
        times.append((time.perf_counter() - start) / 16)
    return 1.0 / float(np.median(times))
