"""Exact attention computed one block of queries at a time.

`SelfAttention(chunk_size=C)` calls `chunked_attention` instead of building
the full (B, H, T, T) weights. Each block of C consecutive queries takes its
softmax over every key it may see, so the result is the same attention up to
float rounding, while the largest intermediate is (B, H, C, span) with span
the number of keys a block can see:

- no causal, no sliding_window: span = T (memory linear in T);
- causal only: block [s, s+C) sees keys [0, s+C), about half the work;
- sliding_window w: block [s, s+C) sees keys [s-w+1, s+C+w-1) only
  ([s-w+1, s+C) with causal), a fixed span of at most C + 2(w-1) keys, so
  the work is linear in T too.

The math is keras.ops; the blocks run in a sequential map (`tf.map_fn` with
`parallel_iterations=1` on TensorFlow, a while loop), so only one block's
scores are alive at a time, T may be dynamic, and gradients flow through the
loop. The backward pass recomputes each block's weights instead of storing
them (`tf.recompute_grad`, unless dropout is set), so training memory is
linear in T as well. The last block starts at T - C, so no slice runs past
the end and no input is padded.

Shapes use B = batch, H = heads, T = time, K = key_dim, V = value_dim.
"""

from __future__ import annotations

import keras
from keras import ops

from keras_selfattn import attention_ops as aops


def _minimum(a, b):
    """min(a, b), a Python int when both are static."""
    if isinstance(a, int) and isinstance(b, int):
        return min(a, b)
    return ops.minimum(a, b)


def _key_span(block, time, causal: bool, sliding_window: int | None):
    """Keys a block of `block` queries can see, or None if it varies by block.

    Only causal attention without a window has a span that grows with the
    block's position (block [s, s+C) sees keys [0, s+C)).
    """
    if sliding_window is None:
        return None if causal else time
    reach = sliding_window - 1
    span = block + reach if causal else block + 2 * reach
    return _minimum(span, time)


def _block_mask(
    start,
    key_start,
    block,
    span,
    padding_mask,
    attention_mask,
    causal: bool,
    sliding_window: int | None,
):
    """Bool mask broadcastable to (B, H, block, span), or None if unmasked."""
    masks = []
    if causal or sliding_window is not None:
        # (1, 1, block, span): a leading 1 lets attention_ops apply it with
        # `where` rather than as an additive bias broadcast over the batch.
        query_pos = ops.reshape(start + ops.arange(block, dtype="int32"), (1, 1, -1, 1))
        key_pos = ops.reshape(
            key_start + ops.arange(span, dtype="int32"), (1, 1, 1, -1)
        )
        if causal:
            masks.append(ops.less_equal(key_pos, query_pos))
        if sliding_window is not None:
            distance = ops.abs(ops.subtract(query_pos, key_pos))
            masks.append(ops.less(distance, sliding_window))
    if padding_mask is not None:
        batch = ops.shape(padding_mask)[0]
        keys = ops.slice(padding_mask, (0, key_start), (batch, span))
        masks.append(ops.expand_dims(ops.cast(keys, "bool"), (1, 2)))
    if attention_mask is not None:
        batch = ops.shape(attention_mask)[0]
        rows = ops.slice(attention_mask, (0, start, key_start), (batch, block, span))
        masks.append(ops.expand_dims(ops.cast(rows, "bool"), 1))
    return aops.all_of(masks)


def _recomputed_in_backward(fn):
    """`fn` whose backward pass recomputes its forward instead of storing it.

    Without this the loop's gradient keeps every block's (B, H, C, span)
    weights for the backward pass: O(T^2) memory again in training. With it
    only the block's inputs are kept, at the cost of one more forward pass per
    block. Not for dropout, whose recomputation would draw a different mask.
    On backends other than TensorFlow, `fn` is returned unchanged.
    """
    if keras.backend.backend() != "tensorflow":
        return fn
    import tensorflow as tf

    return tf.recompute_grad(fn)


