"""Rotary position embedding (RoPE) of projected queries and keys.

The rotation of keras-hub's `RotaryEmbedding`, in halves (not interleaved):
for a head of size D, position p and i < D/2, the pair
`(x[i], x[i + D/2])` is rotated by the angle
`p / scaling_factor / max_wavelength ** (2i / D)`:

    out = x * cos + rotate_half(x) * sin,  rotate_half(x) = concat(-x2, x1)

with `x1 = x[..., :D/2]`, `x2 = x[..., D/2:]` and the (T, D/2) angle table
tiled to D by concatenating it with itself. Positions are offset .. offset
+ T - 1 along the time axis of the layout (`heads.HEADS_FIRST` or `heads.TIME_FIRST`).
The angles, their cosines and the rotation run in float32; the result is
cast back to the input's dtype.
"""

from __future__ import annotations

import keras
from keras import ops

from keras_selfattn.attention import heads, masks


def table(
    time, depth: int, max_wavelength: float, scaling_factor: float = 1.0, offset=0
):
    """The (T, D) cosines and sines of positions offset .. offset + T - 1, once
    per call for both queries and keys.

    Args:
        time: T, the number of positions (an int or a scalar int tensor).
        depth: D, the head size (even).
        max_wavelength: The longest wavelength (keras-hub's `max_wavelength`).
        scaling_factor: Positions are divided by it (keras-hub's
            `scaling_factor`).
        offset: The position of the first step (an int or a scalar int
            tensor): the cache index when decoding.

    Returns:
        A tuple `(cos, sin)` of float32 tensors of shape (T, D).
    """
    exponents = ops.arange(0, depth, 2, dtype="float32") / float(depth)
    inverse_freq = 1.0 / ops.power(float(max_wavelength), exponents)
    positions = masks.positions(time, "float32")
    if not (isinstance(offset, int) and offset == 0):
        positions = positions + ops.cast(offset, "float32")
    positions = positions / float(scaling_factor)
    angles = ops.multiply(
        ops.expand_dims(positions, 1), ops.expand_dims(inverse_freq, 0)
    )
    angles = ops.concatenate([angles, angles], axis=-1)  # (T, D)
    return ops.cos(angles), ops.sin(angles)


def rotate(x, layout: str, cos_sin):
    """`x` (B, H, T, D) or (B, T, H, D), as `layout` says, rotated by position.

    Args:
        x: Projected queries or keys, split into heads; D must be even.
        layout: `heads.HEADS_FIRST` or `heads.TIME_FIRST`.
        cos_sin: `table(T, D, ...)` for x's positions.

    Returns:
        The rotated tensor, of x's shape and dtype.
    """
    dtype = x.dtype
    # Broadcast over batch and heads: (1, 1, T, D) or (1, T, 1, D).
    axes = (0, 1) if layout == heads.HEADS_FIRST else (0, 2)
    cos, sin = (ops.expand_dims(t, axes) for t in cos_sin)
    x = ops.cast(x, "float32")
    x1, x2 = ops.split(x, 2, axis=-1)
    # `-x2`, not ops.negative: traced on torch inside the export pipeline the
    # latter is aten::negative, which OpenVINO's converter lacks (aten::neg).
    rotated_half = ops.concatenate([-x2, x1], axis=-1)
    out = ops.add(ops.multiply(x, cos), ops.multiply(rotated_half, sin))
    return ops.cast(out, keras.backend.standardize_dtype(dtype))
