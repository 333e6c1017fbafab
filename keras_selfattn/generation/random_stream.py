"""A counter-based uniform stream that every runtime computes alike.

Sampled generation needs one uniform number per sequence and step, and an
exported generator must draw the same numbers as `generate` does in
Python, in TensorFlow, JAX, PyTorch, ONNX Runtime and LiteRT. Random ops
differ between runtimes (and some have none), so the stream is arithmetic
that all of them compute exactly: `uniforms(seed, rows, steps)` is a pure
function of three integers, made of int32 operations that never overflow
(multiply, add, subtract, floor division, compare):

- the state is an integer modulo the prime M = 2**31 - 1, starting at 0;
- the seed (taken mod M), the row and the step are each added to it, and
  each is followed by `ROUNDS` rounds of x -> (x + c) ** 5 mod M, with a
  round constant c (a permutation of the integers mod M, since 5 does not
  divide M - 1, and not linear in them: the construction of the MiMC
  ciphers);
- products mod M are computed in 15-bit pieces by Schrage's method, so
  every intermediate stays below 2**31;
- the uniform is the state's top 24 bits times 2**-24: a float32 in
  [0, 1) with every value exact, so no runtime rounds it differently.

`tests/test_generation.py` checks it against an independent copy in
Python's integers, and for uniformity and independence of neighbouring
steps and rows.
"""

from __future__ import annotations

from keras import ops

MODULUS = 2147483647  # 2**31 - 1
ROUNDS = 2
# Round constants: well-known 32-bit multipliers (xorshift*, PCG, MT19937's
# initialization, ...), reduced mod M.
CONSTANTS = (625341585, 1481765933, 335903614, 1812433253, 666578662, 374761393)
_PIECE = 1 << 15
_LOW = 1 << 16
_TOP_BITS = 128  # a state below 2**31 // 128: its top 24 bits


def _add_where_negative(x, amount: int):
    """x + amount where x < 0, else x: a multiply by 0 or 1 rather than a
    select, so no lane computes an overflowing sum it then discards."""
    return ops.add(x, ops.multiply(ops.cast(ops.less(x, 0), "int32"), amount))


def _add(x, y):
    """(x + y) mod M for x, y in [0, M)."""
    return _add_where_negative(ops.subtract(x, ops.subtract(MODULUS, y)), MODULUS)


def _times_small(x, a):
    """x * a mod M for x in [0, M) and a in [0, 2**15) (Schrage's method:
    a * (x mod q) < M and (M mod a) * (x // q) < a**2)."""
    safe = ops.maximum(a, 1)
    quotient = ops.floor_divide(MODULUS, safe)
    remainder = ops.subtract(MODULUS, ops.multiply(quotient, safe))
    high = ops.floor_divide(x, quotient)
    low = ops.subtract(x, ops.multiply(high, quotient))
    value = ops.subtract(ops.multiply(safe, low), ops.multiply(remainder, high))
    value = _add_where_negative(value, MODULUS)
    return ops.multiply(value, ops.cast(ops.greater(a, 0), "int32"))


def _times_piece(x):
    """x * 2**15 mod M: a rotation of x's 31 bits by 15."""
    high = ops.floor_divide(x, _LOW)
    return ops.add(
        ops.multiply(ops.subtract(x, ops.multiply(high, _LOW)), _PIECE), high
    )


def _times(x, y):
    """x * y mod M for x, y in [0, M): y in 15-bit pieces, Horner's rule."""
    top = ops.floor_divide(y, _PIECE * _PIECE)
    middle = ops.floor_divide(
        ops.subtract(y, ops.multiply(top, _PIECE * _PIECE)), _PIECE
    )
    bottom = ops.subtract(
        y, ops.add(ops.multiply(top, _PIECE * _PIECE), ops.multiply(middle, _PIECE))
    )
    result = ops.multiply(x, top)  # top is 0 or 1
    result = _add(_times_piece(result), _times_small(x, middle))
    return _add(_times_piece(result), _times_small(x, bottom))


def _absorb(state, value, first_constant: int):
    state = _add(state, value)
    for number in range(ROUNDS):
        constant = CONSTANTS[(first_constant + number) % len(CONSTANTS)]
        state = _add(state, ops.zeros_like(state) + constant)
        square = _times(state, state)
        state = _times(_times(square, square), state)
    return state


def uniforms(seed, rows, steps):
    """The uniforms of every row at every step, for `seed` (module docstring).

    Args:
        seed: int32 scalar, any value.
        rows: int32 `(batch,)`, each in [0, 2**31 - 2].
        steps: int32 `(steps,)`, each in [0, 2**31 - 2].

    Returns:
        float32 `(batch, steps)` in [0, 1).
    """
    seed = ops.mod(ops.cast(seed, "int32"), MODULUS)
    rows = ops.expand_dims(ops.cast(rows, "int32"), 1)
    steps = ops.expand_dims(ops.cast(steps, "int32"), 0)
    state = _absorb(ops.zeros_like(rows), ops.add(ops.zeros_like(rows), seed), 0)
    state = _absorb(state, rows, ROUNDS)
    state = _absorb(
        ops.add(state, ops.zeros_like(steps)),
        ops.add(steps, ops.zeros_like(state)),
        2 * ROUNDS,
    )
    top = ops.floor_divide(state, _TOP_BITS)
    return ops.multiply(ops.cast(top, "float32"), 2.0**-24)