def _map_sequentially(fn, starts, dtype):
    """Stacks fn(start) over `starts`, one block after the other.

    On TensorFlow this is `tf.map_fn(parallel_iterations=1)`: `ops.map` is
    `tf.map_fn` with up to 10 iterations in flight, which on a many-core
    machine could hold up to 10 blocks' scores at once. `tf.map_fn` (a
    while loop writing a TensorArray at the loop index) also converts to an
    ONNX Loop with tf2onnx, which `ops.scan`'s carried TensorArray does not.
    """
    if keras.backend.backend() != "tensorflow":
        return ops.map(fn, starts)
    import tensorflow as tf

    return tf.map_fn(fn, starts, fn_output_signature=dtype, parallel_iterations=1)


def _assemble(blocks, time, block, num_blocks):
    """(n, B, H, C, V) blocks -> (B, H, T, V).

    Every block but the last starts at i * C; the last one starts at T - C
    (so no slice runs past the end) and supplies rows [(n-1) * C, T).
    """
    heads, value_dim = ops.shape(blocks)[2], ops.shape(blocks)[4]
    rows = ops.reshape(
        ops.transpose(blocks, (1, 2, 0, 3, 4)),
        (-1, heads, num_blocks * block, value_dim),
    )
    head = rows[:, :, : (num_blocks - 1) * block]
    tail = rows[:, :, (2 * num_blocks - 1) * block - time :]
    return ops.concatenate([head, tail], axis=2)


def chunked_attention(
    query,
    key,
    value,
    scale: float,
    chunk_size: int,
    padding_mask=None,
    attention_mask=None,
    causal: bool = False,
    sliding_window: int | None = None,
    dropout=None,
):
    """softmax(Q K^T * scale) V, computed `chunk_size` queries at a time.

    Args:
        query: (B, H, T, K).
        key: (B, H, T, K).
        value: (B, H, T, V).
        scale: Multiplier of the raw scores.
        chunk_size: Queries per block (C). Blocks are min(C, T) long.
        padding_mask: None or bool (B, T), True for real keys. Padded query
            rows are computed as usual; the caller zeroes them.
        attention_mask: None or bool (B, T, T), True where a query may
            attend a key.
        causal: Whether a query sees only itself and earlier keys.
        sliding_window: If set, a query sees keys closer than this.
        dropout: None or a callable applied to each block's weights.

    Returns:
        The attention output (B, H, T, V) in value's dtype, equal to
        `attention_ops.scaled_dot_product_attention` with the combined mask.

    Example:

    >>> import numpy as np
    >>> q = np.random.rand(2, 1, 10, 4).astype("float32")
    >>> chunked_attention(q, q, q, 0.5, chunk_size=4, causal=True).shape
    TensorShape([2, 1, 10, 4])
    """
    batch, heads, time, key_dim = ops.shape(query)
    value_dim = ops.shape(value)[3]
    block = _minimum(chunk_size, time)
    num_blocks = (time + block - 1) // block
    span = _key_span(block, time, causal, sliding_window)
    reach = 0 if sliding_window is None else sliding_window - 1

    def attend(start):
        def block_attention(query, key, value):
            rows = ops.slice(query, (0, 0, start, 0), (batch, heads, block, key_dim))
            if span is None:  # causal only: keys [0, start + block)
                key_start, key_span = 0, start + block
            else:
                key_start = ops.clip(start - reach, 0, time - span)
                key_span = span
            keys = ops.slice(
                key, (0, 0, key_start, 0), (batch, heads, key_span, key_dim)
            )
            values = ops.slice(
                value, (0, 0, key_start, 0), (batch, heads, key_span, value_dim)
            )
            mask = _block_mask(
                start,
                key_start,
                block,
                key_span,
                padding_mask,
                attention_mask,
                causal,
                sliding_window,
            )
            output, _ = aops.scaled_dot_product_attention(
                rows, keys, values, scale, mask, dropout
            )
            return output

        if dropout is None:
            block_attention = _recomputed_in_backward(block_attention)
        return block_attention(query, key, value)

    starts = ops.minimum(ops.arange(num_blocks, dtype="int32") * block, time - block)
    blocks = _map_sequentially(attend, starts, value.dtype)
    return _assemble(blocks, time, block, num_blocks)
