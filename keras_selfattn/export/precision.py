"""Mixed-precision models in exports: float32 by default, half where asked.

A model built or trained under `mixed_bfloat16` or `mixed_float16` keeps
float32 variables and computes in half precision. Its exports compute in
float32 by default, from those same variables: `float32_view` is a clone
whose every layer computes in float32 (a quantized layer keeps its mode:
`int8_from_mixed_bfloat16` becomes `int8_from_float32`) holding the model's
weights. The export and its check are made from that view; the check's
report also gives the artifact's error against the model's own
half-precision outputs. `PRECISIONS` names the choices exporters take:
"float32", or "model" for the model's own compute dtype where a runtime
runs it, checked with `half_tolerance`. `float64_view`, the same clone in
float64, is the checks' second reference (`parity.exact`).
"""

from __future__ import annotations

import keras
import numpy as np

from keras_selfattn._model_layers import every_layer

# The exporters' `precision`: float32 (the default), or the model's own.
FLOAT32 = "float32"
MODEL = "model"
PRECISIONS = (FLOAT32, MODEL)
HALF = ("float16", "bfloat16")
# Each half dtype's machine epsilon (10 and 7 fraction bits).
EPSILON = {"float16": 2.0**-10, "bfloat16": 2.0**-7}
# A half-precision artifact passes within this many units of its dtype's
# epsilon times the largest output magnitude (plus one, for outputs near 0):
# several roundings of that size compound through a few layers.
HALF_EPSILONS = 8


def half_dtype(model: keras.Model) -> str | None:
    """The half-precision compute dtype of `model`'s layers, or None.

    Raises:
        ValueError: if layers compute in both float16 and bfloat16.
    """
    found = {
        layer.compute_dtype
        for layer in every_layer(model)
        if getattr(layer, "compute_dtype", None) in HALF
    }
    if len(found) > 1:
        raise ValueError(
            f"Model {model.name!r} computes in both {sorted(found)}: export it "
            "from one dtype policy"
        )
    return found.pop() if found else None


def _policies(config, dtype: str):
    """`config` with every dtype policy's float source made `dtype`."""
    if isinstance(config, list):
        return [_policies(item, dtype) for item in config]
    if not isinstance(config, dict):
        return config
    class_name = config.get("class_name", "")
    inner = config.get("config")
    if class_name.endswith("DTypePolicy") and isinstance(inner, dict):
        inner = dict(inner)
        if "source_name" in inner:
            inner["source_name"] = dtype
        elif "name" in inner:
            inner["name"] = dtype
        return {**config, "config": inner}
    return {key: _policies(value, dtype) for key, value in config.items()}


def _view(model: keras.Model, dtype: str) -> keras.Model:
    """A clone of `model` whose every layer computes in `dtype`, with
    `model`'s weights."""

    def clone(layer):
        if not isinstance(layer, keras.layers.Layer) or isinstance(
            layer, keras.layers.InputLayer
        ):
            return layer
        config = _policies(layer.get_config(), dtype)
        if isinstance(config.get("dtype"), str) and config["dtype"] in (
            "mixed_bfloat16",
            "mixed_float16",
            "float32",
            *HALF,
        ):
            config["dtype"] = dtype
        return layer.__class__.from_config(config)

    view = keras.models.clone_model(model, clone_function=clone, recursive=True)
    view.set_weights(model.get_weights())
    return view


def float32_view(model: keras.Model) -> keras.Model:
    """A clone of `model` computing in float32, with `model`'s weights."""
    return _view(model, "float32")


def float64_view(model: keras.Model) -> keras.Model:
    """A clone of a float32 `model` computing in float64, with its weights
    (the float64 reference of the export checks, `parity.exact`; on JAX,
    build and call it within `jax.enable_x64`)."""
    return _view(model, "float64")


def check_precision(precision: object) -> str:
    """Returns `precision` if it is one of `PRECISIONS`.

    Raises:
        ValueError: naming the argument and the value otherwise.
    """
    if precision not in PRECISIONS:
        raise ValueError(
            f"`precision` must be one of {PRECISIONS}. "
            f"Received: precision={precision!r}"
        )
    return precision


def half_tolerance(dtype: str, reference: np.ndarray) -> float:
    """The absolute tolerance of a `dtype` artifact against a reference:
    `HALF_EPSILONS` units of the dtype's epsilon times (max |reference| + 1)."""
    magnitude = float(np.abs(reference).max(initial=0.0))
    return HALF_EPSILONS * EPSILON[dtype] * (magnitude + 1)
