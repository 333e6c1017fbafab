"""Which features of a head the rotary embedding turns, and how fast.

Partial rotary (GPT-NeoX's `rotary_percentage`): only the first `rotary_dim
= int(key_dim * rope_partial_fraction)` features of each query and key head
rotate, in halves within that part; the others pass unchanged.

The wavelengths of the rotated pairs, `max_wavelength ** (2i / rotary_dim)`,
i < rotary_dim / 2, are computed in float64 when the graph is built, so a
per-frequency scaling is a change of `rotary.digit_table`, not new runtime
ops. `rope_frequency_scaling={"rope_type": "llama3", ...}` is Llama 3.1's
and 3.2's adjustment (keras-hub's `LlamaBackbone` arguments
`rope_frequency_adjustment_factor`, `rope_low_freq_factor`,
`rope_high_freq_factor`, `rope_pretraining_sequence_length`, transformers'
`rope_scaling` keys): with `L = original_max_position_embeddings`, a pair of
wavelength `w` above `L / low_freq_factor` turns `factor` times slower, one
below `L / high_freq_factor` as it did, and one between at the inverse
wavelength `(1 - s) / (factor w) + s / w`, `s = (L / w - low_freq_factor) /
(high_freq_factor - low_freq_factor)`.
"""

from __future__ import annotations

import math

import numpy as np

LLAMA3 = "llama3"
# Each key of a "llama3" scaling and its type.
_LLAMA3_KEYS = {
    "factor": float,
    "low_freq_factor": float,
    "high_freq_factor": float,
    "original_max_position_embeddings": int,
}


def check_fraction(name: str, value) -> float:
    """`value` as a float in (0, 1], else ValueError naming `name`."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not 0 < value <= 1
    ):
        raise ValueError(
            f"`{name}` must be a number in (0, 1], the fraction of each head's "
            f"query and key features that rotate. Received: {name}={value!r}"
        )
    return float(value)


def check_scaling(name: str, value) -> dict | None:
    """`value` (None or a "llama3" dict) checked and normalised, else
    ValueError naming `name` and the value."""
    if value is None:
        return None
    expected = {"rope_type", *_LLAMA3_KEYS}
    if (
        not isinstance(value, dict)
        or value.get("rope_type") != LLAMA3
        or set(value) != expected
    ):
        raise ValueError(
            f"`{name}` must be None or a dict {{'rope_type': 'llama3', "
            "'factor', 'low_freq_factor', 'high_freq_factor', "
            "'original_max_position_embeddings'}} (Llama 3.1's frequency "
            f"adjustment). Received: {name}={value!r}"
        )
    config = {"rope_type": LLAMA3}
    for key, kind in _LLAMA3_KEYS.items():
        number = value[key]
        if (
            isinstance(number, bool)
            or not isinstance(number, (int, float))
            or not (math.isfinite(number) and number > 0)
            or (kind is int and number != int(number))
        ):
            raise ValueError(
                f"`{name}['{key}']` must be a positive {kind.__name__}. "
                f"Received: {name}={value!r}"
            )
        config[key] = kind(number)
    if config["high_freq_factor"] <= config["low_freq_factor"]:
        raise ValueError(
            f"`{name}['high_freq_factor']` must be above its 'low_freq_factor' "
            f"(the band between is interpolated). Received: {name}={value!r}"
        )
    return config


def rotary_dim(key_dim: int, fraction: float) -> int:
    """How many features of a head of `key_dim` rotate."""
    return int(key_dim * fraction)


def check_rotary_dim(rope_max_wavelength, key_dim: int, fraction: float) -> None:
    """Raises ValueError if rotary embedding is on and the rotated part of a
    head is empty or odd."""
    if rope_max_wavelength is None or fraction == 1.0:
        return
    turned = rotary_dim(key_dim, fraction)
    if turned == 0 or turned % 2:
        raise ValueError(
            f"Rotary position embedding turns int(key_dim * rope_partial_"
            f"fraction) = {turned} features of each head, in pairs: it must be "
            f"even and positive. Received: key_dim={key_dim}, "
            f"rope_partial_fraction={fraction}"
        )


def freeze(scaling: dict | None) -> tuple | None:
    """`scaling` as a hashable key (of tables cached by their arguments)."""
    return None if scaling is None else tuple(sorted(scaling.items()))


def wavelengths(rotary_dim: int, max_wavelength: float, scaling: tuple | None):
    """The float64 (rotary_dim / 2,) wavelengths of the rotated pairs, in
    positions per radian, `scaling` (`freeze`'s) applied."""
    exponents = np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim
    found = np.power(np.float64(max_wavelength), exponents)
    if scaling is None:
        return found
    config = dict(scaling)
    factor = config["factor"]
    low, high = config["low_freq_factor"], config["high_freq_factor"]
    length = np.float64(config["original_max_position_embeddings"])
    turn = 2 * np.pi * found  # positions per turn
    smooth = (length / turn - low) / (high - low)
    medium = 1.0 / ((1 - smooth) / (factor * found) + smooth / found)
    adjusted = np.where(turn > length / low, found * factor, found)
    between = (turn >= length / high) & (turn <= length / low)
    return np.where(between, medium, adjusted)
