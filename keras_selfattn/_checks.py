"""Argument checks that raise ValueError naming the argument and the value."""

from __future__ import annotations

import math
from numbers import Integral, Real


def _is_int(value) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


def positive_int(name: str, value, allow_none: bool = False):
    """Returns `value` as an int, or None when allowed; else ValueError."""
    if value is None and allow_none:
        return None
    if not _is_int(value) or value < 1:
        expected = "a positive integer" + (" or None" if allow_none else "")
        raise ValueError(f"`{name}` must be {expected}. Received: {name}={value!r}")
    return int(value)


def positive_float(name: str, value, allow_none: bool = False):
    """Returns `value` as a finite float > 0, or None when allowed."""
    if value is None and allow_none:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, Real)
        or not math.isfinite(value)
        or value <= 0
    ):
        expected = "a finite number > 0" + (" or None" if allow_none else "")
        raise ValueError(f"`{name}` must be {expected}. Received: {name}={value!r}")
    return float(value)


def rate(name: str, value) -> float:
    """Returns `value` as a float in [0, 1)."""
    if isinstance(value, bool) or not isinstance(value, Real) or not 0 <= value < 1:
        raise ValueError(
            f"`{name}` must be a number in [0, 1). Received: {name}={value!r}"
        )
    return float(value)


def boolean(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"`{name}` must be True or False. Received: {name}={value!r}")
    return value


def optional_int(name: str, value):
    if value is not None and not _is_int(value):
        raise ValueError(
            f"`{name}` must be an integer or None. Received: {name}={value!r}"
        )
    return value
