"""A layer's config, to copy it (`convert`) and to save its converted copy,
also where the class's own `get_config` fails.

keras-hub 0.32's `LlamaTransformerDecoder.get_config` reads an attribute
its `__init__` never sets (`rope_scaling_factor`; it stores
`rope_position_scaling_factor`), so neither keras-hub's `clone_model` nor a
copy from the config works. Where `get_config` raises, the config is read
off the layer: each `__init__` argument from the attribute of its name
(or `_` and its name), as keras-hub's layers store them; where it leaves
out an argument (Qwen 3's decoder), that argument is read so too if it is
a number, a string or None.
"""

from __future__ import annotations

import inspect

import keras

_PLAIN = (bool, int, float, str)
_VARIADIC = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


def _from_attributes(layer, cls: type) -> dict | None:
    """The config of `__init__`'s arguments read off `layer`, or None where
    a required one is not an attribute."""
    config = keras.layers.Layer.get_config(layer)  # name, trainable, dtype
    for name, parameter in inspect.signature(cls.__init__).parameters.items():
        if name == "self" or parameter.kind in (
            parameter.VAR_POSITIONAL,
            parameter.VAR_KEYWORD,
        ):
            continue
        held = next((a for a in (name, f"_{name}") if hasattr(layer, a)), None)
        if held is None:
            if parameter.default is parameter.empty:
                return None
            continue
        config[name] = keras.saving.serialize_keras_object(getattr(layer, held))
    return config


def _build_only(cls: type) -> set:
    """`build`'s arguments that `__init__` does not take (Keras's base layer
    takes `input_shape`): GPT-NeoX's decoder writes its
    `decoder_sequence_shape` into its config, which its `__init__` rejects."""
    taken = {*inspect.signature(cls.__init__).parameters, "self", "input_shape"}
    return set(inspect.signature(cls.build).parameters) - taken


def config_of(layer, cls: type | None = None) -> dict:
    """`cls.get_config(layer)` (`cls`: the layer's class) with the plain
    arguments it leaves out, or where it raises, the config read off the
    layer's attributes; the original error where neither works."""
    cls = cls or type(layer)
    try:
        config = cls.get_config(layer)
        for name in _build_only(cls):
            config.pop(name, None)
    except Exception:  # the class's own code: any error
        config = _from_attributes(layer, cls)
        if config is None:
            raise
        return config
    return {**_left_out(layer, cls, config), **config}


def _left_out(layer, cls: type, config: dict) -> dict:
    """The plain `__init__` arguments `config` leaves out (Qwen 3's decoder:
    `head_dim`, `sliding_window_size`), read off `layer` where they differ
    from their defaults."""
    found = {}
    for name, parameter in inspect.signature(cls.__init__).parameters.items():
        if name == "self" or name in config or parameter.kind in _VARIADIC:
            continue
        held = next((a for a in (name, f"_{name}") if hasattr(layer, a)), None)
        value = None if held is None else getattr(layer, held)
        plain = value is None or isinstance(value, _PLAIN)
        if held is not None and plain and value != parameter.default:
            found[name] = value
    return found


def copy(layer: keras.layers.Layer) -> keras.layers.Layer:
    """A new layer of `layer`'s class from its config (its weights not
    copied); ValueError in one line where the class cannot be rebuilt."""
    try:
        return layer.__class__.from_config(config_of(layer))
    except Exception as error:  # the class's own code: any error
        reason = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise ValueError(
            f"Cannot convert: {type(layer).__name__} '{layer.name}' does not "
            f"rebuild from its own get_config() ({type(error).__name__}: "
            f"{reason}), so it cannot be copied. Received: layer={layer.name!r}"
        ) from None
