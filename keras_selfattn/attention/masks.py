"""One description of what each query may attend, and its formulas.

Every implementation (fused, single_query, packed, chunked, explicit) reads
the same `Masks`; the
causal and sliding-window rules are written once, in `band`, and `block`
builds the mask of any block of queries and keys from them, so the full
(T, T) mask is just the block that starts at 0 and spans everything.

Shapes use B = batch, Tq = queries, Tk = keys.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import keras
from keras import ops

from keras_selfattn.attention import backend_ops


@dataclasses.dataclass(frozen=True)
class Masks:
    """What each query may attend.

    Attributes:
        key_padding: None or bool `(B, Tk)`, True for real keys (the Keras
            mask). Padded queries are computed as usual; the layer zeroes
            their outputs.
        attention: None or bool `(B, Tq, Tk)`, True where a query may attend
            a key.
        causal: Whether a query sees only itself and earlier keys.
        sliding_window: If set, a query sees only keys closer than this.
        query_offset: None when queries and keys are the same sequence;
            when decoding with a key/value cache, the position of the first
            query among the cached keys (an int or scalar int32 tensor).
        segments: None or int `(B, T)`: packed sequences' ids; a query
            attends only keys of its own id.
        key_length: None, or when decoding, how many keys the cache
            returned (`Cache.attended_length`): computed from the index, so
            the layers of a step share the mask built from it.
    """

    key_padding: Any = None
    attention: Any = None
    causal: bool = False
    sliding_window: int | None = None
    query_offset: Any = None
    segments: Any = None
    key_length: Any = None

    @property
    def has_band(self) -> bool:
        """Whether causal or sliding-window positions are excluded."""
        return self.causal or self.sliding_window is not None

    @property
    def decoding(self) -> bool:
        """Whether the call decodes with a key/value cache: the queries are
        new positions after `query_offset` cached keys (else query i is key
        i)."""
        return self.query_offset is not None


def positions(length, dtype: str = "int32"):
    """`0 .. length - 1` as a `(length,)` tensor of `dtype`.

    `length` may be a dimension that is not known until run time: a traced
    size (an exporter's symbolic dimension on JAX, a traced scalar under
    `torch.jit.trace`, a dynamic TensorFlow dimension). On JAX this is
    `lax.broadcasted_iota`, which traces with a symbolic length where
    `jnp.arange` (replaced by jax2onnx while it converts) does not.
    """
    if keras.backend.backend() == "jax":
        import jax

        return jax.lax.broadcasted_iota(dtype, (length,), 0)
    return ops.arange(0, length, dtype=dtype)


def band(masks: Masks, query_pos, key_pos):
    """The causal and sliding-window rule for positions, or None.

    Args:
        masks: The description; only `causal` and `sliding_window` are read.
        query_pos: int32 positions of the queries, broadcastable against
            `key_pos` (e.g. shape `(..., Tq, 1)`).
        key_pos: int32 positions of the keys (e.g. shape `(..., 1, Tk)`).

    Returns:
        Bool, True where the query may see the key, or None if both are off.
    """
    # Python's operators, not `ops.less_equal`/`ops.subtract`: on torch these
    # trace as aten::le and aten::sub, which OpenVINO's torch frontend
    # converts (it has no rule for the aliases aten::less_equal, aten::subtract).
    rules = []
    if masks.causal:
        rules.append(key_pos <= query_pos)
    if masks.sliding_window is not None:
        distance = ops.abs(query_pos - key_pos)
        rules.append(distance < masks.sliding_window)
    return all_of(rules)


def all_of(masks: list):
    """The logical AND of broadcastable bool masks, or None for no mask."""
    if not masks:
        return None
    combined = masks[0]
    for mask in masks[1:]:
        combined = ops.logical_and(combined, mask)
    return combined


def cut(x, axis: int, start, length):
    """`x[..., start:start + length, ...]` along `axis`; x itself when the
    window is the whole axis (start 0, length None or the axis's known size)."""
    if isinstance(start, int) and start == 0:
        if length is None or (type(length) is int and length == x.shape[axis]):
            return x
    if length is None:
        length = ops.shape(x)[axis] - start
    return backend_ops.narrow(x, axis, start, length)


def block(masks: Masks, query_start=0, key_start=0, query_len=None, key_len=None):
    """The mask of one block of queries and keys.

    Args:
        masks: The description.
        query_start, key_start: Position of the block's first query and key
            (ints or scalar int32 tensors).
        query_len, key_len: The block's size; None for "to the end" (the
            band then needs the size, so pass it when masks has a band).

    Returns:
        Bool broadcastable to `(B, 1, query_len, key_len)`, True where a
        query may attend a key, or None when nothing is masked. The band
        alone has a static leading 1 (the explicit path applies such masks
        with `where` rather than a bias broadcast over the batch).
    """
    rules = []
    if masks.has_band:
        query_pos, key_pos = block_positions(
            masks, query_start, key_start, query_len, key_len
        )
        rules.append(band(masks, query_pos, key_pos))
    if masks.key_padding is not None:
        keys = cut(ops.cast(masks.key_padding, "bool"), 1, key_start, key_len)
        rules.append(ops.expand_dims(keys, (1, 2)))
    if masks.attention is not None:
        rows = cut(ops.cast(masks.attention, "bool"), 1, query_start, query_len)
        rows = cut(rows, 2, key_start, key_len)
        rules.append(ops.expand_dims(rows, 1))
    if masks.segments is not None:
        rules.append(
            same_segment(masks.segments, query_start, key_start, query_len, key_len)
        )
    return all_of(rules)


def same_segment(segments, query_start=0, key_start=0, query_len=None, key_len=None):
    """Bool `(B, 1, query_len, key_len)`: whether query and key carry the
    same id in int `segments` `(B, T)`."""
    queries = cut(segments, 1, query_start, query_len)
    keys = cut(segments, 1, key_start, key_len)
    return ops.equal(ops.expand_dims(queries, (1, 3)), ops.expand_dims(keys, (1, 2)))


def block_positions(
    masks: Masks, query_start=0, key_start=0, query_len=None, key_len=None
):
    """int32 positions of a block's queries `(1, 1, query_len, 1)` and keys
    `(1, 1, 1, key_len)` (queries after `query_offset` when decoding)."""
    first_query = query_start
    if masks.decoding:
        first_query = ops.add(masks.query_offset, query_start)
    query_pos = backend_ops.reshape(first_query + positions(query_len), (1, 1, -1, 1))
    key_pos = backend_ops.reshape(key_start + positions(key_len), (1, 1, 1, -1))
    return query_pos, key_pos


def rows_with_keys(masks: Masks, query_len, key_len):
    """Bool `(B, Tq)`: which queries may attend at least one key, or None.

    Without an `attention` mask every query may attend itself (the band
    always allows it, padding only removes padded keys and a real query is
    its own key, in the cache too), so no real query is empty and this
    returns None.
    """
    if masks.attention is None:
        return None
    dense = block(masks, query_len=query_len, key_len=key_len)
    return ops.any(ops.squeeze(dense, 1), axis=-1)
