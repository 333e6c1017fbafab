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
place: no transpose, no repeat, no matmul. Grouped heads take one product
per position in their group, each broadcasting the query over time only:
with one product broadcasting both over time and over the group, the
attention of one step is slower on TensorFlow's CPU kernels.
With a `cache.TimeMajorCache` (the generation loop's steps in a TensorFlow
graph) keys and values come time-major, `(Tk, B, H_kv, D)`, views of the
cache: the same products, reduced over the leading axis.

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
from keras_selfattn.attention import score_mods
from keras_selfattn.attention.explicit import MASK_VALUE
from keras_selfattn.attention.masks import Masks
from keras_selfattn.tracing import FUSABLE_STEP_SCOPE


def _by_group(query, kv_heads: int) -> list:
    """(B, 1, H, K) -> G tensors (B, 1, H_kv, K): query head g * G + j, the
    j-th of the group that shares key/value head g (consecutive heads, as
    `heads.repeat`), in tensor j."""
    _, _, num_heads, depth = query.shape
    groups = num_heads // kv_heads
    if groups == 1:
        return [query]
    shape = (1, kv_heads, groups, depth)
    if keras.backend.backend() == "tensorflow":
        # -1 batch: the batch size is not read from a dynamic shape, which
        # tf2onnx miscompiles (see `heads.split`).
        grouped = ops.reshape(query, (-1, *shape))
    else:
        grouped = ops.reshape(query, (ops.shape(query)[0], *shape))
    return ops.unstack(grouped, axis=3)


def _key_mask(masks: Masks, key_len, time_major: bool):
    """Bool `(B or 1, Tk, 1, 1)` (time-major: `(Tk, B or 1, 1, 1)`), True
    where the query (at `query_offset`: this path decodes) may attend the
    key, or None: `masks_lib.block` for one query, built in this path's
    layout with fewer ops."""
    rules = []
    if masks.has_band:
        key_pos = masks_lib.positions(key_len)
        band = masks_lib.band(masks, masks.query_offset, key_pos)  # (Tk,)
        rules.append(ops.reshape(band, (-1, 1, 1, 1) if time_major else (1, -1, 1, 1)))
    if masks.key_padding is not None:
        keys = masks_lib.cut(ops.cast(masks.key_padding, "bool"), 1, 0, key_len)
        if time_major:
            keys = ops.transpose(keys)
        rules.append(ops.expand_dims(keys, (2, 3)))
    return masks_lib.all_of(rules)


def _sum_over_time(x, time_major: bool):
    """(B, Tk, ...) summed over Tk; time-major (Tk, B, ...) summed over Tk as
    a row of ones times x: TensorFlow's CPU reduction over a leading axis
    is slower."""
    if not time_major:
        return ops.sum(x, axis=1)
    rest = tuple(x.shape[1:])  # (B, ...): a static batch stays static
    if None in rest:
        rest = tuple(ops.shape(x)[1:])
    ones = ops.ones((1, ops.shape(x)[0]), x.dtype)
    rows = ops.matmul(ones, ops.reshape(x, (ops.shape(x)[0], -1)))
    return ops.reshape(rows, rest)


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
    time_major=False,
    mods=None,
):
    """Attention of one query per row over time-first keys and values.

    Args:
        query: (B, 1, H, K).
        key: (B, Tk, H_kv, K), H_kv dividing H; time-major: (Tk, B, H_kv, K).
        value: (B, Tk, H_kv, V); time-major: (Tk, B, H_kv, V).
        masks: A `Masks` without an `attention` mask.
        scale: Multiplier of the raw scores.
        dropout: Must be None (the path applies no dropout).
        return_weights: Must be False (the path returns no weights).
        grouped_key_value: True: key and value keep their H_kv heads (with
            H_kv == H when the caller repeated them).
        time_major: Whether key and value come time-major (read from a
            `cache.TimeMajorCache`).
        mods: None or a `score_mods.ScoreMods` without an `attention_bias`
            (the soft-cap, the position bias of the query at `query_offset`,
            the sinks).

    Returns:
        Tuple (output (B, 1, H, V) in value's dtype, None).
    """
    del dropout, return_weights, grouped_key_value  # see Args
    time = 0 if time_major else 1
    # Built outside the fusable step's name scope, which the fused ONNX
    # generator's rewrite reads (`tracing.FUSABLE_STEP_SCOPE`).
    key_len = masks.key_length
    if key_len is None:
        key_len = ops.shape(key)[time]
    mask = _key_mask(masks, key_len, time_major)
    with keras.name_scope(FUSABLE_STEP_SCOPE):
        return _core(query, key, value, mask, masks, scale, time_major, mods), None


def _core(query, key, value, mask, masks, scale, time_major, mods):
    """`single_query_attention`'s output from its bool key mask (or None)."""
    queries = _by_group(query, key.shape[2])  # G x (B, 1, H_kv, K)
    time = 0 if time_major else 1
    if time_major:  # time is 1: (B, 1, ...) -> (1, B, ...) is a reshape
        queries = [ops.reshape(q, (1, -1, *q.shape[2:])) for q in queries]
    if keras.backend.standardize_dtype(query.dtype) != "float32":
        # Scores in float32, as the explicit path computes them.
        queries = [ops.cast(q, "float32") for q in queries]
        key = ops.cast(key, "float32")
    # One product per group, each broadcasting on one side (module docstring).
    scores = [ops.sum(q * key, axis=-1, keepdims=True) for q in queries]
    scores = ops.concatenate(scores, axis=-1) if len(scores) > 1 else scores[0]
    scores = scores * scale  # (B, Tk, H_kv, G); time-major (Tk, B, H_kv, G)
    key_len = ops.shape(key)[time]
    by_head = (1, -1) + tuple(scores.shape[2:])  # head g * G + j at [g, j]
    if time_major:
        by_head = by_head[1::-1] + by_head[2:]
    sinks = None
    if mods is not None:
        bias = None
        if mods.adds_bias:  # no attention_bias: the position bias only
            distance = masks_lib.positions(key_len) - masks.query_offset
            bias = ops.transpose(score_mods.position_bias(mods, distance))  # (Tk, H)
            bias = ops.reshape(bias, by_head)
        scores = score_mods.modify(scores, mods, bias)
        if mods.sinks is not None:
            sinks = ops.reshape(ops.cast(mods.sinks, "float32"), (1, 1) + by_head[2:])
    if mask is not None:
        scores = ops.where(mask, scores, MASK_VALUE)
    top = ops.max(scores, axis=time, keepdims=True)
    if sinks is not None:
        top = ops.maximum(top, sinks)
    exponents = ops.exp(scores - top)
    total = ops.sum(exponents, axis=time, keepdims=True)
    if sinks is not None:
        total = total + ops.exp(sinks - top)
    weights = exponents / total
    weights = ops.cast(weights, value.dtype)
    # (B, Tk, H_kv, 1) x (B, Tk, H_kv, V), summed over Tk, for each group
    if len(queries) == 1:
        output = _sum_over_time(weights * value, time_major)  # (B, H_kv, V)
    else:
        parts = ops.split(weights, len(queries), axis=-1)
        output = ops.stack(
            [_sum_over_time(w * value, time_major) for w in parts], axis=2
        )
    num_heads, depth = query.shape[2], value.shape[-1]
    if keras.backend.backend() == "tensorflow":
        return ops.reshape(output, (-1, 1, num_heads, depth))
    return ops.reshape(output, (ops.shape(output)[0], 1, num_heads, depth))
