"""The explicit path: the full attention weights, materialized.

The only path that can return the weights and apply dropout to them, and the
one that takes any mask. Scores and softmax run in float32; a query with no
key to attend gets weights 0 (never NaN, and finite gradients).
"""

from __future__ import annotations

import keras
from keras import ops

from keras_selfattn import _checks
from keras_selfattn.attention import masks as masks_lib
from keras_selfattn.attention import score_mods
from keras_selfattn.tracing import FUSABLE_CORE_SCOPE

# Softmax always runs in float32; this is float32's lowest finite value, so
# masked scores never overflow and a fully masked row never becomes NaN.
MASK_VALUE = -_checks.FLOAT32_MAX


def _static(size):
    """`size` if it is known while tracing, else None. A traced size (a
    tensor under `torch.jit.trace`, a symbolic dimension under `torch.export`
    or a JAX exporter) must not choose a branch: the branch taken for the
    traced length would be baked into the export for every length."""
    return size if isinstance(size, int) else None


def apply_mask(scores, mask, select: bool = False):
    """Float32 `scores` with the entries `mask` excludes at `MASK_VALUE`.

    A mask that carries the batch dimension (a padding or attention mask) is
    added as a bias: oneDNN fuses MatMul -> Mul -> Add into a single kernel,
    so masking costs no pass of its own. A mask of static batch size 1 (causal
    or sliding window alone) is applied with `where` instead, because oneDNN's
    fused kernel is pathologically slow when its addend is broadcast over the
    batch. Both give the same softmax: a score plus `MASK_VALUE` rounds to
    `MASK_VALUE` (exp of it minus any finite max is exactly 0), and a row
    with no allowed key is uniform, never NaN. With `select`, always `where`:
    scores that carry a bias may be non-finite at masked positions, which a
    sum would keep.
    """
    if select or _static(mask.shape[0]) == 1:
        return ops.where(mask, scores, MASK_VALUE)
    # `+`, not ops.add: for some static shapes ops.add takes the bias for a
    # per-channel one and emits BiasAdd, which would not broadcast correctly.
    return scores + ops.where(mask, 0.0, MASK_VALUE)


def masked_softmax(
    scores, mask=None, zero_empty_rows: bool = True, sinks=None, select=False
):
    """Softmax over the last axis in float32; masked entries get exactly 0.

    Args:
        scores: (..., Tq, Tk) raw scores.
        mask: None or bool broadcastable to `scores`, True where allowed.
        zero_empty_rows: Whether to zero the rows with no allowed key (a pass
            over the weights). Callers whose every row has an allowed key pass
            False.
        sinks: None, or float32 logits broadcastable to `(..., Tq, 1)`: one
            more entry of each row's denominator, with no weight returned
            (a row with no allowed key then has weights 0).
        select: Whether to mask with a select (`apply_mask`): for scores
            that carry a bias.
    """
    scores = ops.cast(scores, "float32")
    if sinks is not None:
        return _softmax_with_sinks(scores, mask, sinks)
    if _static(scores.shape[-1]) == 1:
        # One key: the weight is 1 (Keras warns on a softmax over one entry).
        weights = ops.ones_like(scores)
        return weights if mask is None else ops.where(mask, weights, 0.0)
    if mask is None:
        return ops.softmax(scores, axis=-1)
    weights = ops.softmax(apply_mask(scores, mask, select), axis=-1)
    if zero_empty_rows:
        weights = ops.where(mask, weights, 0.0)
    return weights


def _softmax_with_sinks(scores, mask, sinks):
    """`exp(s_j) / (sum_k exp(s_k) + exp(sink))` over the allowed keys."""
    if mask is not None:
        scores = apply_mask(scores, mask, select=True)
    top = ops.maximum(ops.max(scores, axis=-1, keepdims=True), sinks)
    exponents = ops.exp(scores - top)
    if mask is not None:
        exponents = ops.where(mask, exponents, 0.0)
    total = ops.sum(exponents, axis=-1, keepdims=True) + ops.exp(sinks - top)
    return exponents / total


