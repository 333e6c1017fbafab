"""Backend-agnostic attention math used by `SelfAttention` (keras.ops only).

Shapes use B = batch, T = time, H = heads, K = key_dim, V = value_dim.
Every reshape takes the batch size as -1: tf2onnx miscompiles reshapes whose
batch size is read from the tensor's dynamic shape.
"""

from __future__ import annotations

from keras import ops

# Softmax always runs in float32; this is float32's lowest finite value, so
# masked scores never overflow and a fully masked row never becomes NaN.
MASK_VALUE = -3.4028234663852886e38

_HALF_PRECISION = ("float16", "bfloat16")


def split_heads(x, num_heads: int):
    """(B, T, H*D) -> (B, H, T, D).

    Split and stack, not reshape: x usually comes from a projection whose
    TensorFlow kernel ends in a reshape, and Grappler folds two reshapes into
    one, so with time 0 the -1 batch was resolved from an empty 2-D tensor
    and came out as 1 instead of B.
    """
    if num_heads == 1:
        return ops.expand_dims(x, 1)
    return ops.stack(ops.split(x, num_heads, axis=-1), axis=1)


def merge_heads(x, num_heads: int, head_dim: int):
    """(B, H, T, D) -> (B, T, H*D)."""
    if num_heads == 1:
        return ops.squeeze(x, 1)
    x = ops.transpose(x, (0, 2, 1, 3))
    return ops.reshape(x, (-1, ops.shape(x)[1], num_heads * head_dim))


def causal_mask(length):
    """(1, 1, T, T) bool, True where key position <= query position."""
    index = ops.arange(length, dtype="int32")
    return ops.expand_dims(
        ops.greater_equal(ops.expand_dims(index, 1), ops.expand_dims(index, 0)),
        (0, 1),
    )


def sliding_window_mask(length, window: int):
    """(1, 1, T, T) bool, True where |query - key| < window."""
    index = ops.arange(length, dtype="int32")
    distance = ops.abs(ops.expand_dims(index, 1) - ops.expand_dims(index, 0))
    return ops.expand_dims(ops.less(distance, window), (0, 1))


def combine_masks(
    length,
    padding_mask=None,
    attention_mask=None,
    causal: bool = False,
    sliding_window: int | None = None,
):
    """The (broadcastable to) (B, 1, T, T) boolean mask, or None if unmasked.

    Args:
        length: T, a Python int or scalar tensor.
        padding_mask: (B, T) bool, True for real tokens. Masks keys only:
            padded query rows are zeroed by the caller.
        attention_mask: (B, T, T) bool, True where a query may attend a key.
        causal: whether to add the causal mask.
        sliding_window: if set, the band |query - key| < sliding_window.

    Returns:
        A bool tensor broadcastable to (B, 1, T, T), or None when nothing is
        masked (so the caller skips all masking work).
    """
    masks = []
    if padding_mask is not None:
        masks.append(ops.expand_dims(ops.cast(padding_mask, "bool"), (1, 2)))
    if attention_mask is not None:
        masks.append(ops.expand_dims(ops.cast(attention_mask, "bool"), 1))
    if causal:
        masks.append(causal_mask(length))
    if sliding_window is not None:
        masks.append(sliding_window_mask(length, sliding_window))
    return all_of(masks)


def all_of(masks: list):
    """The logical AND of broadcastable bool masks, or None for no mask."""
    if not masks:
        return None
    combined = masks[0]
    for mask in masks[1:]:
        combined = ops.logical_and(combined, mask)
    return combined


def mask_bias(mask):
    """0.0 where `mask` is True, `MASK_VALUE` where False, in float32."""
    return ops.where(mask, 0.0, MASK_VALUE)


def apply_mask(scores, mask):
    """Float32 `scores` with the entries `mask` excludes at `MASK_VALUE`.

    A mask that carries the batch dimension (a padding or attention mask) is
    added as a bias: oneDNN fuses MatMul -> Mul -> Add into a single kernel,
    so masking costs no pass of its own. A mask of static batch size 1 (causal
    or sliding window alone) is applied with `where` instead, because oneDNN's
    fused kernel is pathologically slow when its addend is broadcast over the
    batch. Both give the same softmax: a score plus `MASK_VALUE` rounds to
    `MASK_VALUE` (exp of it minus any finite max is exactly 0), and a row
    with no allowed key is uniform, never NaN.
    """
    if mask.shape[0] == 1:
        return ops.where(mask, scores, MASK_VALUE)
    # `+`, not ops.add: for some static shapes ops.add takes the bias for a
    # per-channel one and emits BiasAdd, which would not broadcast correctly.
    return scores + mask_bias(mask)


def masked_softmax(scores, mask=None, zero_empty_rows: bool = True):
    """Softmax over the last axis in float32; masked entries get exactly 0.

    A row whose entries are all masked returns zeros (never NaN), and the
    gradient stays finite because no infinity enters the graph.

    Args:
        scores: (..., T, T) raw scores.
        mask: None or bool broadcastable to `scores`, True where allowed.
        zero_empty_rows: whether to zero the rows with no allowed key (a pass
            over the weights). Callers whose every kept row has an allowed key
            (a query always may attend itself unless an attention mask says
            otherwise) pass False.
    """
    scores = ops.cast(scores, "float32")
    if scores.shape[-1] == 1:
        # One key: the weight is 1 (Keras warns on a softmax over one entry).
        weights = ops.ones_like(scores)
        return weights if mask is None else ops.where(mask, weights, 0.0)
    if mask is None:
        return ops.softmax(scores, axis=-1)
    weights = ops.softmax(apply_mask(scores, mask), axis=-1)
    if zero_empty_rows:
        weights = ops.where(mask, weights, 0.0)
    return weights


def attention_scores(query, key, scale: float):
    """Raw scaled scores (B, H, T, T), in float32 for half-precision inputs.

    The scores of a float16 model can exceed float16's range (65504), so
    half-precision query and key are promoted before the product.
    """
    if query.dtype in _HALF_PRECISION:
        query = ops.cast(query, "float32")
        key = ops.cast(key, "float32")
    scores = ops.matmul(query, ops.transpose(key, (0, 1, 3, 2)))
    return ops.multiply(scores, ops.cast(scale, scores.dtype))


def scaled_dot_product_attention(
    query,
    key,
    value,
    scale: float,
    mask=None,
    dropout=None,
    zero_empty_rows: bool = True,
):
    """softmax(Q K^T * scale) V over heads.

    Args:
        query: (B, H, T, K).
        key: (B, H, T, K).
        value: (B, H, T, V).
        scale: multiplier of the raw scores.
        mask: None or bool broadcastable to (B, H, T, T).
        dropout: None or a callable applied to the weights before use.
        zero_empty_rows: see `masked_softmax`; False skips a pass over the
            weights when no kept query row can have all its keys masked.

    Returns:
        Tuple (output (B, H, T, V) in value's dtype, weights (B, H, T, T) in
        value's dtype, before dropout).
    """
    scores = attention_scores(query, key, scale)
    weights = masked_softmax(scores, mask, zero_empty_rows)
    weights = ops.cast(weights, value.dtype)
    used = dropout(weights) if dropout is not None else weights
    return ops.matmul(used, value), weights
