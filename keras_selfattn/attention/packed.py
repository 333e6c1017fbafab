"""The packed path: blocks of queries that skip the keys no query shares a
segment with.

A row packed with several sequences (`segment_ids`) attends within each
sequence only, so most of its (T, T) scores are masked: computed in full, a
packed row of 2048 costs as much as four rows of 1024 padded. Here each row's
queries go `chunk_size` at a time, and each block of queries visits the
key blocks of the same size in turn with an online softmax (running maximum,
running denominator, running sum of weighted values, all in float32),
computing only the key blocks whose range of segment ids meets the query
block's: the work follows the sum of the squares of the sequences' lengths,
not the square of the row's. The skipped blocks are exactly those where no
query and key can share an id, so the result is the explicit path's up to
float rounding, for any ids (contiguous sequences skip the most).

Rows go one at a time (so one row's sequences never make another's blocks
run), in a sequential map over (row, query block); the key blocks in a loop
of a fixed count whose skipped steps do no work (`ops.cond`); the backward
pass recomputes each query block (`keras.remat`). As in the chunked path, the
last block starts at T - C; the keys it shares with the block before it are
masked out of it, so no key is counted twice.

Shapes use B = batch, H = heads, T = time, C = block, K = key_dim,
V = value_dim.
"""

from __future__ import annotations

import dataclasses

import keras
from keras import ops

from keras_selfattn.attention import chunked, explicit, score_mods
from keras_selfattn.attention import masks as masks_lib


def _row(x, row):
    """`x[row:row + 1]` along axis 0, or x when its batch axis is 1."""
    if x is None or x.shape[0] == 1:
        return x
    sizes = list(ops.shape(x))
    sizes[0] = 1
    return ops.slice(x, (row,) + (0,) * (len(x.shape) - 1), sizes)


_NO_ID = 2**31 - 1


def _id_ranges(segments, padding, starts, block):
    """Each block's lowest and highest id among its real positions, int32
    `(B, n)` each; a block of padding alone has an empty range (padded keys
    are masked, padded queries' outputs zeroed by the layer)."""
    low, high = segments, segments
    if padding is not None:
        real = ops.cast(padding, "bool")
        low = ops.where(real, segments, _NO_ID)
        high = ops.where(real, segments, -_NO_ID)

    def per_block(ids):
        return ops.stack([ids[:, s : s + block] for s in starts], axis=1)

    return ops.min(per_block(low), axis=-1), ops.max(per_block(high), axis=-1)


