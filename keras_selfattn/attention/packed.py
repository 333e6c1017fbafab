"""The packed path: blocks of queries that skip the keys no query shares a
segment with.

A row packed with several sequences (`segment_ids`) attends within each
sequence only, so most of its (T, T) scores are masked: computed in full, a
packed row of 2048 costs as much as four rows of 1024 padded. Here each row's
queries go `chunk_size` at a time (without one, a block chosen from the time
axis: `default_block`), and each block of queries visits the key blocks of
the same size in turn with an online softmax (running maximum,
running denominator, running sum of weighted values, all in float32),
computing only the key blocks whose range of segment ids meets the query
block's (`packed_blocks`): the work follows the sum of the squares of the
sequences' lengths, not the square of the row's. The skipped blocks are
exactly those where no query and key can share an id, so the result is the
explicit path's up to float rounding, for any ids (contiguous sequences skip
the most).

Rows go one at a time (so one row's sequences never make another's blocks
run), in a sequential map over (row, query block); the key blocks in a loop
of a fixed count whose skipped steps do no work (`ops.cond`). The gradient
is FlashAttention's, written out (`packed_grad`): it keeps each query's
log-sum-exp and visits the same blocks again, so no loop is differentiated.
Where a modification carries a learned tensor (relative bias, sinks, an
`attention_bias`), or on PyTorch (Keras has no custom gradient there), the
backward pass differentiates the loop instead, recomputing each query block
(`keras.remat`). As in the chunked path, the last block starts at T - C; the
keys it shares with the block before it are masked out of it, so no key is
counted twice.

Shapes use B = batch, H = heads, T = time, C = block, K = key_dim,
V = value_dim.
"""

from __future__ import annotations

import math

import keras
from keras import ops

from keras_selfattn.attention import (
    chunked,
    explicit,
    packed_grad,
    packed_pairs,
    packed_runs,
    score_mods,
)
from keras_selfattn.attention.packed_blocks import Packing, loop

# Without `chunk_size` (the layer's default), rows of fewer positions attend
# whole (the fused or explicit path): there the packed path's blocks cost
# more than the other segments' keys they skip.
MIN_DEFAULT_TIME = 256


