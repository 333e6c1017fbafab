"""The packed path's loop over key blocks: each query block of each row, in
a sequential map, visits the key blocks it meets (`blocks.Packing.meets`)
with an online softmax (running maximum, running denominator, running sum
of weighted values, all in float32), in a loop of a fixed count whose
skipped steps do no work (`ops.cond`).

Its gradient is the one `packed.GRADIENTS` chooses: its `own`
(FlashAttention's, `own_gradient`), from the outputs and each query's
log-sum-exp this forward keeps; or `rematerialized`, differentiating the
loop with each query block recomputed (`keras.remat`), so the gradient also
reaches the modifications' tensors.

Shapes use B = batch, H = heads, C = block, n = blocks of a row, K =
key_dim, V = value_dim.
"""

from __future__ import annotations

import keras
from keras import ops

from keras_selfattn.attention import chunked, explicit, score_mods
from keras_selfattn.attention.packed import own_gradient
from keras_selfattn.attention.packed.blocks import Packing, fori_loop


def loop_attention(packing: Packing, blocks, gradient: str):
    """The blocks' outputs from the loop over key blocks, with the gradient
    `gradient` names (`packed.GRADIENTS`): its `own`, or `rematerialized`
    (differentiating the loop)."""
    if gradient == "rematerialized":
        return _rematerialized(packing, blocks)

    @ops.custom_gradient
    def attend(queries, keys, values):
        return _with_gradient(packing, queries, keys, values)

    return attend(*blocks)


def _with_gradient(packing: Packing, queries, keys, values):
    """The blocks' outputs `(B n, H, C, V)` and FlashAttention's gradient."""
    both = _every_query_block(packing, (queries, keys, values), lambda fn: fn)
    outputs = ops.cast(both[..., :-1], values.dtype)
    log_sums = both[..., -1:]

    def backward(d_outputs):
        return own_gradient.gradients(
            packing, (queries, keys, values), outputs, log_sums, d_outputs
        )

    return outputs, backward


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

    both = _every_query_block(packing, blocks, rematerialized)
    return ops.cast(both[..., :-1], blocks[2].dtype)


def _every_query_block(packing: Packing, blocks, wrap):
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

    top, total, summed = fori_loop(packing.num_blocks, visit, (top, total, summed))
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
