"""The chunked path: exact attention computed one block of queries at a time.

Each block of C consecutive queries takes its softmax over every key it may
see, so the result is the explicit path's up to float rounding, while the
largest intermediate is (B, H, C, span), span the keys a block can see:

- no causal, no sliding_window: span = T (memory linear in T);
- causal only, on TensorFlow: block [s, s+C) sees keys [0, s+C), about half
  the work (a key span that grows with the block needs dynamic shapes, which
  XLA, and so JAX, cannot compile: there the span is T, masked);
- sliding_window w: block [s, s+C) sees keys [s-w+1, s+C+w-1) only
  ([s-w+1, s+C) with causal), a fixed span of at most C + 2(w-1) keys, so
  the work is linear in T too.

Traced with a time of unknown size off TensorFlow (JAX's exporters), the
call takes the explicit path, which computes the same numbers.

The blocks run in a sequential map (`tf.map_fn` with `parallel_iterations=1`
on TensorFlow, `keras.ops.map` elsewhere), so only one block's scores are
alive at a time, T may be dynamic, and gradients flow through the loop. The
backward pass recomputes each block (`keras.remat`) instead of storing its
weights, so training memory is linear in T as well; dropout derives each
block's mask from one seed and the block's position, so the recomputed block
drops the same weights. The last block starts at T - C, so no slice runs
past the end and no input is padded.

Shapes use B = batch, H = heads, T = time, K = key_dim, V = value_dim.
"""

from __future__ import annotations

import dataclasses

import keras
from keras import ops

from keras_selfattn.attention import explicit, score_mods
from keras_selfattn.attention import masks as masks_lib


def _minimum(a, b):
    """min(a, b), a Python int when both are static."""
    if isinstance(a, int) and isinstance(b, int):
        return min(a, b)
    return ops.minimum(a, b)


def _key_span(block, time, masks: masks_lib.Masks):
    """Keys a block of `block` queries sees, or None if it grows by block.

    Only causal attention without a window has a span that grows with the
    block's position, and only TensorFlow can slice a span of dynamic size.
    """
    if masks.sliding_window is None:
        grows = masks.causal and keras.backend.backend() == "tensorflow"
        return None if grows else time
    reach = masks.sliding_window - 1
    span = block + reach if masks.causal else block + 2 * reach
    return _minimum(span, time)


def map_sequentially(fn, starts, dtype):
    """Stacks fn(start) over `starts`, one block after the other.

    On TensorFlow this is `tf.map_fn(parallel_iterations=1)`: `ops.map` is
    `tf.map_fn` with up to 10 iterations in flight, which on a many-core
    machine could hold up to 10 blocks' scores at once. `tf.map_fn` (a while
    loop writing a TensorArray at the loop index) also converts to an ONNX
    Loop with tf2onnx, which `ops.scan`'s carried TensorArray does not.
    """
    if keras.backend.backend() != "tensorflow":
        return ops.map(fn, starts)
    import tensorflow as tf

    return tf.map_fn(
        tf.autograph.experimental.do_not_convert(fn),
        starts,
        fn_output_signature=dtype,
        parallel_iterations=1,
    )


def assemble(blocks, time, block, num_blocks):
    """(n, B, H, C, V) blocks -> (B, H, T, V).

    Every block but the last starts at i * C; the last one starts at T - C
    (so no slice runs past the end) and supplies rows [(n-1) * C, T).
    """
    num_heads, value_dim = ops.shape(blocks)[2], ops.shape(blocks)[4]
    rows = ops.reshape(
        ops.transpose(blocks, (1, 2, 0, 3, 4)),
        (-1, num_heads, num_blocks * block, value_dim),
    )
    head = rows[:, :, : (num_blocks - 1) * block]
    tail = rows[:, :, (2 * num_blocks - 1) * block - time :]
    return ops.concatenate([head, tail], axis=2)


def chunked_attention(
    query,
    key,
    value,
    masks,
    *,
    scale,
    chunk_size,
    dropout=None,
    return_weights=False,
    mods=None,
):
    """Attention computed `chunk_size` queries at a time.

    Args:
        query: (B, H, T, K).
        key: (B, H, T, K).
        value: (B, H, T, V).
        masks: A `Masks`.
        scale: Multiplier of the raw scores.
        chunk_size: Queries per block (C). Blocks are min(C, T) long
            (C // 2 on TensorFlow when the scores get a bias).
        dropout: None or a `SeededDropout`.
        return_weights: False: the weights are never built whole
            (`dispatch.IMPLEMENTATIONS["chunked"]` rules it out).
        mods: None or a `score_mods.ScoreMods`; each block builds its own
            bias (the position bias by position, `attention_bias` cut).

    Returns:
        Tuple (output (B, H, T, V), None), equal to the explicit path's
        output. A query with no key to attend outputs zeros.
    """
    time = ops.shape(query)[2]

    def empty():  # an empty sequence: no block to run
        return ops.zeros(ops.shape(query)[:3] + (ops.shape(value)[3],), value.dtype)

    def blocks():
        return _blocks(query, key, value, masks, scale, chunk_size, dropout, mods)

    if isinstance(time, int):
        return (blocks() if time else empty()), None
    if keras.backend.backend() != "tensorflow":
        # A symbolic time (JAX's exporters, jax2onnx and jax2tf): the loop
        # over blocks needs their number while tracing. The explicit path
        # computes the same numbers.
        return explicit.explicit_attention(
            query, key, value, masks, scale=scale, dropout=dropout, mods=mods
        )
    # Dynamic time (a TensorFlow graph of unknown shape): decided at run time.
    return ops.cond(ops.greater(time, 0), blocks, empty), None


