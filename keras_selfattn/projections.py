"""SelfAttention's projections as Keras `Dense` layers.

Each projection (query, key, value, gate, output) is a `Projection`, a
`keras.layers.Dense` named `{name}_dense` whose kernel keeps the layer's
`(features, heads * head_dim)` layout, so Keras quantization (`int8`, `int4`,
`float8`, `gptq`, `awq`), dtype policies, float8 training and LoRA reach them,
and keras-hub's `backbone.enable_lora` finds `query_dense` and `value_dense`.
"""

from __future__ import annotations

import keras

NAMES = ("query", "key", "value", "gate", "output")


class Projection(keras.layers.Dense):
    """A `Dense` projection of `SelfAttention` (no activation).

    It quantizes like `Dense`. Its owner may fill its weights from a file
    saved before the projections were layers (the owner's own flat
    variables); then the projection's own, absent, entry is skipped once.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.filled_by_owner = False

    def quantize(self, mode=None, type_check=True, config=None):
        if type_check and type(self) is not Projection:
            raise self._not_implemented_error(self.quantize)
        super().quantize(mode, type_check=False, config=config)

    def load_own_variables(self, store):
        if self.filled_by_owner:
            self.filled_by_owner = False
            if not len(store.keys()):
                return
        super().load_own_variables(store)


def fresh_initializer(initializer, offset: int):
    """A new initializer instance for each weight.

    Keras 3 initializers are stateless: one instance (seeded or not) gives the
    same values on every call, which would make the query, key and value
    kernels identical. An explicit integer seed is offset per weight (by the
    number of weights created before it), so seeded layers stay reproducible,
    with the values of the layer's earlier versions, and their kernels differ.
    """
    if initializer is None:  # Keras's own default for the weight
        return None
    config = initializer.get_config()
    if isinstance(config.get("seed"), int):
        config["seed"] += offset
    return initializer.__class__.from_config(config)


def quantization_state(projection: Projection) -> dict | None:
    """What rebuilding a quantized projection needs: its dtype policy and
    quantization config, serialized; None for a float projection."""
    if projection.quantization_mode is None:
        return None
    return {
        "dtype": keras.dtype_policies.serialize(projection.dtype_policy),
        "quantization_config": keras.saving.serialize_keras_object(
            projection.quantization_config
        ),
    }


def check_quantization_states(value) -> dict | None:
    """The `quantized_projections` argument, checked: None, or a dict from
    projection names to `quantization_state` dicts."""
    if value is None:
        return None
    if not isinstance(value, dict) or not all(
        name in NAMES and isinstance(state, dict) and "dtype" in state
        for name, state in value.items()
    ):
        raise ValueError(
            "`quantized_projections` maps projection names "
            f"{NAMES} to dicts with a 'dtype' (what `get_config` of a "
            f"quantized layer writes). Received: quantized_projections={value!r}"
        )
    return value


def quantization_kwargs(state: dict | None) -> dict:
    """`Dense` constructor arguments that rebuild a quantized projection."""
    if state is None:
        return {}
    return {
        "dtype": keras.dtype_policies.deserialize(state["dtype"]),
        "quantization_config": keras.saving.deserialize_keras_object(
            state.get("quantization_config")
        ),
    }


def weight_property(name: str, kind: str) -> property:
    """`layer.{name}_{kind}`: the `kind` ("kernel" or "bias") of the `name`
    projection, None without one (the weight's name before the projections
    were layers)."""

    def get(layer):
        projection = getattr(layer, f"{name}_dense", None)
        return None if projection is None else getattr(projection, kind)

    return property(get, doc=f"The {name} projection's {kind} (None without it).")