def packed_attention(
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
    """Attention of packed rows, skipping key blocks of other segments.

    Args:
        query: (B, H, T, K).
        key: (B, H, T, K).
        value: (B, H, T, V).
        masks: A `Masks` with `segments`.
        scale: Multiplier of the raw scores.
        chunk_size: Queries (and keys) per block (C).
        dropout: Must be None (`dispatch` rules the path out with dropout).
        return_weights: Must be False.
        mods: None or a `score_mods.ScoreMods`.

    Returns:
        Tuple (output (B, H, T, V), None), the explicit path's output. A
        query with no key to attend outputs zeros.
    """
    del dropout, return_weights  # see Args
    time = query.shape[2]
    if not isinstance(time, int) or time == 0:
        # A time known only at run time (or none): the chunked path's loop.
        return chunked.chunked_attention(
            query, key, value, masks, scale=scale, chunk_size=chunk_size, mods=mods
        )
    block = min(chunk_size, time)
    num_blocks = -(-time // block)
    starts = [min(i * block, time - block) for i in range(num_blocks)]
    segments = ops.cast(masks.segments, "int32")
    low, high = _id_ranges(segments, masks.key_padding, starts, block)
    # A static batch gives the map a static count, which XLA needs.
    batch = query.shape[0] if isinstance(query.shape[0], int) else ops.shape(query)[0]
    tensors = () if mods is None else mods.tensors()

    def blocked(x):
        """(B, H, T, D) -> (B n, H, C, D): block i of row b at b * n + i.
        A block is then taken whole (a gather, whose gradient is the block
        alone), not sliced out of the sequence (whose gradient is the whole
        sequence, once per block)."""
        parts = ops.stack([x[:, :, s : s + block] for s in starts], axis=1)
        return ops.reshape(parts, (-1, x.shape[1], block, x.shape[3]))

    blocks = (blocked(query), blocked(key), blocked(value))

    def item(index):
        def this_block(queries, keys, values, *tensors):
            block_mods = None if mods is None else mods.with_tensors(tensors)
            return _query_block(
                (queries, keys, values),
                masks,
                block_mods,
                scale,
                index,
                num_blocks,
                starts,
                low,
                high,
            )

        return keras.remat(this_block)(*blocks, *tensors)

    items = ops.arange(batch * num_blocks, dtype="int32")
    blocks = chunked.map_sequentially(item, items, value.dtype)  # (B n, 1, H, C, V)
    num_heads, value_dim = query.shape[1], value.shape[3]
    blocks = ops.reshape(blocks, (-1, num_blocks, num_heads, block, value_dim))
    blocks = ops.transpose(blocks, (1, 0, 2, 3, 4))  # (n, B, H, C, V)
    return chunked.assemble(blocks, time, block, num_blocks), None


def _query_block(blocks, masks, mods, scale, index, num_blocks, starts, low, high):
    """Block `index` of queries (row `index // n`, block `index % n`) against
    the key blocks of its row that it may attend; `blocks` the queries, keys
    and values `(B n, H, C, D)`."""
    queries, keys, values = blocks
    num_heads, block, value_dim = values.shape[1], values.shape[2], values.shape[3]
    row, query_block = index // num_blocks, index % num_blocks
    starts_tensor = ops.convert_to_tensor(starts, "int32")
    query_start = ops.take(starts_tensor, query_block)
    rows = ops.expand_dims(ops.take(queries, index, axis=0), 0)
    row_masks = dataclasses.replace(
        masks,
        key_padding=_row(masks.key_padding, row),
        attention=_row(masks.attention, row),
        segments=_row(masks.segments, row),
    )
    if mods is not None and mods.bias is not None:
        mods = dataclasses.replace(mods, bias=_row(mods.bias, row))
    query_low = low[row, query_block]
    query_high = high[row, query_block]
    if mods is not None and mods.sinks is not None:
        top = ops.broadcast_to(
            score_mods.sink_logits(mods, (1, 1, 1, 1), heads_axis=1),
            (1, num_heads, block, 1),
        )
        total = ops.ones((1, num_heads, block, 1), "float32")
    else:
        top = ops.full((1, num_heads, block, 1), explicit.MASK_VALUE, "float32")
        total = ops.zeros((1, num_heads, block, 1), "float32")
    summed = ops.zeros((1, num_heads, block, value_dim), "float32")

    def visit(key_block, state):
        def attend():
            return _key_block(
                rows,
                (keys, values),
                row_masks,
                mods,
                scale,
                row * num_blocks + key_block,
                (query_start, ops.take(starts_tensor, key_block), key_block * block),
                state,
            )

        meets = ops.logical_and(
            low[row, key_block] <= query_high, high[row, key_block] >= query_low
        )
        return ops.cond(meets, attend, lambda: state)

    top, total, summed = _loop(len(starts), visit, (top, total, summed))
    output = summed / ops.where(total > 0, total, 1.0)
    return ops.cast(output, values.dtype)


def _loop(count: int, body, state):
    """`body(i, state)` for i in 0 .. count - 1: on TensorFlow a while loop
    with its maximum set, whose gradient XLA compiles; elsewhere
    `ops.fori_loop` (on JAX a scan, which reverse-mode differentiates)."""
    if keras.backend.backend() != "tensorflow":
        return ops.fori_loop(0, count, body, state)
    import tensorflow as tf

    return tf.while_loop(
        lambda i, state: i < count,
        lambda i, state: (i + 1, body(i, state)),
        (tf.constant(0), state),
        maximum_iterations=count,
    )[1]


def _key_block(rows, blocks, masks, mods, scale, index, positions, state):
    """The online softmax's state after key block `index` (of `blocks`, the
    keys and values `(B n, H, C, D)`); `positions`: the query block's start,
    the key block's start, and the key block's nominal start."""
    top, total, summed = state
    query_start, key_start, first_new = positions
    keys = ops.expand_dims(ops.take(blocks[0], index, axis=0), 0)
    values = ops.expand_dims(ops.take(blocks[1], index, axis=0), 0)
    block = keys.shape[2]
    scores = ops.cast(explicit.attention_scores(rows, keys, scale), "float32")
    mask = masks_lib.block(masks, query_start, key_start, block, block)
    # The last block starts before its nominal start: keys the block before
    # it covered are not counted again.
    fresh = ops.reshape(
        key_start + masks_lib.positions(block) >= first_new, (1, 1, 1, -1)
    )
    mask = fresh if mask is None else ops.logical_and(mask, fresh)
    if mods is not None:
        bias = score_mods.bias_block(mods, masks, query_start, key_start, block, block)
        scores = score_mods.modify(scores, mods, bias)
    scores = ops.where(mask, scores, explicit.MASK_VALUE)
    new_top = ops.maximum(top, ops.max(scores, axis=-1, keepdims=True))
    weights = ops.where(mask, ops.exp(scores - new_top), 0.0)
    decay = ops.exp(top - new_top)
    total = total * decay + ops.sum(weights, axis=-1, keepdims=True)
    weighted = ops.matmul(ops.cast(weights, values.dtype), values)
    summed = summed * decay + ops.cast(weighted, "float32")
    return new_top, total, summed