def block_bias(mods, masks, start, key_start, block, key_span):
    """`score_mods.bias_block` of one block, its position bias built without
    a (block, key_span) index.

    A position bias depends on `key position - query position` only, so
    with C = block and S = key_span, the C + S biases of the distances
    `concat(0 .. S-1, -C .. -1)` (after the block's offset) are laid out
    once, repeated C times, and read back in rows of C + S - 1: row i,
    column c then holds entry (c - i) mod (C + S), the bias of distance
    c - i. The values are `bias_block`'s; what is alive while they are built
    is the (H, C, C + S) repetition, not an int (C, S) index with its cast,
    absolute value or gathered (C, S, H) copy.

    On TensorFlow, `bias_block` itself: its CPU allocator keeps what it frees
    for reuse, and the repetition's sizes (C + S, then C + S - 1 columns)
    fragment it (a higher peak resident memory than `bias_block`'s), while
    on PyTorch and JAX it lowers the peak of ALiBi and the relative bias
    (benchmarks/README.md, score modifications).
    """
    if keras.backend.backend() == "tensorflow":
        return score_mods.bias_block(mods, masks, start, key_start, block, key_span)
    position = None
    if mods.has_position_bias:
        first_query = start
        if masks.decoding:
            first_query = ops.add(masks.query_offset, start)
        distance = ops.concatenate(
            [ops.arange(key_span, dtype="int32"), ops.arange(-block, 0, dtype="int32")]
        ) + ops.cast(key_start - first_query, "int32")
        biases = score_mods.position_bias(mods, distance)  # (H, S + C)
        heads = ops.shape(biases)[0]
        rows = ops.reshape(
            ops.broadcast_to(
                ops.expand_dims(biases, 1), (heads, block, key_span + block)
            ),
            (heads, -1),
        )
        rows = ops.slice(rows, (0, 0), (heads, block * (key_span + block - 1)))
        rows = ops.reshape(rows, (heads, block, key_span + block - 1))
        position = ops.expand_dims(
            ops.slice(rows, (0, 0, 0), (heads, block, key_span)), 0
        )
    if mods.bias is None:
        return position
    call_mods = dataclasses.replace(mods, alibi_slopes=None, relative_table=None)
    call = score_mods.bias_block(call_mods, masks, start, key_start, block, key_span)
    return call if position is None else position + call


def _blocks(query, key, value, masks, scale, chunk_size, dropout, mods):
    """`chunked_attention` of a non-empty sequence."""
    batch, num_heads, time, key_dim = ops.shape(query)
    value_dim = ops.shape(value)[3]
    if keras.backend.backend() == "tensorflow" and mods is not None and mods.adds_bias:
        # TensorFlow fuses nothing: a block's bias is a second tensor of its
        # scores' size, and their sum a third. Half the queries per block
        # keep the peak of three within the unmodified block's two.
        chunk_size = max(1, chunk_size // 2)
    block = _minimum(chunk_size, time)
    num_blocks = (time + block - 1) // block
    span = _key_span(block, time, masks)
    reach = 0 if masks.sliding_window is None else masks.sliding_window - 1

    def block_attention(start, query, key, value, mods):
        """One block's output; `start` is its first query."""
        rows = ops.slice(query, (0, 0, start, 0), (batch, num_heads, block, key_dim))
        if span is None:  # causal only, TensorFlow: keys [0, start + block)
            key_start, key_span = 0, start + block
        else:
            key_start = ops.clip(start - reach, 0, time - span)
            key_span = span
        keys = ops.slice(
            key, (0, 0, key_start, 0), (batch, num_heads, key_span, key_dim)
        )
        values = ops.slice(
            value, (0, 0, key_start, 0), (batch, num_heads, key_span, value_dim)
        )
        mask = masks_lib.block(masks, start, key_start, block, key_span)
        make_bias = None
        if mods is not None and mods.adds_bias:

            def make_bias():
                return block_bias(mods, masks, start, key_start, block, key_span)

        output, _ = explicit.core(
            rows,
            keys,
            values,
            scale,
            mask,
            dropout,
            offset=start,
            zero_empty_rows=masks.attention is not None,
            mods=mods,
            make_bias=make_bias,
        )
        return output

    # The modifications' tensors (learned ones among them) enter the
    # recomputed block as arguments, so their gradients flow on every backend.
    tensors = () if mods is None else mods.tensors()

    def attend(start):
        def this_block(query, key, value, *tensors):
            block_mods = None if mods is None else mods.with_tensors(tensors)
            return block_attention(start, query, key, value, block_mods)

        return keras.remat(this_block)(query, key, value, *tensors)

    starts = ops.minimum(ops.arange(num_blocks, dtype="int32") * block, time - block)
    blocks = map_sequentially(attend, starts, value.dtype)
    return assemble(blocks, time, block, num_blocks)
