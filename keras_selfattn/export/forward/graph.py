"""What an exported model exposes: named inputs, named outputs, the graph.

Exporters and `verify` share one `Endpoint`, so an export and its check
always agree on names, order, dtypes and the optional attention outputs.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping

import keras
import numpy as np

from keras_selfattn.export import precision, quantization
from keras_selfattn.export.signature import NamedInput, Signature
from keras_selfattn.self_attention import SelfAttention

# Names Keras gives an unnamed `keras.Input` (Keras 3): input_layer, input_layer_3,
# keras_tensor_12. Served or ONNX inputs with such names would break clients the
# next time the model is rebuilt, so they are refused.
_AUTO_NAME = re.compile(r"^(input_layer|keras_tensor)(_[0-9]+)?$")

DEFAULT_ATTENTION_OUTPUT = "attention_weights"


@dataclasses.dataclass(frozen=True)
class Endpoint:
    """A Keras model taking a list of inputs and returning a list of outputs.

    Attributes:
        source: The model the export computes: the user's model, or its
            float32 view when the user's computes in half precision
            (`precision.float32_view`); the checks' reference.
        model: Functional model with the same layers (and weights) as
            `source`, plus the requested attention weights as extra outputs.
        inputs: The named inputs, in `model`'s order.
        output_names: Names of `model`'s outputs, in order; the first
            `num_source_outputs` are `source`'s own outputs.
        num_source_outputs: How many outputs come from `source` itself.
        original: The user's half-precision model when `source` is its
            float32 view, else None.
        half: The half dtype the export keeps (`precision="model"`), else
            None.
    """

    source: keras.Model
    model: keras.Model
    inputs: tuple[NamedInput, ...]
    output_names: tuple[str, ...]
    num_source_outputs: int
    original: keras.Model | None = None
    half: str | None = None

    def target(self) -> Signature:
        """The `Signature`: `model` on a list of inputs, flat outputs."""
        return Signature(
            self.model,
            self.inputs,
            self.output_names,
            lambda tensors: keras.tree.flatten(self.model(tensors, training=False)),
            quantized=quantization.quantized_layers(self.model),
            embeddings=quantization.quantized_embeddings(self.model),
        )


class _AttentionProbe(keras.layers.Layer):
    """Calls a SelfAttention layer (sharing its weights) for output and weights.

    A wrapper rather than a second call of the layer itself: Keras checks a
    functional graph with each layer's first call, which returns one tensor.
    """

    def __init__(self, attention: SelfAttention, **kwargs):
        super().__init__(name=f"{attention.name}_probe", **kwargs)
        self.attention = attention
        self.supports_masking = True

    def call(self, inputs, mask=None, **kwargs):
        return self.attention(inputs, mask=mask, return_attention_scores=True, **kwargs)

    def compute_mask(self, inputs, mask=None):
        return [mask, None]

    def compute_output_spec(self, inputs, mask=None, **kwargs):
        return self.attention.compute_output_spec(
            inputs, mask=mask, return_attention_scores=True, **kwargs
        )


def _check_model(model: object) -> None:
    if not isinstance(model, keras.Model):
        raise TypeError(
            "`model` must be a keras.Model. "
            f"Received: model of type {type(model).__name__}"
        )
    try:
        inputs = model.inputs
    except (AttributeError, ValueError):
        inputs = None
    if not inputs:
        raise ValueError(
            "`model` must be a Functional or Sequential model built on "
            "keras.Input (subclassed models have no named inputs to export). "
            f"Received: model={model.name!r}"
        )


def model_inputs(model: keras.Model) -> tuple[NamedInput, ...]:
    """The model's inputs as `NamedInput`s with a dynamic batch dimension.

    Raises:
        ValueError: for an auto-generated or duplicate input name.
    """
    _check_model(model)
    specs = []
    for tensor in model.inputs:
        if _AUTO_NAME.match(tensor.name):
            raise ValueError(
                f"Model input {tensor.name!r} has a name Keras generated; "
                "exported signatures are keyed by input name, so name every "
                'input, e.g. keras.Input(shape=..., name="tokens"). '
                f"Received: model={model.name!r}"
            )
        shape = (None,) + tuple(tensor.shape[1:])
        specs.append(NamedInput(tensor.name, shape, str(tensor.dtype)))
    names = [spec.name for spec in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"Model input names must be unique. Received: {names}")
    return tuple(specs)


def _structure(model: keras.Model, which: str):
    """`model.input` / `model.output`; a Sequential model has one of each."""
    if isinstance(model, keras.Sequential):
        return getattr(model, f"{which}s")[0]
    return getattr(model, which)


def model_output_names(model: keras.Model) -> list[str]:
    """The outputs' names in `keras.tree.flatten` order: a dict's keys, else
    the names Keras gives, made unique (the second output of one layer,
    such as its attention scores, is "<layer>_1")."""
    if isinstance(_structure(model, "output"), dict):
        return sorted(model.output)  # keras.tree.flatten's order
    names: list[str] = []
    for name in keras.Model(model.inputs, model.outputs).output_names:
        unique, count = name, 0
        while unique in names:
            count += 1
            unique = f"{name}_{count}"
        names.append(unique)
    return names


def _attention_mapping(model, attention_outputs) -> dict[str, str]:
    if attention_outputs is None:
        return {}
    if isinstance(attention_outputs, str):
        attention_outputs = {attention_outputs: DEFAULT_ATTENTION_OUTPUT}
    if not isinstance(attention_outputs, Mapping):
        raise TypeError(
            "`attention_outputs` must be None, a layer name, or a dict "
            "{layer name: output name}. "
            f"Received: attention_outputs={attention_outputs!r}"
        )
    available = [
        layer.name for layer in model.layers if isinstance(layer, SelfAttention)
    ]
    for layer_name in attention_outputs:
        if layer_name not in available:
            raise ValueError(
                f"`attention_outputs` names {layer_name!r}, which is not a "
                f"SelfAttention layer of the model. Available: {available}"
            )
    return dict(attention_outputs)


def build_endpoint(
    model: keras.Model,
    attention_outputs: str | Mapping[str, str] | None = None,
    export_precision: str = precision.FLOAT32,
) -> Endpoint:
    """Builds the `Endpoint` of `model`.

    Args:
        model: A Functional or Sequential model with named `keras.Input`s.
        attention_outputs: None, the name of a top-level SelfAttention layer
            (its weights become the output "attention_weights"), or a dict
            {layer name: output name}.
        export_precision: "float32" (a half-precision model is exported as
            its float32 view) or "model" (its own compute dtype).

    Returns:
        The `Endpoint`.
    """
    export_precision = precision.check_precision(export_precision)
    inputs = model_inputs(model)
    half = precision.half_dtype(model)
    original = None
    if half is not None and export_precision == precision.FLOAT32:
        original, model, half = model, precision.float32_view(model), None
    names = model_output_names(model)
    mapping = _attention_mapping(model, attention_outputs)
    graph = keras.Model(model.inputs, keras.tree.flatten(model.outputs))
    if mapping:
        captured = {}

        def call_function(layer, *args, **kwargs):
            if layer.name not in mapping:
                return layer(*args, **kwargs)
            output, weights = _AttentionProbe(layer)(*args, **kwargs)
            captured[mapping[layer.name]] = weights
            return output

        clone = keras.models.clone_model(
            graph, clone_function=lambda layer: layer, call_function=call_function
        )
        extra = [captured[output] for output in mapping.values()]
        graph = keras.Model(clone.inputs, clone.outputs + extra)
    all_names = names + list(mapping.values())
    if len(set(all_names)) != len(all_names):
        raise ValueError(
            f"`attention_outputs` must name outputs the model does not have. "
            f"Received: attention_outputs={attention_outputs!r} (the model's "
            f"outputs: {names})"
        )
    return Endpoint(model, graph, inputs, tuple(all_names), len(names), original, half)


def keras_reference(
    endpoint: Endpoint,
    arrays: Mapping[str, np.ndarray],
    source: keras.Model | None = None,
) -> dict[str, np.ndarray]:
    """Keras's outputs, by name: the model itself for its own outputs.

    Attention outputs, which the model does not return, come from
    `endpoint.model`.

    Args:
        endpoint: The endpoint.
        arrays: Inputs by name.
        source: The model to run (default `endpoint.source`); another one
            (the user's half-precision model) gives only its own outputs.
    """
    model = endpoint.source if source is None else source
    structured = keras.tree.map_structure(
        lambda t: arrays[t.name], _structure(model, "input")
    )
    flat = keras.tree.flatten(model(structured, training=False))
    result = {
        name: keras.ops.convert_to_numpy(value).astype("float32")
        if str(value.dtype) in precision.HALF
        else keras.ops.convert_to_numpy(value)
        for name, value in zip(endpoint.output_names, flat, strict=False)
    }
    extra = len(endpoint.output_names) > endpoint.num_source_outputs
    if extra and source is None:
        for name, value in endpoint.target().call_named(arrays).items():
            result.setdefault(name, keras.ops.convert_to_numpy(value))
    return result
