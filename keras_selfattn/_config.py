"""SelfAttention's configuration: checked, dimensions resolved, serialized.

The arguments are checked and normalised in one function (`arguments`), the
dimensions resolved once at build (`dims`), and written back by `serialize`.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import keras
from keras import constraints, initializers, regularizers

from keras_selfattn import _checks
from keras_selfattn import projections as projections_lib
from keras_selfattn.attention import rope_frequencies, score_mods

_optional_int = functools.partial(_checks.positive_int, allow_none=True)
_optional_float = functools.partial(_checks.positive_float, allow_none=True)


def _optional_bool(name: str, value):
    return None if value is None else _checks.boolean(name, value)


def _position_bias(name: str, value):
    if value is not None and value not in score_mods.POSITION_BIASES:
        raise ValueError(
            f"`{name}` must be None, 'alibi' or 'relative'. Received: {name}={value!r}"
        )
    return value


def _num_buckets(name: str, value):
    value = _checks.positive_int(name, value)
    if value < 2:
        raise ValueError(
            f"`{name}` must be an integer >= 2 (T5's buckets: half for exact "
            f"distances, half logarithmic). Received: {name}={value!r}"
        )
    return value


# Each argument and its check, in the order they are checked.
_CHECKS = {
    "num_heads": _checks.positive_int,
    "key_dim": _optional_int,
    "value_dim": _optional_int,
    "output_dim": _optional_int,
    "use_bias": _checks.boolean,
    "scale": _optional_float,
    "causal": _checks.boolean,
    "sliding_window": _optional_int,
    "chunk_size": _optional_int,
    "dropout": _checks.rate,
    "seed": _checks.optional_int,
    "flash_attention": _optional_bool,
    "num_key_value_heads": _optional_int,
    "use_gate": _checks.boolean,
    "rope_max_wavelength": _optional_float,
    "rope_scaling_factor": _checks.positive_float,
    "rope_partial_fraction": rope_frequencies.check_fraction,
    "rope_frequency_scaling": rope_frequencies.check_scaling,
    "position_bias": _position_bias,
    "alibi_bias_max": _checks.positive_float,
    "alibi_before_scale": _checks.boolean,
    "relative_attention_num_buckets": _num_buckets,
    "relative_attention_max_distance": _checks.positive_int,
    "use_sinks": _checks.boolean,
    "logit_soft_cap": _optional_float,
    "use_query_key_norm": _checks.boolean,
    "query_key_norm_epsilon": _checks.positive_float,
}
# Keras objects, fetched with `module.get` and written with `module.serialize`.
_OBJECTS = {
    "kernel_initializer": initializers,
    "bias_initializer": initializers,
    "kernel_regularizer": regularizers,
    "bias_regularizer": regularizers,
    "kernel_constraint": constraints,
    "bias_constraint": constraints,
}


def check_rope_key_dim(rope_max_wavelength, key_dim: int) -> None:
    """Raises ValueError if rotary embedding is on and `key_dim` is odd."""
    if rope_max_wavelength is not None and key_dim % 2:
        raise ValueError(
            "Rotary position embedding (rope_max_wavelength="
            f"{rope_max_wavelength}) rotates pairs of query and key "
            f"features, so `key_dim` must be even. Received: key_dim={key_dim}"
        )


def arguments(**arguments) -> dict:
    """The layer's arguments, checked and normalised (ValueError naming the
    argument and the value); the Keras objects fetched with `module.get`."""
    config = {name: check(name, arguments[name]) for name, check in _CHECKS.items()}
    kv_heads = config["num_key_value_heads"]
    if kv_heads is not None and config["num_heads"] % kv_heads:
        raise ValueError(
            "`num_key_value_heads` must divide `num_heads` (each key and "
            "value head serves a group of query heads). Received: "
            f"num_key_value_heads={kv_heads}, num_heads={config['num_heads']}"
        )
    if config["key_dim"] is not None:
        check_rope_key_dim(config["rope_max_wavelength"], config["key_dim"])
        rope_frequencies.check_rotary_dim(
            config["rope_max_wavelength"],
            config["key_dim"],
            config["rope_partial_fraction"],
            config["rope_frequency_scaling"],
        )
    if config["position_bias"] == "relative":
        _check_relative_buckets(config)
    for name, module in _OBJECTS.items():
        config[name] = _checks.finite_config(name, module.get(arguments[name]))
    config["quantized_projections"] = projections_lib.check_quantization_states(
        arguments["quantized_projections"]
    )
    return config


def _check_relative_buckets(config: dict) -> None:
    """Raises ValueError unless T5's buckets have, in each direction, at least
    one exact distance, and `relative_attention_max_distance` lies past them
    (T5's logarithmic buckets span the distances between the two)."""
    buckets = config["relative_attention_num_buckets"]
    max_distance = config["relative_attention_max_distance"]
    per_direction = buckets if config["causal"] else buckets // 2
    exact = per_direction // 2
    if exact < 1 or max_distance <= exact:
        direction = "one direction (causal)" if config["causal"] else "two directions"
        raise ValueError(
            "position_bias='relative' splits relative_attention_num_buckets "
            f"over {direction}, half of each for exact distances, the rest "
            "for distances up to relative_attention_max_distance: it needs "
            f"at least {2 if config['causal'] else 4} buckets and a max "
            f"distance above the exact ones ({exact}). Received: "
            f"relative_attention_num_buckets={buckets}, "
            f"relative_attention_max_distance={max_distance}, "
            f"causal={config['causal']}"
        )


def serialize(layer) -> dict:
    """The layer's arguments as `get_config` writes them (all but
    `quantized_projections` and the base layer's)."""
    config = {name: getattr(layer, name) for name in _CHECKS}
    for name, module in {**_OBJECTS, "activity_regularizer": regularizers}.items():
        config[name] = module.serialize(getattr(layer, name))
    return config


@dataclasses.dataclass(frozen=True)
class Dims:
    """A built layer's sizes: features in, head sizes, output width, scale."""

    input_dim: int
    key_dim: int
    value_dim: int
    output_width: int
    scale: float


def dims(layer, input_dim: int) -> Dims:
    """The sizes of `layer` (its arguments) for inputs of `input_dim` features."""
    key_dim = layer.key_dim
    if key_dim is None:
        if input_dim % layer.num_heads:
            raise ValueError(
                "`key_dim` is None, so it defaults to features // num_heads, "
                f"but features={input_dim} is not divisible by "
                f"num_heads={layer.num_heads}. Pass key_dim explicitly. "
                f"Received: key_dim=None, num_heads={layer.num_heads}"
            )
        key_dim = input_dim // layer.num_heads
    check_rope_key_dim(layer.rope_max_wavelength, key_dim)
    rope_frequencies.check_rotary_dim(
        layer.rope_max_wavelength,
        key_dim,
        layer.rope_partial_fraction,
        layer.rope_frequency_scaling,
    )
    value_dim = layer.value_dim if layer.value_dim is not None else key_dim
    width = layer.output_dim or layer.num_heads * value_dim
    scale = layer.scale if layer.scale is not None else 1.0 / math.sqrt(key_dim)
    return Dims(input_dim, key_dim, value_dim, width, scale)


def supports_jit(layer) -> bool:
    """False where `fit` must run without jit_compile: on TensorFlow, causal
    blocks without a window read key ranges of growing length, which XLA
    cannot compile."""
    return not (
        keras.backend.backend() == "tensorflow"
        and layer.chunk_size is not None
        and layer.causal
        and layer.sliding_window is None
    )
