"""Rotary position embedding (RoPE) of projected queries and keys.

The rotation of keras-hub's `RotaryEmbedding`, in halves (not interleaved):
for a head of size D, position p and i < D/2, the pair
`(x[i], x[i + D/2])` is rotated by the angle
`p / scaling_factor / max_wavelength ** (2i / D)`:

    out = x * cos + rotate_half(x) * sin,  rotate_half(x) = concat(-x2, x1)

with `x1 = x[..., :D/2]`, `x2 = x[..., D/2:]` and the (T, D/2) angle table
tiled to D by concatenating it with itself. Positions are offset .. offset
+ T - 1 along the time axis of the layout (`heads.HEADS_FIRST` or `heads.TIME_FIRST`).
With partial rotary only the first R features rotate, in halves of R/2:
the pass-through features get the angle 0 (cos exactly 1, sin exactly 0)
and `rotate_half(x) = concat(-x2, x1, x3)`, `x3 = x[..., R:]`, so they come
out unchanged; `rope_frequencies` gives the wavelengths (Llama 3.1's
per-frequency adjustment included). A longrope scaling has two digit
tables, stacked: a call whose end position (offset + T) exceeds its
`switch_length` looks its rows up in the second (the long one). Given each
row's own positions (`positions`, a generation's left-padded rows), a
longrope table is per row: the row's positions, and the long table where
the row's own end exceeds the switch, so that each row computes what it
computes alone (keys of both tables make scores depend on absolute
positions, not only on their difference).

The cosines and sines come from constants, never from a runtime's own
`sin` and `cos`: a position p is written in base 256, p = sum_l d_l 256^l,
and the rotation by p is the product of the rotations by d_l 256^l, each
looked up in a table of cosines and sines computed in float64 when the
graph is built (`digit_table`, 4 x 256 rows of D):

    cos(a + b) = cos a cos b - sin a sin b,  sin(a + b) = sin a cos b + cos a sin b

Only gathers, integer division and float32 products and differences, which
every runtime rounds alike: the table is the same to the bit in Keras (on
TensorFlow) and in its SavedModel, LiteRT (XNNPACK or not), ONNX Runtime and
OpenVINO files, and within about a float32 ulp per digit of the exact one
at any int32 position. A digit 0 rotates by exactly nothing (cos 1, sin 0),
so a table built with fewer digits (every position known while tracing) is
the same to the bit too.

Float32 angles and the runtime's `sin` and `cos` made it differ: the angle
loses up to p * 2^-24 radians (that table was 3e-6 from the exact one below
position 512, this one is 1e-7), and each runtime's `sin` and `cos` differ
from TensorFlow's by 1-2 ulps (ai_edge_litert's by up to 2.4e-7). Rotated
queries and keys that differ by an ulp change a score in proportion to its
size, and the softmax of scores of tens turned those ulps into outputs past
the export check's 1e-5 + 1e-4 |keras| (LiteRT files of rotary models
refused, max abs err 1e-3 at 2x128). The rotation itself runs in float32;
the result is cast back to the input's dtype.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator

import keras
import numpy as np
from keras import ops

from keras_selfattn.attention import backend_ops, heads, masks, rope_frequencies

# A position is written in base `BASE` with at most `DIGITS` digits: enough
# for every int32 position (256 ** 4 = 2 ** 32).
BASE = 256
DIGITS = 4


def _rows_of(table, rows):
    """`table[rows]`. On torch, `embedding` on the int32 rows: Keras's
    `take` makes them int64 and corrects negative ones (an `lt` on int64),
    which litert-torch cannot lower; these rows are never negative."""
    if keras.backend.backend() == "torch":
        import torch

        return torch.nn.functional.embedding(rows, table)
    return ops.take(table, rows, 0)


@functools.lru_cache(maxsize=64)
def digit_table(
    depth: int,
    max_wavelength: float,
    scaling_factor: float,
    rotary_dim: int | None = None,
    frequency_scaling: tuple | None = None,
    long: bool = False,
) -> np.ndarray:
    """The float32 (DIGITS * BASE, 2 * W) table of the rotations by d * BASE**l,
    computed in float64, W = D - R/2 (R: `rotary_dim`, D by default): row
    l * BASE + d holds the cosines (its first W entries), then the sines, of
    the angles (d * BASE**l / scaling_factor) / wavelength_i, the R/2
    wavelengths of `rope_frequencies.wavelengths` (max_wavelength ** (2i /
    R) unless `frequency_scaling`, its `freeze`d dict, adjusts them; a
    longrope one's long table if `long`), then D - R angles 0 (the features
    that pass)."""
    rotary_dim = depth if rotary_dim is None else rotary_dim
    wavelengths = rope_frequencies.wavelengths(
        rotary_dim, max_wavelength, frequency_scaling, long
    )
    wavelengths = np.concatenate([wavelengths, np.full(depth - rotary_dim, np.inf)])
    steps = (
        np.arange(DIGITS * BASE)
        % BASE
        * np.float64(BASE) ** (np.arange(DIGITS * BASE) // BASE)
    )
    angles = (steps / np.float64(scaling_factor))[:, None] / wavelengths[None, :]
    found = np.concatenate([np.cos(angles), np.sin(angles)], axis=-1)
    found = found.astype("float32")
    found.flags.writeable = False  # shared by every call (lru_cache)
    return found


def _divide(x, divisor):
    """`x // divisor` of non-negative int32 tensors. On JAX `lax.div`
    (truncating, the same for them): `jnp.floor_divide` takes a remainder,
    which jax2onnx cannot convert for a time of symbolic size."""
    if keras.backend.backend() == "jax":
        import jax
        import jax.numpy as jnp

        x, divisor = jnp.broadcast_arrays(x, jnp.asarray(divisor, x.dtype))
        return jax.lax.div(x, divisor)
    return ops.floor_divide(x, divisor)


def _digits_needed(time, offset) -> int:
    """How many base-`BASE` digits the positions offset .. offset + T - 1
    have: `DIGITS` unless both are known while tracing."""
    if not (isinstance(time, int) and isinstance(offset, int)):
        return DIGITS
    largest = max(offset + time - 1, 0)
    needed = 1
    while BASE**needed <= largest:
        needed += 1
    return needed


# Within `shared_tables()`: the tables computed so far, by their arguments.
_SHARED: contextvars.ContextVar[dict | None] = contextvars.ContextVar(
    "keras_selfattn_shared_rotary_tables", default=None
)


@contextlib.contextmanager
def shared_tables() -> Iterator[None]:
    """Within this context, `table` computes each table once and hands it to
    every later call with the same offset and positions (the same tensor
    objects), head size and wavelengths, and a time of the same static size
    or, where it is not static, any time: for the layers of one decoding
    step, which all take the step's new positions
    (`cached_model.run_cached`), so a traced step holds one table instead of
    one per layer."""
    token = _SHARED.set({})
    try:
        yield
    finally:
        _SHARED.reset(token)


def _key(value):
    return value if isinstance(value, int) else id(value)


def table(
    time,
    depth: int,
    max_wavelength: float,
    scaling_factor: float = 1.0,
    offset=0,
    rotary_dim: int | None = None,
    frequency_scaling: dict | None = None,
    positions=None,
):
    """`_table` (its docstring), computed once per arguments within
    `shared_tables()`."""
    arguments = (
        depth,
        float(max_wavelength),
        float(scaling_factor),
        depth if rotary_dim is None else rotary_dim,
        rope_frequencies.freeze(frequency_scaling),
    )
    shared = _SHARED.get()
    if shared is None:
        return _table(time, offset, *arguments, positions)
    size = time if isinstance(time, int) else None
    key = (size, _key(offset), _key(positions), *arguments)
    if key not in shared:
        # The offset and positions are kept with the table: their ids stay
        # their own.
        shared[key] = (
            time,
            offset,
            positions,
            _table(time, offset, *arguments, positions),
        )
    return shared[key][3]


def per_row(frequency_scaling: dict | None) -> bool:
    """Whether a layer's tables follow each row's own positions (`table`'s
    `positions`): a longrope scaling's, whose table switches by position."""
    return bool(frequency_scaling) and (
        frequency_scaling["rope_type"] == rope_frequencies.LONGROPE
    )


