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


def rotate(
    x, layout: str, max_wavelength: float, scaling_factor: float = 1.0, offset=0
):
    """`x` (B, H, T, D) or (B, T, H, D), as `layout` says, rotated by position.

    Args:
        x: Projected queries or keys, split into heads; D must be even.
        layout: `heads.HEADS_FIRST` or `heads.TIME_FIRST`.
        max_wavelength: The longest wavelength (keras-hub's `max_wavelength`).
        scaling_factor: Positions are divided by it (keras-hub's
            `scaling_factor`).
        offset: The position of x's first step (an int or a scalar int
            tensor): the cache index when decoding.

    Returns:
        The rotated tensor, of x's shape and dtype.
    """
    dtype = x.dtype
    depth = x.shape[-1]
    time_axis = 2 if layout == heads.HEADS_FIRST else 1
    time = ops.shape(x)[time_axis]
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
    # Broadcast over batch and heads: (1, 1, T, D) or (1, T, 1, D).
    angles = ops.expand_dims(angles, (0, 1) if time_axis == 2 else (0, 2))
    x = ops.cast(x, "float32")
    x1, x2 = ops.split(x, 2, axis=-1)
    # `-x2`, not ops.negative: traced on torch inside the export pipeline the
    # latter is aten::negative, which OpenVINO's converter lacks (aten::neg).
    rotated_half = ops.concatenate([-x2, x1], axis=-1)
    out = ops.add(
        ops.multiply(x, ops.cos(angles)), ops.multiply(rotated_half, ops.sin(angles))
    )
    return ops.cast(out, keras.backend.standardize_dtype(dtype))
