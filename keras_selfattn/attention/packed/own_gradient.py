"""The packed loop's own gradient, FlashAttention's written out.

The forward pass keeps each query's log-sum-exp L of its scores, so the
weights of any pair of blocks are `exp(S - L)` again without a softmax over
the row. With the upstream gradient dO of the outputs O and
`delta = sum(dO * O)` per query, a pair of blocks gives

    dV += P^T dO,    dP = dO V^T,    dS = P * (dP - delta),
    dQ += dS K * scale,    dK += dS^T Q * scale

(dS times the soft-cap's derivative first, when the layer has one). Two
sweeps over the same pairs the forward pass visited (the blocks that meet,
`blocks.Packing.meets`): one per query block, which sums its dQ; one
per key block, which sums its dK and dV. No loop is differentiated, and
nothing of the forward pass is kept but O and L.

Shapes use B = batch, H = heads, C = block, n = blocks of a row, K =
key_dim, V = value_dim.
"""

from __future__ import annotations

from keras import ops

from keras_selfattn.attention import chunked
from keras_selfattn.attention.packed.blocks import Packing, fori_loop


def gradients(packing: Packing, blocks, outputs, log_sums, d_outputs):
    """The gradients of the queries', keys' and values' blocks.

    Args:
        packing: The call's `Packing`.
        blocks: The queries, keys and values `(B n, H, C, D)`.
        outputs: The forward pass's outputs `(B n, H, C, V)`.
        log_sums: float32 `(B n, H, C, 1)`: each query's log-sum-exp.
        d_outputs: The upstream gradient of `outputs`.

    Returns:
        Tuple of the gradients of `blocks`, in their dtypes.
    """
    queries, keys, values = blocks
    d_outputs = ops.cast(d_outputs, values.dtype)
    deltas = ops.sum(
        ops.cast(d_outputs, "float32") * ops.cast(outputs, "float32"),
        axis=-1,
        keepdims=True,
    )
    per_query = (queries, d_outputs, log_sums, deltas)
    count = queries.shape[0]
    if not isinstance(count, int):
        count = ops.shape(queries)[0]
    items = ops.arange(count, dtype="int32")

    def query_item(index):
        return _query_block(packing, per_query, (keys, values), index)

    def key_item(index):
        return _key_block(packing, per_query, (keys, values), index)

    d_queries = ops.squeeze(chunked.map_sequentially(query_item, items, "float32"), 1)
    d_both = ops.squeeze(chunked.map_sequentially(key_item, items, "float32"), 1)
    key_dim = keys.shape[3]
    return (
        ops.cast(d_queries, queries.dtype),
        ops.cast(d_both[..., :key_dim], keys.dtype),
        ops.cast(d_both[..., key_dim:], values.dtype),
    )


def _take(x, index):
    return ops.expand_dims(ops.take(x, index, axis=0), 0)


def _pair(packing, row, per_query, kv, query_item, key_item):
    """The weights P and dS `(1, H, C, C)` of a pair of blocks, float32."""
    queries, d_outputs, log_sums, deltas = (_take(x, query_item) for x in per_query)
    keys, values = (_take(x, key_item) for x in kv)
    blocks = packing.num_blocks
    scores, mask, slope = packing.scores(
        queries,
        keys,
        *row,
        query_item % blocks,
        key_item % blocks,
    )
    weights = ops.where(mask, ops.exp(scores - log_sums), 0.0)
    d_weights = ops.matmul(d_outputs, ops.transpose(values, (0, 1, 3, 2)))
    d_scores = weights * (ops.cast(d_weights, "float32") - deltas)
    if slope is not None:
        d_scores = d_scores * slope
    return weights, d_scores, (queries, d_outputs), keys


def _query_block(packing: Packing, per_query, kv, index):
    """dQ of query block `index`, float32 `(1, H, C, K)`."""
    row, query_block = index // packing.num_blocks, index % packing.num_blocks
    row_view = packing.for_row(row, packing.mods)
    queries = per_query[0]
    d_queries = ops.zeros((1,) + tuple(queries.shape[1:]), "float32")

    def visit(key_block, d_queries):
        def add():
            key_item = row * packing.num_blocks + key_block
            _, d_scores, _, keys = _pair(
                packing, row_view, per_query, kv, index, key_item
            )
            product = ops.matmul(ops.cast(d_scores, keys.dtype), keys)
            return d_queries + ops.cast(product, "float32") * packing.scale

        meets = packing.meets(row, query_block, key_block)
        return ops.cond(meets, add, lambda: d_queries)

    return fori_loop(packing.num_blocks, visit, d_queries)


def _key_block(packing: Packing, per_query, kv, index):
    """dK and dV of key block `index`, float32 `(1, H, C, K + V)`."""
    row, key_block = index // packing.num_blocks, index % packing.num_blocks
    row_view = packing.for_row(row, packing.mods)
    keys, values = kv
    d_keys = ops.zeros((1,) + tuple(keys.shape[1:]), "float32")
    d_values = ops.zeros((1,) + tuple(values.shape[1:]), "float32")

    def visit(query_block, state):
        def add():
            query_item = row * packing.num_blocks + query_block
            weights, d_scores, (queries, d_outputs), _ = _pair(
                packing, row_view, per_query, kv, query_item, index
            )
            d_keys, d_values = state
            d_values = d_values + ops.cast(
                ops.matmul(
                    ops.transpose(ops.cast(weights, d_outputs.dtype), (0, 1, 3, 2)),
                    d_outputs,
                ),
                "float32",
            )
            product = ops.matmul(
                ops.transpose(ops.cast(d_scores, queries.dtype), (0, 1, 3, 2)), queries
            )
            return d_keys + ops.cast(product, "float32") * packing.scale, d_values

        meets = packing.meets(row, query_block, key_block)
        return ops.cond(meets, add, lambda: state)

    d_keys, d_values = fori_loop(packing.num_blocks, visit, (d_keys, d_values))
    return ops.concatenate([d_keys, d_values], axis=-1)
