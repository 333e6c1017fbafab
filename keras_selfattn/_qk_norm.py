"""SelfAttention's query and key RMS norms (`use_query_key_norm`): their
weights, and their formula.

Each query and key head `x` (its last axis, `key_dim` features) becomes

    x / sqrt(mean(x ** 2) + epsilon) * scale

in float32 whatever the compute dtype, cast back after; `scale` is the
weight `query_norm_scale` or `key_norm_scale`, `(key_dim,)`, starting at
ones, shared by the heads (Qwen 3's and Gemma 3's). It applies to the
projections before the rotary embedding, so the cache holds normalized keys.
A square root and a division, rounded alike by every runtime the exporters
write for (an `rsqrt` may be approximate).
"""

from __future__ import annotations

from keras import ops

_NAMES = ("query_norm_scale", "key_norm_scale")


def add(layer, key_dim: int) -> None:
    """Adds `query_norm_scale` and `key_norm_scale` `(key_dim,)` (ones) where
    the layer's `use_query_key_norm` asks for them; float32 variables read
    unconverted under mixed precision (the norm computes in float32)."""
    if not layer.use_query_key_norm:
        return
    for name in _NAMES:
        weight = layer.add_weight(
            name=name, shape=(key_dim,), initializer="ones", autocast=False
        )
        setattr(layer, name, weight)


def names(layer) -> tuple[str, ...]:
    """The names of the weights `add` adds, in the order it adds them."""
    return _NAMES if layer.use_query_key_norm else ()


def normalize(layer, x, name: str):
    """`x` (its last axis a head) normalized by the norm `name` ("query" or
    "key") of `layer`, in `x`'s dtype; `x` itself if the layer has none."""
    if not layer.use_query_key_norm:
        return x
    dtype = x.dtype
    x = ops.cast(x, "float32")
    mean_square = ops.mean(ops.square(x), axis=-1, keepdims=True)
    x = ops.divide(x, ops.sqrt(mean_square + layer.query_key_norm_epsilon))
    scale = ops.cast(getattr(layer, f"{name}_norm_scale"), "float32")
    return ops.cast(ops.multiply(x, scale), dtype)
