"""A layer's config, to copy it (`convert`) and to save its converted copy,
also where the class's own `get_config` fails.

keras-hub 0.32's `LlamaTransformerDecoder.get_config` reads an attribute
its `__init__` never sets (`rope_scaling_factor`; it stores
`rope_position_scaling_factor`), so neither keras-hub's `clone_model` nor a
copy from the config works. Where `get_config` raises, the config is read
off the layer: each `__init__` argument from the attribute of its name
(or `_` and its name), as keras-hub's layers store them.
"""

from __future__ import annotations

import inspect

import keras


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


def config_of(layer, cls: type | None = None) -> dict:
    """`cls.get_config(layer)` (`cls`: the layer's class), or where it
    raises, the config read off the layer's attributes; the original error
    where neither works."""
    cls = cls or type(layer)
    try:
        return cls.get_config(layer)
    except Exception:  # the class's own code: any error
        config = _from_attributes(layer, cls)
        if config is None:
            raise
        return config


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