def _table(
    time,
    offset,
    depth: int,
    max_wavelength: float,
    scaling_factor: float,
    rotary_dim: int,
    frequency_scaling: tuple | None,
    positions=None,
):
    """The (T, D) cosines and sines of positions offset .. offset + T - 1, once
    per call for both queries and keys; (B, T, D) ones of `positions`.

    Args:
        time: T, the number of positions (an int or a scalar int tensor).
        offset: The position of the first step (an int or a scalar int
            tensor; positions must stay below 2**31): the cache index when
            decoding.
        depth: D, the head size.
        max_wavelength: The longest wavelength (keras-hub's `max_wavelength`).
        scaling_factor: Positions are divided by it (keras-hub's
            `scaling_factor`).
        rotary_dim: R, how many of the D features rotate (even).
        frequency_scaling: `rope_frequencies.freeze` of the layer's
            `rope_frequency_scaling`.
        positions: None, or int32 (B or 1, T): each row's own positions of
            the slots offset .. offset + T - 1, none above its slot (a
            longrope layer in a generation: `decoding.Scope.positions`):
            then each row's table is the long one where its own end (its
            last position + 1) exceeds the switch.

    Returns:
        A tuple `(cos, sin)` of float32 tensors of shape (T, D) (or (B, T,
        D)), the same to the bit however many digits are used, in Keras on
        each backend (on a CPU) and in the exported runtimes.
    """
    arguments = (depth, max_wavelength, scaling_factor, rotary_dim, frequency_scaling)
    count = _digits_needed(time, offset)
    rotations = digit_table(*arguments)[: count * BASE]
    switch = rope_frequencies.switch_length(frequency_scaling)
    long = None  # the first row of the table each position looks up (a tensor)
    end = None  # each row's own end, (B, 1, 1), where positions are per row
    if positions is None:
        positions = masks.positions(time, "int32")
        if not (isinstance(offset, int) and offset == 0):
            positions = positions + ops.cast(offset, "int32")
    else:
        end = ops.expand_dims(ops.add(positions[:, -1:], 1), -1)
    if switch is not None:
        if end is None and isinstance(offset, int) and isinstance(time, int):
            if offset + time > switch:
                rotations = digit_table(*arguments, long=True)[: count * BASE]
        else:
            long_rows = digit_table(*arguments, long=True)[: count * BASE]
            rotations = np.concatenate([rotations, long_rows])
            if end is None:
                end = ops.add(ops.cast(offset, "int32"), ops.cast(time, "int32"))
            long = ops.cast(ops.greater(end, switch), "int32") * (count * BASE)
    rows = ops.expand_dims(positions, -1)  # (..., T, 1)
    if count > 1:  # (..., T, count): digit l of each position, as a row of level l
        powers = ops.convert_to_tensor(
            np.array([BASE**level for level in range(count)], "int32")
        )
        # Tensors, not numpy arrays: a numpy operand fails torch.export, and
        # ops.add of a 1-D array is an int32 BiasAdd on TensorFlow, which
        # LiteRT lacks.
        above = _divide(rows, powers)  # the digits from level l up
        digits = above - _divide(above, BASE) * BASE
        levels = np.arange(0, count * BASE, BASE, dtype="int32")
        rows = digits + ops.convert_to_tensor(levels)
    if long is not None:
        rows = rows + long
    looked_up = _rows_of(ops.convert_to_tensor(rotations), rows)
    axis = len(looked_up.shape) - 2  # the levels' (..., T, count, 2 W)
    level_cos, level_sin = (
        ops.unstack(half, count, axis=axis) for half in ops.split(looked_up, 2, axis=-1)
    )
    cos, sin = level_cos[0], level_sin[0]
    for digit_cos, digit_sin in zip(level_cos[1:], level_sin[1:], strict=True):
        # The rotation by the digits so far, then by this one; a digit 0 is
        # cos 1, sin 0, which leaves both exactly as they are.
        cos, sin = (
            cos * digit_cos - sin * digit_sin,
            sin * digit_cos + cos * digit_sin,
        )
    if rotary_dim == depth:
        return ops.concatenate([cos, cos], axis=-1), ops.concatenate(
            [sin, sin], axis=-1
        )
    # (the R/2 angles, the R/2 angles again, the D - R angles 0)
    half = rotary_dim // 2
    return tuple(ops.concatenate([t[..., :half], t], axis=-1) for t in (cos, sin))


