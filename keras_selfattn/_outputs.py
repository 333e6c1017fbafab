"""Exact zeros for SelfAttention's queries with nothing to attend, and its
padded inputs."""

from __future__ import annotations

from keras import ops

from keras_selfattn.attention import Masks, nan_safe
from keras_selfattn.attention import masks as masks_lib


def zero_unless(keep, x, plain_call: bool):
    """`x` with exact zeros where the bool `keep` (broadcastable) is False:
    `nan_safe.zero_unless`, or in a plain call (`_projection_ops.plain`, an
    eager one) the one select, exact there (`nan_safe`'s form is for the
    graphs tf2onnx converts)."""
    if plain_call:
        return ops.where(keep, x, ops.zeros((), x.dtype))
    return nan_safe.zero_unless(keep, x)


def queries_to_keep(inputs, masks: Masks):
    """Bool (B, Tq): queries with something to attend, or None (all)."""
    time = inputs.shape[1]
    if not isinstance(time, int):
        time = ops.shape(inputs)[1]
    query_padding = masks.key_padding
    if query_padding is not None:
        query_padding = ops.cast(query_padding, "bool")
        if masks.decoding:  # the new positions' own mask
            batch = ops.shape(query_padding)[0]
            start = ops.cast(masks.query_offset, "int32")
            query_padding = ops.slice(query_padding, (0, start), (batch, time))
    rows = (
        None if masks.attention is None else masks_lib.rows_with_keys(masks, time, time)
    )
    return masks_lib.all_of([m for m in (query_padding, rows) if m is not None])


def zero_unattending(inputs, masks: Masks, output, weights):
    """`output` (B, Tq, C) and `weights` (B, H, Tq, Tk, or None) with exact
    zeros for the queries with nothing to attend (padded positions, and
    attention_mask rows that allow no key), also after the output
    projection's bias."""
    keep = queries_to_keep(inputs, masks)
    if keep is None:
        return output, weights
    output = ops.where(ops.expand_dims(keep, -1), output, ops.zeros_like(output))
    if weights is not None:
        weights = ops.where(
            ops.expand_dims(keep, (1, 3)), weights, ops.zeros_like(weights)
        )
    return output, weights
