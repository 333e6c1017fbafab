"""A model's decoding step as an export target: finding its cached layers
(`build_decode_step`), threading the caches through the model
(`DecodeStep.call`), and the formats that refuse a quantized model's step
(the module docstring of `decode_step` says what it takes and returns)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import keras
import numpy as np

from keras_selfattn import _checks
from keras_selfattn.export import quantization
from keras_selfattn.export.forward.graph import model_inputs, model_output_names
from keras_selfattn.export.signature import NamedInput, Signature, vocabulary_size
from keras_selfattn.generation import cached_model, decode_check
from keras_selfattn.self_attention import SelfAttention
from keras_selfattn_runtimes import table

_ACTION = "export a decoding step of"
STEP_SIGNATURE = "decode_step"
INDEX_NAME = "cache_update_index"
CACHE_PREFIX = "cache_"
UPDATED_CACHE_PREFIX = "updated_cache_"


def _refuse(model: keras.Model, why: str) -> ValueError:
    return cached_model.refusal(model, why, _ACTION)


@dataclasses.dataclass(frozen=True)
class DecodeStep:
    """A model's decoding step: what it takes and returns, and how to run it.

    Attributes:
        model: The user's model.
        input: The model's input, with dynamic batch and time axes.
        output_name: Name of the model's output.
        layers: The SelfAttention layers, in call order.
        max_length: The caches' length: positions 0 .. max_length - 1.
    """

    model: keras.Model
    input: NamedInput
    output_name: str
    layers: tuple[SelfAttention, ...]
    max_length: int

    @property
    def cache_names(self) -> tuple[str, ...]:
        """Input names of the caches, one per layer."""
        names = cached_model.layer_names(self.model, self.layers)
        return tuple(CACHE_PREFIX + name for name in names)

    @property
    def updated_cache_names(self) -> tuple[str, ...]:
        """Output names of the updated caches, one per layer."""
        names = cached_model.layer_names(self.model, self.layers)
        return tuple(UPDATED_CACHE_PREFIX + name for name in names)

    @property
    def input_names(self) -> tuple[str, ...]:
        return (self.input.name, *self.cache_names, INDEX_NAME)

    @property
    def output_names(self) -> tuple[str, ...]:
        return (self.output_name, *self.updated_cache_names)

    def empty_caches(self, batch: int) -> dict[str, np.ndarray]:
        """Zero caches for a new sequence, keyed by input name."""
        return {
            name: keras.ops.convert_to_numpy(layer.empty_cache(batch, self.max_length))
            for name, layer in zip(self.cache_names, self.layers, strict=True)
        }

    def call(self, inputs, caches: Sequence, index):
        """Runs the step with Keras; returns (output, [updated caches])."""
        return cached_model.run_cached(self.model, self.layers, inputs, caches, index)

    def target(
        self, signature_name: str = STEP_SIGNATURE, new: int | None = None
    ) -> Signature:
        """The step as a `Signature`.

        Args:
            signature_name: Its signature. Defaults to "decode_step".
            new: The new positions a call takes, fixed (a generator's
                LiteRT "decode": 1), or None for any number.
        """
        caches = tuple(
            NamedInput(
                name,
                (None, *tuple(layer.empty_cache(1, self.max_length).shape)[1:]),
                layer.compute_dtype,
            )
            for name, layer in zip(self.cache_names, self.layers, strict=True)
        )
        step_input = NamedInput(
            self.input.name, (None, new, *self.input.shape[2:]), self.input.dtype
        )

        def function(tensors):
            inputs, *caches_in, index = tensors
            output, caches_out = self.call(inputs, caches_in, index)
            return [output, *caches_out]

        return Signature(
            self.model,
            (step_input, *caches, NamedInput(INDEX_NAME, (), "int32")),
            self.output_names,
            function,
            signature_name=signature_name,
            what="decode step",
        )


def refuse_quantized(model: keras.Model, export_format: str, what: str) -> None:
    """Raises ValueError (one line) for a quantized `model`'s decoding step or
    generator (`what`) in a format that cannot compute its quantized layers
    as Keras does (its row's `no_quantized_decoding`)."""
    row = table.BY_NAME.get(export_format)
    why = None if row is None else row.no_quantized_decoding
    if why is None:
        return
    layers = [q.layer.path for q in quantization.quantized_layers(model)]
    layers += [layer.path for layer in quantization.quantized_embeddings(model)]
    if not layers:
        return
    raise ValueError(
        f"A {what} of a quantized model exports as SavedModel or ONNX, which "
        f"compute its integer layers as Keras does: {why}. Export the float "
        f"model's {what} in {table.BY_NAME[export_format].title}, or the "
        "quantized model's forward pass. Received: export_format="
        f"{export_format!r}, quantized layers {sorted(layers)}"
    )


def build_decode_step(model: keras.Model, max_length: int) -> DecodeStep:
    """Checks the model's structure (module docstring) and builds its step.

    Args:
        model: The user's model (a subclassed one through its
            `cached_model.functional_view`: input "tokens").
        max_length: The caches' length.

    The cached decode is checked against the full forward pass on a probe
    first (`decode_check`, unless the caller waived it).

    Raises:
        TypeError: if `model` is not a keras.Model.
        ValueError: for an unsupported model or `max_length`, or a model
            whose cached decode differs from its full forward pass.
    """
    max_length = _checks.positive_int("max_length", max_length)
    if isinstance(model, keras.Model):
        model = cached_model.functional_view(model, _ACTION)
    inputs = model_inputs(model)  # named
    if len(inputs) != 1:
        raise _refuse(model, f"it has {len(inputs)} inputs")
    outputs = model_output_names(model)
    if len(outputs) != 1:
        raise _refuse(model, f"it has {len(outputs)} outputs")
    if len(inputs[0].shape) < 2:
        raise _refuse(model, "its input has no time axis (batch, time, ...)")
    layers = cached_model.cached_layers(model, _ACTION)
    layer_names = cached_model.layer_names(model, layers)
    names = [inputs[0].name, outputs[0], INDEX_NAME]
    names += [CACHE_PREFIX + name for name in layer_names]
    names += [UPDATED_CACHE_PREFIX + name for name in layer_names]
    if len(set(names)) != len(names):
        raise _refuse(model, f"its input/output names clash: {names}")
    step = DecodeStep(model, inputs[0], outputs[0], layers, max_length)
    probe = teacher_probe(step, decode_check.PROBE_LENGTH)
    decode_check.check(model, layers, probe, _ACTION)
    return step


def teacher_probe(step: DecodeStep, length: int, batch: int = 2, seed: int = 0):
    """A random input sequence `(batch, length, ...)` without padding: token
    ids in [1, vocabulary) (no 0: padding is not supported), float features
    standard normal."""
    rng = np.random.default_rng(seed)
    shape = (batch, length, *step.input.shape[2:])
    if "int" in step.input.dtype:
        values = rng.integers(1, max(vocabulary_size(step.model), 2), size=shape)
    elif step.input.dtype == "bool":
        values = np.ones(shape, bool)
    else:
        values = rng.standard_normal(shape)
    return values.astype(step.input.dtype)