def attention_scores(query, key, scale: float):
    """Raw scaled scores (B, H, Tq, Tk).

    float16 query and key are promoted to float32 first: a float16 model's
    scores can exceed float16's range (65504). bfloat16 has float32's range,
    so its product stays on the tensor cores.
    """
    if keras.backend.standardize_dtype(query.dtype) == "float16":
        query = ops.cast(query, "float32")
        key = ops.cast(key, "float32")
    scores = ops.matmul(query, ops.transpose(key, (0, 1, 3, 2)))
    return ops.multiply(scores, ops.cast(scale, scores.dtype))


def core(
    query,
    key,
    value,
    scale: float,
    mask=None,
    dropout=None,
    offset=0,
    zero_empty_rows=True,
    mods=None,
    make_bias=None,
):
    """softmax(Q K^T * scale) V in the heads-first layout.

    Args:
        query: (B, H, Tq, K).
        key: (B, H, Tk, K).
        value: (B, H, Tk, V).
        scale: Multiplier of the raw scores.
        mask: None or bool broadcastable to (B, H, Tq, Tk).
        dropout: None or a `SeededDropout`, applied to the weights.
        offset: The dropout offset (the chunked path's block).
        zero_empty_rows: See `masked_softmax`.
        mods: None or the call's `score_mods.ScoreMods`.
        make_bias: None, or a function of no argument returning the block's
            float32 bias (`score_mods.bias_block`), called once the scores
            are scaled; the bias is dropped once added. A function that
            builds the bias (the chunked path's) so keeps it, in eager
            execution (PyTorch, TensorFlow's eager calls), from being alive
            beside the scaled scores while they are computed, or beside the
            softmax's tensors: at batch 1, one score-sized block less.

    Returns:
        Tuple (output (B, H, Tq, V) in value's dtype, weights (B, H, Tq, Tk)
        in value's dtype, before dropout).
    """
    scores = attention_scores(query, key, scale)
    sinks = None
    if mods is not None:  # in float32 (bfloat16 scores stay bfloat16 until here)
        bias = None if make_bias is None else make_bias()
        scores = score_mods.modify(ops.cast(scores, "float32"), mods, bias)
        del bias  # the only reference: freed before the softmax
        if mods.sinks is not None:
            sinks = score_mods.sink_logits(mods, (1, 1, 1, 1), heads_axis=1)
    weights = masked_softmax(
        scores, mask, zero_empty_rows, sinks, select=make_bias is not None
    )
    weights = ops.cast(weights, value.dtype)
    used = weights if dropout is None else dropout(weights, offset)
    return ops.matmul(used, value), weights


def explicit_attention(
    query, key, value, masks, *, scale, dropout=None, return_weights=False, mods=None
):
    """Attention with the full weights materialized.

    Args:
        query: (B, H, Tq, K).
        key: (B, H, Tk, K).
        value: (B, H, Tk, V).
        masks: A `Masks`.
        scale: Multiplier of the raw scores.
        dropout: None or a `SeededDropout`.
        return_weights: Whether to return the weights.
        mods: None or a `score_mods.ScoreMods`.

    Returns:
        Tuple (output (B, H, Tq, V), weights (B, H, Tq, Tk) or None). A query
        with no key to attend outputs zeros and has weights 0.
    """
    query_len, key_len = ops.shape(query)[2], ops.shape(key)[2]
    mask = masks_lib.block(masks, query_len=query_len, key_len=key_len)
    bias = None
    if mods is not None:
        # Built outside the fusable core's name scope, which the fused ONNX
        # rewrite reads.
        bias = score_mods.bias_block(mods, masks, query_len=query_len, key_len=key_len)
    with keras.name_scope(FUSABLE_CORE_SCOPE):
        # Without an attention mask every query may attend itself (padded
        # queries are zeroed by the layer), so no row needs zeroing.
        output, weights = core(
            query,
            key,
            value,
            scale,
            mask,
            dropout,
            zero_empty_rows=masks.attention is not None,
            mods=mods,
            make_bias=None if bias is None else lambda: bias,
        )
    return output, weights if return_weights else None
