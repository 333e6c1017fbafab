"""The key/value cache for decoding: its layout, its classes (`layouts`:
one per layout, each with its write and read, built by the caller), and
the one door callers use to its checks (`checks`), its writes (`writes`)
and where a call runs (`environment`).

A cache holds the keys and values of every position decoded so far, in one
tensor of shape `(batch, 2, max_length, num_key_value_heads, key_dim)`:
`cache[:, 0]` the keys, `cache[:, 1]` the values, in the `(B, T, H, D)`
layout (keras-hub's `CachedMultiHeadAttention` convention). Positions not
written yet hold zeros in `empty_cache`; whatever they hold, no output reads
them: `update` hands attention the positions up to the last one written, and
zeroes the others where sizes must be static (and padded positions).
"""

from __future__ import annotations

from keras import ops

from keras_selfattn._checks import positive_int
from keras_selfattn.attention.cache.checks import (
    Guard,
    check_call,
    check_dtype,
    check_no_index,
    index_of,
)
from keras_selfattn.attention.cache.layouts import (
    Cache,
    CheckedCache,
    ConverterCache,
    GatheredCache,
    TimeMajorCache,
    TorchInPlaceCache,
    TorchRecordedCache,
    wrapped,
)

# What callers reach through this module besides the layout.
__all__ = [
    "Cache",
    "CheckedCache",
    "ConverterCache",
    "GatheredCache",
    "Guard",
    "TimeMajorCache",
    "TorchInPlaceCache",
    "TorchRecordedCache",
    "check_call",
    "check_dtype",
    "check_no_index",
    "empty",
    "index_of",
    "shape",
    "wrapped",
]


def shape(batch_size: int, max_length: int, num_heads: int, head_dim: int) -> tuple:
    """The cache's shape."""
    return (batch_size, 2, max_length, num_heads, head_dim)


def empty(
    layer_name: str, batch_size, max_length, num_heads: int, head_dim, dtype: str
):
    """A cache of zeros (`SelfAttention.empty_cache`); `head_dim` is None
    while the layer is not built (ValueError)."""
    if head_dim is None:
        raise ValueError(
            f"SelfAttention '{layer_name}' is not built, so its key_dim is not "
            "known yet. Build it (or call it once) before empty_cache()."
        )
    batch_size = positive_int("batch_size", batch_size)
    max_length = positive_int("max_length", max_length)
    return ops.zeros(shape(batch_size, max_length, num_heads, head_dim), dtype)
