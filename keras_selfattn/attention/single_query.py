"""The single-query path: one new position attending a key/value cache.

A decoding call with one query (each step of a generation loop) reads the
whole cache, `(B, Tk, H_kv, D)`, for a `(B, 1, H, D)` query. The explicit
path would transpose both caches to the heads-first layout, repeat them to
the query's heads and run two batched matmuls; on TensorFlow's CPU kernels
those transposes and matmuls of a `(1, Tk)` row cost more than the
attention's arithmetic (on a 2-block, D=64 model decoding from a 288-slot
cache they were most of a step's time). Here the scores and the output are
elementwise products reduced over one axis, in the cache's own time-first
layout, with each key/value head shared by its group of query heads in
place: no transpose, no repeat, no matmul.

The numbers are the explicit path's: scores and softmax in float32, masked
keys at weight exactly 0. Every query is a real position that attends
itself (this path takes no `attention_mask`), so no row is empty.

Shapes use B = batch, Tk = keys, H = query heads, G = query heads per
key/value head, K = key_dim, V = value_dim.
"""

from __future__ import annotations

import keras
from keras import ops

from keras_selfattn.attention import masks as masks_lib
from keras_selfattn.attention.explicit import MASK_VALUE
from keras_selfattn.attention.masks import Masks


def _grouped(query, kv_heads: int):
    """(B, 1, H, K) -> (B, 1, H_kv, G, K): query heads grouped by the
    key/value head they share (consecutive heads, as `heads.repeat`)."""
    _, _, num_heads, depth = query.shape
    shape = (1, kv_heads, num_heads // kv_heads, depth)
    if keras.backend.backend() == "tensorflow":
        # -1 batch: the batch size is not read from a dynamic shape, which
        # tf2onnx miscompiles (see `heads.split`).
        return ops.reshape(query, (-1, *shape))
    return ops.reshape(query, (ops.shape(query)[0], *shape))


def _key_mask(masks: Masks, key_len):
    """Bool `(B or 1, Tk, 1, 1)`, True where the query may attend the key,
    or None."""
    mask = masks_lib.block(masks, query_len=1, key_len=key_len)
    if mask is None:
        return None
    # (B or 1, 1, 1, Tk) -> (B or 1, Tk, 1, 1)
    return ops.expand_dims(ops.squeeze(mask, (1, 2)), (2, 3))


def single_query_attention(
    query,
    key,
    value,
    masks: Masks,
    *,
    scale,
    dropout=None,
    return_weights=False,
    grouped_key_value=True,
):
    """Attention of one query per row over time-first keys and values.

    Args:
        query: (B, 1, H, K).
        key: (B, Tk, H_kv, K), H_kv dividing H.
        value: (B, Tk, H_kv, V).
        masks: A `Masks` without an `attention` mask.
        scale: Multiplier of the raw scores.
        dropout: Must be None (the path applies no dropout).
        return_weights: Must be False (the path returns no weights).
        grouped_key_value: True: key and value keep their H_kv heads (with
            H_kv == H when the caller repeated them).

    Returns:
        Tuple (output (B, 1, H, V) in value's dtype, None).
    """
    del dropout, return_weights, grouped_key_value  # see Args
    kv_heads = key.shape[2]
    grouped = _grouped(query, kv_heads)  # (B, 1, H_kv, G, K)
    if keras.backend.standardize_dtype(query.dtype) != "float32":
        # Scores in float32, as the explicit path computes them.
        grouped = ops.cast(grouped, "float32")
        key = ops.cast(key, "float32")
    scores = ops.sum(grouped * ops.expand_dims(key, 3), axis=-1)  # (B, Tk, H_kv, G)
    scores = scores * scale
    mask = _key_mask(masks, ops.shape(key)[1])
    if mask is not None:
        scores = ops.where(mask, scores, MASK_VALUE)
    scores = scores - ops.max(scores, axis=1, keepdims=True)
    exponents = ops.exp(scores)
    weights = exponents / ops.sum(exponents, axis=1, keepdims=True)
    weights = ops.cast(weights, value.dtype)
    # (B, Tk, H_kv, G, 1) x (B, Tk, H_kv, 1, V), summed over Tk
    output = ops.sum(
        ops.expand_dims(weights, -1) * ops.expand_dims(value, 3), axis=1
    )  # (B, H_kv, G, V)
    num_heads, depth = query.shape[2], value.shape[-1]
    if keras.backend.backend() == "tensorflow":
        return ops.reshape(output, (-1, 1, num_heads, depth)), None
    return ops.reshape(output, (ops.shape(output)[0], 1, num_heads, depth)), None
