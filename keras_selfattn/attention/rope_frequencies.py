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

`rope_frequency_scaling={"rope_type": "yarn", ...}` is YaRN's (keras-hub's
`RotaryEmbedding(rope_type="yarn")`, GPT-OSS's; transformers' keys):
with R the rotated features, the correction dimension of `n` turns over
`L = original_max_position_embeddings` positions is `c(n) = R ln(L / (2 pi
n)) / (2 ln max_wavelength)`; pair i keeps its inverse wavelength `1 / w`
below `low = c(beta_fast)`, turns `factor` times slower above `high =
c(beta_slow)`, and is interpolated between: `ramp = clip((i - low) / max(high
- low, 0.001), 0, 1)`, inverse wavelength `ramp / (factor w) + (1 - ramp) /
w` (with `truncate`, low is floored and high ceiled first; then `low >= 0`,
`high <= R - 1`). Only the frequencies: YaRN's temperature `t = 0.1
ln(factor) + 1`, which multiplies the rotated queries and keys, is the
layer's `scale` (`t ** 2 / sqrt(key_dim)`), and positions are not divided by
`rope_scaling_factor` (leave it 1).

`rope_frequency_scaling={"rope_type": "longrope", ...}` is Phi-3's "su" /
LongRoPE (keras-hub's `Phi3SuScaledRotaryEmbedding`, transformers'
`longrope`): two tables, pair i's wavelength multiplied by `short_factor[i]`
or by `long_factor[i]` (rotary_dim / 2 factors each). A call uses the long
one when its end position (its cache index plus its length; a full call's
length) exceeds `N = original_max_position_embeddings`, else the short one
(`switch_length`): a choice at run time, and keys in a cache keep the table
they were written with. In a generation each row's end is its own
(`rotary.table`'s `positions`): each row computes what it computes alone.
Only the frequencies: LongRoPE's multiplier of the cosines and sines,
`sqrt(1 + ln(max / N) / ln(N))` (`longrope_multiplier`), is the layer's
`scale` (its square times `1 / sqrt(key_dim)`).
"""

from __future__ import annotations

import math

import numpy as np

LLAMA3 = "llama3"
YARN = "yarn"
LONGROPE = "longrope"
# Each key of a scaling, its type and its default (None: required).
_KEYS = {
    LLAMA3: {
        "factor": (float, None),
        "low_freq_factor": (float, None),
        "high_freq_factor": (float, None),
        "original_max_position_embeddings": (int, None),
    },
    YARN: {
        "factor": (float, None),
        "beta_fast": (float, 32.0),
        "beta_slow": (float, 1.0),
        "original_max_position_embeddings": (int, None),
        "truncate": (bool, True),
    },
    LONGROPE: {
        "short_factor": (list, None),
        "long_factor": (list, None),
        "original_max_position_embeddings": (int, None),
    },
}
_USAGE = (
    "None, {'rope_type': 'llama3', 'factor', 'low_freq_factor', "
    "'high_freq_factor', 'original_max_position_embeddings'} (Llama 3.1's "
    "frequency adjustment) or {'rope_type': 'yarn', 'factor', "
    "'original_max_position_embeddings', optional 'beta_fast' (32), "
    "'beta_slow' (1), 'truncate' (True)} (YaRN's frequencies; its temperature "
    "is the layer's `scale`) or {'rope_type': 'longrope', 'short_factor', "
    "'long_factor', 'original_max_position_embeddings'} (Phi-3's 'su' tables)"
)


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


def _checked(name: str, key: str, kind: type, number, value):
    if kind is list:
        if not isinstance(number, (list, tuple)) or not number:
            raise ValueError(
                f"`{name}['{key}']` must be a non-empty list of positive "
                f"numbers. Received: {name}={value!r}"
            )
        return [_checked(name, key, float, factor, value) for factor in number]
    if kind is bool:
        if not isinstance(number, bool):
            raise ValueError(
                f"`{name}['{key}']` must be True or False. Received: {name}={value!r}"
            )
        return number
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
    return kind(number)


def check_scaling(name: str, value) -> dict | None:
    """`value` (None, a "llama3", "yarn" or "longrope" dict) checked and normalised
    (every key, defaults filled in), else ValueError naming `name` and the
    value."""
    if value is None:
        return None
    keys = _KEYS.get(value.get("rope_type")) if isinstance(value, dict) else None
    required = {key for key, (_, default) in (keys or {}).items() if default is None}
    if keys is None or not required <= set(value) <= {"rope_type", *keys}:
        raise ValueError(f"`{name}` must be {_USAGE}. Received: {name}={value!r}")
    config = {"rope_type": value["rope_type"]}
    for key, (kind, default) in keys.items():
        config[key] = _checked(name, key, kind, value.get(key, default), value)
    if config["rope_type"] == LLAMA3:
        if config["high_freq_factor"] <= config["low_freq_factor"]:
            raise ValueError(
                f"`{name}['high_freq_factor']` must be above its "
                "'low_freq_factor' (the band between is interpolated). "
                f"Received: {name}={value!r}"
            )
    elif config["rope_type"] == YARN and config["beta_fast"] <= config["beta_slow"]:
        raise ValueError(
            f"`{name}['beta_fast']` must be above its 'beta_slow' (the turns "
            f"that bound the interpolated band). Received: {name}={value!r}"
        )
    return config


def rotary_dim(key_dim: int, fraction: float) -> int:
    """How many features of a head of `key_dim` rotate."""
    return int(key_dim * fraction)


def check_rotary_dim(
    rope_max_wavelength, key_dim: int, fraction: float, scaling: dict | None = None
) -> None:
    """Raises ValueError if rotary embedding is on and the rotated part of a
    head is empty or odd, or a longrope `scaling` (`check_scaling`'s) has
    other than one factor per rotated pair."""
    if rope_max_wavelength is None:
        return
    turned = rotary_dim(key_dim, fraction)
    if scaling is not None and scaling["rope_type"] == LONGROPE:
        for key in ("short_factor", "long_factor"):
            if len(scaling[key]) != turned // 2:
                raise ValueError(
                    f"`rope_frequency_scaling['{key}']` must hold one factor per "
                    f"rotated pair: {turned // 2} (key_dim={key_dim}). Received: "
                    f"{len(scaling[key])} factors, rope_frequency_scaling={scaling!r}"
                )
    if fraction == 1.0:
        return
    if turned == 0 or turned % 2:
        raise ValueError(
            f"Rotary position embedding turns int(key_dim * rope_partial_"
            f"fraction) = {turned} features of each head, in pairs: it must be "
            f"even and positive. Received: key_dim={key_dim}, "
            f"rope_partial_fraction={fraction}"
        )


def freeze(scaling: dict | None) -> tuple | None:
    """`scaling` as a hashable key (of tables cached by their arguments)."""
    if scaling is None:
        return None
    return tuple(
        sorted(
            (key, tuple(item) if isinstance(item, list) else item)
            for key, item in scaling.items()
        )
    )


def switch_length(scaling: tuple | None) -> int | None:
    """N of a longrope `scaling` (`freeze`'s): a call ending past N
    positions uses the long table. None for the other scalings."""
    config = dict(scaling or ())
    if config.get("rope_type") != LONGROPE:
        return None
    return config["original_max_position_embeddings"]


def longrope_multiplier(max_length: int, original: int) -> float:
    """LongRoPE's multiplier of the cosines and sines of a model extended
    from `original` to `max_length` positions: `sqrt(1 + ln(max_length /
    original) / ln(original))`, 1 where it is not extended."""
    ratio = max_length / original
    if ratio <= 1:
        return 1.0
    return math.sqrt(1 + math.log(ratio) / math.log(original))


def wavelengths(
    rotary_dim: int, max_wavelength: float, scaling: tuple | None, long: bool = False
):
    """The float64 (rotary_dim / 2,) wavelengths of the rotated pairs, in
    positions per radian, `scaling` (`freeze`'s) applied: a longrope one's
    long table if `long`, else its short one."""
    exponents = np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim
    found = np.power(np.float64(max_wavelength), exponents)
    if scaling is None:
        return found
    config = dict(scaling)
    if config["rope_type"] == YARN:
        return _yarn(found, rotary_dim, max_wavelength, config)
    if config["rope_type"] == LONGROPE:
        factors = config["long_factor" if long else "short_factor"]
        return found * np.asarray(factors, np.float64)
    factor = config["factor"]
    low, high = config["low_freq_factor"], config["high_freq_factor"]
    length = np.float64(config["original_max_position_embeddings"])
    turn = 2 * np.pi * found  # positions per turn
    smooth = (length / turn - low) / (high - low)
    medium = 1.0 / ((1 - smooth) / (factor * found) + smooth / found)
    adjusted = np.where(turn > length / low, found * factor, found)
    between = (turn >= length / high) & (turn <= length / low)
    return np.where(between, medium, adjusted)


def yarn_temperature(factor: float) -> float:
    """YaRN's `0.1 ln(factor) + 1`, which multiplies the rotated queries and
    keys (each score by its square)."""
    return 0.1 * math.log(factor) + 1.0


def _yarn(found, rotary_dim: int, max_wavelength: float, config: dict):
    """`found` (the unscaled wavelengths) with YaRN's ramp (module doc)."""
    length = np.float64(config["original_max_position_embeddings"])

    def correction(turns):  # the pair index turning `turns` times over L
        return (
            rotary_dim
            * np.log(length / (turns * 2 * np.pi))
            / (2 * np.log(np.float64(max_wavelength)))
        )

    low, high = correction(config["beta_fast"]), correction(config["beta_slow"])
    if config["truncate"]:
        low, high = np.floor(low), np.ceil(high)
    low, high = max(low, 0.0), min(high, rotary_dim - 1.0)
    index = np.arange(rotary_dim // 2, dtype=np.float64)
    ramp = np.clip((index - low) / max(high - low, 0.001), 0.0, 1.0)
    inverse = ramp / (config["factor"] * found) + (1 - ramp) / found
    return 1.0 / inverse