def rotate(x, layout: str, cos_sin, rotary_dim: int | None = None):
    """`x` (B, H, T, D) or (B, T, H, D), as `layout` says, rotated by position.

    Args:
        x: Projected queries or keys, split into heads.
        layout: `heads.HEADS_FIRST` or `heads.TIME_FIRST`.
        cos_sin: `table(T, D, ...)` for x's positions: (T, D), or (B, T, D)
            per row.
        rotary_dim: R, how many of the D features rotate (even): the first
            R; D (all) by default.

    Returns:
        The rotated tensor, of x's shape and dtype.
    """
    dtype = x.dtype
    # Broadcast over batch and heads: (1, 1, T, D) or (1, T, 1, D), one
    # reshape each (two expand_dims would be two ops in a decoding step).
    depth = x.shape[-1]
    if len(cos_sin[0].shape) == 3:  # per row: (B, 1, T, D) or (B, T, 1, D)
        axis = 1 if layout == heads.HEADS_FIRST else 2
        cos, sin = (ops.expand_dims(t, axis) for t in cos_sin)
    else:
        shape = (1, 1, -1, depth) if layout == heads.HEADS_FIRST else (1, -1, 1, depth)
        cos, sin = (backend_ops.reshape(t, shape) for t in cos_sin)
    x = ops.cast(x, "float32")
    # `concatenate([-x2, x1, x3]) * sin` bit for bit, as x's halves swapped
    # (one gather) times the sines with their first half negated (one
    # multiply of the table, common to the layers): three ops a rotation
    # (split, negation, concatenation) fewer in a decoding step. The table's
    # sines of the passing features x3 are 0.
    half = (rotary_dim or depth) // 2
    swapped = backend_ops.reorder_last(x, _swap_halves(half, depth))
    signs = backend_ops.constant_for(_first_half_negated(half, depth), sin)
    signed_sin = ops.multiply(sin, signs)
    out = ops.add(ops.multiply(x, cos), ops.multiply(swapped, signed_sin))
    return ops.cast(out, keras.backend.standardize_dtype(dtype))


def _swap_halves(half: int, depth: int) -> np.ndarray:
    """The features' order with the first two `half`-blocks swapped."""
    rotating = np.concatenate([np.arange(half, 2 * half), np.arange(half)])
    return np.concatenate([rotating, np.arange(2 * half, depth)]).astype("int32")


def _first_half_negated(half: int, depth: int) -> np.ndarray:
    """float32 `(depth,)`: -1 for the first `half` features, else 1."""
    return np.where(np.arange(depth) < half, -1.0, 1.0).astype("float32")
