"""The packed path where sizes may vary at run time: every pair of blocks
that meets, at once.

Eager calls and TensorFlow graphs that XLA does not compile take tensors
whose sizes are known only when they run. There the packed path needs no
loop: it gathers the P pairs of (query block, key block) whose ids meet
(`blocks.Packing.meeting`), computes their scores `(P, H, C, C)` in one
batched product, and sums each query block's softmax over its pairs with
segment sums (each query's maximum over its pairs first, so nothing
overflows). Every operation has its own gradient, so training
differentiates it as it is, learned modifications included, with no loop
and no recomputation; a graph of a few dozen operations, whatever the rows.

Shapes use B = batch, H = heads, C = block, n = blocks of a row, P = pairs
that meet, K = key_dim, V = value_dim.
"""

from __future__ import annotations

from keras import ops

from keras_selfattn.attention import explicit, score_mods
from keras_selfattn.attention import masks as masks_lib
from keras_selfattn.attention.packed.blocks import Packing


def pairs_attention(packing: Packing, blocks):
    """The outputs `(B n, H, C, V)` of the query blocks `blocks[0]` against
    the key and value blocks `blocks[1:]`, all `(B n, H, C, D)`."""
    queries, keys, values = blocks
    masks, mods, block = packing.masks, packing.mods, packing.block
    count = ops.shape(queries)[0]
    rows, query_blocks, key_blocks = ops.nonzero(packing.meeting())
    query_items = rows * packing.num_blocks + query_blocks
    key_items = rows * packing.num_blocks + key_blocks
    starts = ops.convert_to_tensor(packing.starts, "int32")
    offsets = masks_lib.positions(block)
    query_pos = ops.reshape(
        ops.expand_dims(ops.take(starts, query_blocks), 1) + offsets, (-1, 1, block, 1)
    )
    key_pos = ops.reshape(
        ops.expand_dims(ops.take(starts, key_blocks), 1) + offsets, (-1, 1, 1, block)
    )
    segments = packing.blocked_ids(ops.cast(masks.segments, "int32"))
    rules = [
        # Keys of the last block that the block before it covered.
        key_pos >= ops.reshape(key_blocks * block, (-1, 1, 1, 1)),
        ops.equal(
            ops.reshape(ops.take(segments, query_items, axis=0), (-1, 1, block, 1)),
            ops.reshape(ops.take(segments, key_items, axis=0), (-1, 1, 1, block)),
        ),
        masks_lib.band(masks, query_pos, key_pos),
    ]
    if masks.key_padding is not None:
        padding = packing.blocked_ids(ops.cast(masks.key_padding, "bool"))
        rules.append(
            ops.reshape(ops.take(padding, key_items, axis=0), (-1, 1, 1, block))
        )
    mask = masks_lib.all_of([rule for rule in rules if rule is not None])

    def take(x, items):
        return ops.take(x, items, axis=0)

    scores = explicit.attention_scores(
        take(queries, query_items), take(keys, key_items), packing.scale
    )
    scores = ops.cast(scores, "float32")
    if mods is not None:
        bias = None
        if mods.has_position_bias:
            distance = ops.squeeze(key_pos - query_pos, 1)  # (P, C, C)
            bias = ops.transpose(score_mods.position_bias(mods, distance), (1, 0, 2, 3))
        scores = score_mods.modify(scores, mods, bias)
    scores = ops.where(mask, scores, explicit.MASK_VALUE)
    top = ops.segment_max(ops.max(scores, axis=-1), query_items, num_segments=count)
    sinks = None
    if mods is not None and mods.sinks is not None:
        sinks = score_mods.sink_logits(mods, (1, 1, 1), heads_axis=1)
        top = ops.maximum(top, sinks)
    # A block with no pair has the lowest float as its maximum: never read.
    top = ops.stop_gradient(ops.maximum(top, explicit.MASK_VALUE))
    weights = ops.where(
        mask, ops.exp(scores - ops.expand_dims(take(top, query_items), -1)), 0.0
    )
    total = ops.segment_sum(ops.sum(weights, axis=-1), query_items, num_segments=count)
    if sinks is not None:
        total = total + ops.exp(sinks - top)
    products = ops.matmul(ops.cast(weights, values.dtype), take(values, key_items))
    summed = ops.segment_sum(
        ops.cast(products, "float32"), query_items, num_segments=count
    )
    total = ops.expand_dims(total, -1)
    return ops.cast(summed / ops.where(total > 0, total, 1.0), values.dtype)
