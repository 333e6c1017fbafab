"""Argument checks that raise ValueError naming the argument and the value."""

from __future__ import annotations

import math
from numbers import Integral, Real

import keras
import numpy as np

# Largest dimension and weight size: TensorFlow indexes many kernels with
# int32, and no attention projection needs 2**31 elements (8 GB in float32).
MAX_SIZE = 2**31 - 1


def _is_int(value) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


def positive_int(name: str, value, allow_none: bool = False):
    """Returns `value` as an int, or None when allowed; else ValueError."""
    if value is None and allow_none:
        return None
    if not _is_int(value) or not 1 <= value <= MAX_SIZE:
        expected = "an integer in [1, 2**31 - 1]" + (" or None" if allow_none else "")
        raise ValueError(f"`{name}` must be {expected}. Received: {name}={value!r}")
    return int(value)


# Largest finite float32: a multiplier of float32 scores beyond it is inf.
FLOAT32_MAX = 3.4028234663852886e38


def positive_float(name: str, value, allow_none: bool = False):
    """Returns `value` as a float in (0, float32's largest], or None when
    allowed (the layer computes in float32 at most)."""
    if value is None and allow_none:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, Real)
        or not math.isfinite(value)
        or not 0 < value <= FLOAT32_MAX
    ):
        expected = "a number in (0, 3.4e38] (finite in float32)" + (
            " or None" if allow_none else ""
        )
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
    """Returns `value` if it is None or a 64-bit integer (a seed)."""
    if value is not None and (not _is_int(value) or not -(2**63) <= value < 2**63):
        raise ValueError(
            f"`{name}` must be a 64-bit integer or None. Received: {name}={value!r}"
        )
    return value


def dtype_policy(value):
    """The DTypePolicy named by a layer's `dtype` argument, else ValueError.

    (Keras returns a plain string for a config dict of an unknown class,
    which its Layer then fails on with an AttributeError.)
    """
    policy = keras.dtype_policies.get(value)
    if not isinstance(policy, keras.dtype_policies.DTypePolicy):
        raise ValueError(
            "`dtype` must be a dtype name, a DTypePolicy or its config. "
            f"Received: dtype={value!r}"
        )
    return policy


def config_dtype(config):
    """A layer config with its `dtype` config checked (ValueError): Keras's
    own `from_config` fails with an AttributeError on a `dtype` config of an
    unknown class."""
    if isinstance(config, dict) and isinstance(config.get("dtype"), dict):
        config = {**config, "dtype": dtype_policy(config["dtype"])}
    return config


def float_policy(policy) -> None:
    """Raises ValueError unless the dtype policy computes and stores floats."""
    for dtype in (policy.compute_dtype, policy.variable_dtype):
        if not keras.backend.is_float_dtype(dtype):
            raise ValueError(
                "`dtype` must be a floating-point dtype or policy such as "
                "'float32', 'mixed_float16' or 'mixed_bfloat16'. "
                f"Received: dtype={policy.name!r}"
            )


def finite_config(name: str, value):
    """Returns `value` (an initializer, regularizer, constraint or None) if no
    number in its config is NaN or infinite (such weights would be NaN)."""
    if value is None:
        return value
    config = value.get_config()
    for key, item in config.items():
        if item is None or isinstance(item, str):
            continue
        try:
            numbers = np.asarray(item, dtype="float64")
        except (TypeError, ValueError):
            continue
        if not np.isfinite(numbers).all():
            raise ValueError(
                f"`{name}` has {key}={item!r}; it must be finite. "
                f"Received: {name}={type(value).__name__}({config})"
            )
    return value
