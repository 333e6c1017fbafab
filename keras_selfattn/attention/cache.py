"""The key/value cache for decoding: its layout, checks, and updates.

A cache holds the keys and values of every position decoded so far, in one
tensor of shape `(batch, 2, max_length, num_key_value_heads, key_dim)`:
`cache[:, 0]` the keys, `cache[:, 1]` the values, in the `(B, T, H, D)`
layout (keras-hub's `CachedMultiHeadAttention` convention). Positions not
written yet hold zeros; the causal mask keeps every query off them.
"""

from __future__ import annotations

from keras import ops


def shape(batch_size: int, max_length: int, num_heads: int, head_dim: int) -> tuple:
    """The cache's shape."""
    return (batch_size, 2, max_length, num_heads, head_dim)


def check(cache, num_heads: int, head_dim: int, layer_name: str) -> None:
    """Raises ValueError unless `cache` has the layout above (where known)."""
    cache_shape = tuple(cache.shape)
    expected = (None, 2, None, num_heads, head_dim)
    if len(cache_shape) != 5 or any(
        want is not None and isinstance(have, int) and have != want
        for have, want in zip(cache_shape, expected, strict=False)
    ):
        raise ValueError(
            f"SelfAttention '{layer_name}': `cache` must have shape (batch, 2, "
            f"max_length, num_key_value_heads={num_heads}, key_dim={head_dim}); "
            f"build one with layer.empty_cache(batch_size, max_length). "
            f"Received: cache.shape={cache_shape}"
        )


def update(cache, key, value, index):
    """Writes the new positions' keys and values into the cache.

    Args:
        cache: `(B, 2, L, G, K)`.
        key: `(B, Tn, G, K)`, the keys of positions `index .. index + Tn - 1`.
        value: `(B, Tn, G, K)`, their values.
        index: The first new position (an int or a scalar int tensor).

    Returns:
        Tuple (the updated cache, all keys `(B, L, G, K)`, all values).
    """
    new = ops.cast(ops.stack([key, value], axis=1), cache.dtype)
    zero = ops.zeros((), "int32")
    start = ops.cast(index, "int32")
    cache = ops.slice_update(cache, (zero, zero, start, zero, zero), new)
    return cache, cache[:, 0], cache[:, 1]
