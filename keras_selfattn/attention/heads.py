"""Splitting projections into heads and merging them back.

Each implementation declares the layout it computes in: `(B, T, H, D)`, the
layout of `keras.ops.dot_product_attention` and the fused kernels, or
`(B, H, T, D)`, where the explicit and chunked paths' batched matmuls need
no transposes (B = batch, T = time, H = heads, D = head size).
"""

from __future__ import annotations

import keras
from keras import ops

TIME_FIRST = "BTHD"
HEADS_FIRST = "BHTD"


def split(x, num_heads: int, layout: str):
    """(B, T, H*D) -> (B, T, H, D) or (B, H, T, D), as `layout` says.

    On TensorFlow, split and stack rather than reshape: x usually comes from a
    projection whose kernel ends in a reshape, and Grappler folds two
    reshapes into one, so with time 0 a -1 batch was resolved from an empty
    tensor and came out as 1 instead of B (and tf2onnx miscompiles reshapes
    whose batch size is read from the tensor's dynamic shape). A time that
    is statically 1 is never 0: there a reshape to a -1 batch, one op where
    splitting and stacking take two and copy. Elsewhere a
    reshape, which XLA's sharding propagation follows (heads split over
    devices stay local).
    """
    heads_axis = 1 if layout == HEADS_FIRST else 2
    if keras.backend.backend() == "tensorflow":
        if num_heads == 1:
            return ops.expand_dims(x, heads_axis)
        if x.shape[1] == 1:
            # One position (each step of decoding): a reshape, in either
            # layout, whose -1 batch is never read from an empty tensor.
            shape = [1, x.shape[-1] // num_heads]
            shape.insert(heads_axis - 1, num_heads)
            return ops.reshape(x, (-1, *shape))
        return ops.stack(ops.split(x, num_heads, axis=-1), axis=heads_axis)
    batch, time, width = ops.shape(x)
    x = ops.reshape(x, (batch, time, num_heads, width // num_heads))
    return ops.transpose(x, (0, 2, 1, 3)) if layout == HEADS_FIRST else x


def merge(x, layout: str):
    """(B, T, H, D) or (B, H, T, D), as `layout` says -> (B, T, H*D)."""
    if layout == HEADS_FIRST:
        if keras.backend.backend() == "tensorflow" and x.shape[1] == 1:
            return ops.squeeze(x, 1)
        x = ops.transpose(x, (0, 2, 1, 3))
    batch, time, heads, depth = ops.shape(x)
    if keras.backend.backend() == "tensorflow":
        # -1 batch: see `split`.
        return ops.reshape(x, (-1, time, heads * depth))
    return ops.reshape(x, (batch, time, heads * depth))


def transpose(x):
    """(B, T, H, D) <-> (B, H, T, D)."""
    return ops.transpose(x, (0, 2, 1, 3))


def repeat(x, repeats: int, layout: str):
    """Each head of x repeated `repeats` times in place, along the heads axis:
    head g becomes heads g * repeats .. (g + 1) * repeats - 1 (the grouping
    of `keras.layers.GroupQueryAttention`).

    On TensorFlow, split and concatenate rather than `tf.repeat`, which
    reshapes (see `split`). On PyTorch, unstack and stack rather than
    `repeat_interleave`: litert_torch converts `repeat_interleave` of a
    single key head (`num_key_value_heads=1`) in a SelfAttention model into
    a LiteRT model that is silently wrong (max errors 1.6 to 2.5 on small
    models, litert-torch 0.10), and unstacking reads no size, which
    `torch.jit.trace` would give as a tensor.
    """
    if repeats == 1:
        return x
    heads_axis = 1 if layout == HEADS_FIRST else 2
    backend = keras.backend.backend()
    if backend == "tensorflow":
        parts = ops.split(x, x.shape[heads_axis], axis=heads_axis)
        return ops.concatenate(
            [part for part in parts for _ in range(repeats)], axis=heads_axis
        )
    if backend == "torch":
        parts = ops.unstack(x, axis=heads_axis)
        return ops.stack(
            [part for part in parts for _ in range(repeats)], axis=heads_axis
        )
    return ops.repeat(x, repeats, axis=heads_axis)