def default_block(time: int) -> int:
    """The block of a call of `time` positions without `chunk_size`: the
    power of two nearest the cube root of 256 T (32 at T = 256, 64 from 512
    to 2048, 128 from 4096 to 16384).

    The steps of the loop over key blocks grow as (T / C) ** 2, the work of
    the keys of other segments it cannot skip as C * T: the block that
    balances them grows as T ** (1/3). The constant comes from the packing
    benchmark (benchmarks/README.md, "Packing").
    """
    return min(time, 2 ** round(math.log2(256 * time) / 3))


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
        chunk_size: Queries (and keys) per block (C), or None (the layer's
            default, a `time` known while tracing): `default_block(time)`.
        dropout: Must be None (`dispatch` rules the path out with dropout).
        return_weights: Must be False.
        mods: None or a `score_mods.ScoreMods`.

    Returns:
        Tuple (output (B, H, T, V), None), the explicit path's output. A
        query with no key to attend outputs zeros.
    """
    del dropout, return_weights  # see Args
    time = query.shape[2]
    if chunk_size is None:
        chunk_size = default_block(time)
    if not isinstance(time, int) or time == 0:
        # A time known only at run time (or none): the chunked path's loop.
        return chunked.chunked_attention(
            query, key, value, masks, scale=scale, chunk_size=chunk_size, mods=mods
        )
    packing = Packing.of(masks, mods, scale, time, chunk_size)
    if not packed_pairs.applies(masks, mods):
        return _in_blocks(packing, (query, key, value), _looped), None
    runs = packed_runs.Runs.of(masks.segments, masks.key_padding, time)

    def alone():
        return packed_runs.runs_attention(
            query,
            key,
            value,
            masks,
            runs,
            scale=scale,
            granule=min(packed_runs.GRANULE, chunk_size),
            mods=mods,
        )

    def in_pairs():
        return _in_blocks(packing, (query, key, value), packed_pairs.pairs_attention)

    return ops.cond(runs.one_run_per_id, alone, in_pairs), None


def trains_without_its_loop(
    sizes_may_vary: bool, attention_mask: bool, score_mods: tuple[str, ...]
) -> bool:
    """Whether a call in training gets a gradient that differentiates no loop
    over key blocks: the runs' or pairs' (where sizes may vary, with no
    `attention_mask` or `attention_bias`), or FlashAttention's (off PyTorch,
    with no learned modification)."""
    if sizes_may_vary:
        return not attention_mask and "attention_bias" not in score_mods
    return keras.backend.backend() != "torch" and not set(score_mods) & {
        "relative",
        "sinks",
        "attention_bias",
    }


def _in_blocks(packing: Packing, tensors, attend):
    """`attend(packing, blocks)` on the blocks of `tensors` (the queries, keys
    and values `(B, H, T, D)`), assembled `(B, H, T, V)`."""
    query, _, value = tensors
    outputs = attend(packing, tuple(packing.blocked(x) for x in tensors))
    num_blocks, num_heads, value_dim = (
        packing.num_blocks,
        query.shape[1],
        value.shape[3],
    )
    outputs = ops.reshape(
        outputs, (-1, num_blocks, num_heads, packing.block, value_dim)
    )
    outputs = ops.transpose(outputs, (1, 0, 2, 3, 4))  # (n, B, H, C, V)
    return chunked.assemble(outputs, query.shape[2], packing.block, num_blocks)


def _looped(packing: Packing, blocks):
    """The blocks' outputs from the loop over key blocks: with its own
    gradient where it can have one, else differentiating the loop."""
    mods = packing.mods
    if keras.backend.backend() == "torch" or (mods is not None and mods.tensors()):
        return _rematerialized(packing, blocks)

    @ops.custom_gradient
    def attend(queries, keys, values):
        return _with_gradient(packing, queries, keys, values)

    return attend(*blocks)


def _with_gradient(packing: Packing, queries, keys, values):
    """The blocks' outputs `(B n, H, C, V)` and FlashAttention's gradient."""
    both = _sweep(packing, (queries, keys, values), lambda fn: fn)
    outputs = ops.cast(both[..., :-1], values.dtype)
    log_sums = both[..., -1:]

    def gradient(d_outputs):
        return packed_grad.gradients(
            packing, (queries, keys, values), outputs, log_sums, d_outputs
        )

    return outputs, gradient


def _rematerialized(packing: Packing, blocks):
    """The blocks' outputs, with each query block recomputed for the
    gradient (which also reaches the modifications' tensors, if any)."""
    mods = packing.mods
    tensors = () if mods is None else mods.tensors()

    def rematerialized(fn):
        def with_tensors(*args):
            count = len(args) - len(tensors)
            if mods is None:
                return fn(*args, mods=None)
            return fn(*args[:count], mods=mods.with_tensors(args[count:]))

        return lambda *args: keras.remat(with_tensors)(*args, *tensors)

    both = _sweep(packing, blocks, rematerialized)
    return ops.cast(both[..., :-1], blocks[2].dtype)


def _sweep(packing: Packing, blocks, wrap):
    """Every query block of every row, float32 `(B n, H, C, V + 1)`: the
    output, then the log-sum-exp of each query's scores. `wrap` wraps the
    function of one block (`fn(queries, keys, values, mods=...)`)."""
    queries = blocks[0]
    count = queries.shape[0]
    if not isinstance(count, int):
        count = ops.shape(queries)[0]

    def item(index):
        def one(queries, keys, values, mods=packing.mods):
            return _query_block(packing, (queries, keys, values), mods, index)

        return wrap(one)(*blocks)

    items = ops.arange(count, dtype="int32")
    both = chunked.map_sequentially(item, items, "float32")  # (B n, 1, H, C, V + 1)
    return ops.squeeze(both, 1)


def _query_block(packing: Packing, blocks, mods, index):
    """Block `index` of queries (row `index // n`, block `index % n`) against
    the key blocks of its row that it meets, float32 `(1, H, C, V + 1)`."""
    queries, keys, values = blocks
    num_heads, block, value_dim = values.shape[1], values.shape[2], values.shape[3]
    row, query_block = index // packing.num_blocks, index % packing.num_blocks
    rows = ops.expand_dims(ops.take(queries, index, axis=0), 0)
    row_masks, row_mods = packing.for_row(row, mods)
    if row_mods is not None and row_mods.sinks is not None:
        top = ops.broadcast_to(
            score_mods.sink_logits(row_mods, (1, 1, 1, 1), heads_axis=1),
            (1, num_heads, block, 1),
        )
        total = ops.ones((1, num_heads, block, 1), "float32")
    else:
        top = ops.full((1, num_heads, block, 1), explicit.MASK_VALUE, "float32")
        total = ops.zeros((1, num_heads, block, 1), "float32")
    summed = ops.zeros((1, num_heads, block, value_dim), "float32")

    def visit(key_block, state):
        def attend():
            item = row * packing.num_blocks + key_block
            scores, mask, _ = packing.scores(
                rows,
                ops.expand_dims(ops.take(keys, item, axis=0), 0),
                row_masks,
                row_mods,
                query_block,
                key_block,
            )
            return _online(
                ops.expand_dims(ops.take(values, item, axis=0), 0), scores, mask, state
            )

        meets = packing.meets(row, query_block, key_block)
        return ops.cond(meets, attend, lambda: state)

    top, total, summed = loop(packing.num_blocks, visit, (top, total, summed))
    real = total > 0
    output = summed / ops.where(real, total, 1.0)
    log_sum = ops.where(real, top + ops.log(ops.where(real, total, 1.0)), 0.0)
    return ops.concatenate([output, log_sum], axis=-1)


def _online(values, scores, mask, state):
    """The online softmax's state after one key block."""
    top, total, summed = state
    new_top = ops.maximum(top, ops.max(scores, axis=-1, keepdims=True))
    weights = ops.where(mask, ops.exp(scores - new_top), 0.0)
    decay = ops.exp(top - new_top)
    total = total * decay + ops.sum(weights, axis=-1, keepdims=True)
    weighted = ops.matmul(ops.cast(weights, values.dtype), values)
    summed = summed * decay + ops.cast(weighted, "float32")
    return new_top, total, summed
