"""A model's decoding step as an export target: finding its cached layers
(`build_decode_step`), threading the caches through the model
(`DecodeStep.call`), and the formats that refuse a quantized model's step
(the module docstring of `decode_step` says what it takes and returns)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import keras
import numpy as np

from keras_selfattn import _checks
from keras_selfattn.attention import cache as cache_lib
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
        reading: The model read for decoding (`cached_model.read`).
        input: The model's input, with dynamic batch and time axes.
        output_name: Name of the model's output.
        max_length: The caches' length: positions 0 .. max_length - 1.
    """

    reading: cached_model.Reading
    input: NamedInput
    output_name: str
    max_length: int

    @property
    def model(self) -> keras.Model:
        """The model decoding runs (`Reading.model`)."""
        return self.reading.model

    @property
    def layers(self) -> tuple[SelfAttention, ...]:
        """The SelfAttention layers, in call order."""
        return self.reading.layers

    @property
    def cache_names(self) -> tuple[str, ...]:
        """Input names of the caches, one per layer."""
        return tuple(CACHE_PREFIX + name for name in self.reading.names)

    @property
    def updated_cache_names(self) -> tuple[str, ...]:
        """Output names of the updated caches, one per layer."""
        return tuple(UPDATED_CACHE_PREFIX + name for name in self.reading.names)

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

    def call(self, inputs, caches: Sequence, index, cache_class: type | None = None):
        """Runs the step with Keras on cache tensors; returns (output,
        [updated cache tensors]).

        Args:
            inputs, caches, index: The step's inputs.
            cache_class: The class of its caches (`attention.cache`), None:
                `Cache` (a format asks for its own: `Signature.with_caches`).
        """
        cache_class = cache_class or cache_lib.Cache
        output, updated = cached_model.run_cached(
            self.model, self.layers, inputs, [cache_class(c) for c in caches], index
        )
        return output, [cache.tensor for cache in updated]

    def target(
        self,
        signature_name: str = STEP_SIGNATURE,
        new: int | None = None,
        cache_class: type | None = None,
    ) -> Signature:
        """The step as a `Signature`.

        Args:
            signature_name: Its signature. Defaults to "decode_step".
            new: The new positions a call takes, fixed (a generator's
                LiteRT "decode": 1), or None for any number.
            cache_class: The class of its caches, None: `Cache`
                (`Signature.with_caches` builds it with a format's own).
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

        return Signature(
            self.model,
            (step_input, *caches, NamedInput(INDEX_NAME, (), "int32")),
            self.output_names,
            StepFunction(self, cache_class),
            signature_name=signature_name,
            what="decode step",
            cached_as=lambda cls: self.target(signature_name, new, cls),
        )


@dataclasses.dataclass(frozen=True)
class StepFunction:
    """A `DecodeStep` as a `Signature`'s function: its inputs as a list in,
    its outputs as a list out.

    Attributes:
        step: The step.
        cache_class: The class of its caches, None: `Cache`.
    """

    step: DecodeStep
    cache_class: type | None = None

    def __call__(self, tensors: Sequence) -> list:
        inputs, *caches_in, index = tensors
        output, caches_out = self.step.call(inputs, caches_in, index, self.cache_class)
        return [output, *caches_out]


def refuse_quantized(
    read: Callable[[], cached_model.Reading], export_format: str, what: str
) -> None:
    """Raises ValueError (one line) for a quantized model's decoding step or
    generator (`what`) in a format that cannot compute its quantized layers
    as Keras does (its row's `no_quantized_decoding`); `read` reads the
    model, only for such a format."""
    row = table.BY_NAME.get(export_format)
    why = None if row is None else row.no_quantized_decoding
    if why is None:
        return
    every = read().every
    layers = [q.layer.path for q in map(quantization.describe, every) if q]
    layers += [
        layer.path
        for layer in every
        if isinstance(layer, keras.layers.Embedding)
        and layer.quantization_mode == "int8"
    ]
    if not layers:
        return
    raise ValueError(
        f"A {what} of a quantized model exports as SavedModel or ONNX, which "
        f"compute its integer layers as Keras does: {why}. Export the float "
        f"model's {what} in {table.BY_NAME[export_format].title}, or the "
        "quantized model's forward pass. Received: export_format="
        f"{export_format!r}, quantized layers {sorted(layers)}"
    )


def build_decode_step(
    model: keras.Model,
    max_length: int,
    reading: cached_model.Reading | None = None,
) -> DecodeStep:
    """Checks the model's structure (module docstring) and builds its step.

    Args:
        model: The user's model (a subclassed one through its
            `cached_model.functional_view`: input "tokens").
        max_length: The caches' length.
        reading: The model's reading where the caller has one (a
            generator's), else read here (`cached_model.read`).

    The cached decode is checked against the full forward pass on a probe
    first (`decode_check`, unless the caller waived it).

    Raises:
        TypeError: if `model` is not a keras.Model.
        ValueError: for an unsupported model or `max_length`, or a model
            whose cached decode differs from its full forward pass.
    """
    max_length = _checks.positive_int("max_length", max_length)
    if reading is not None:
        model = reading.model
    elif isinstance(model, keras.Model):
        model = cached_model.functional_view(model, _ACTION)
    inputs = model_inputs(model)  # named
    if len(inputs) != 1:
        raise _refuse(model, f"it has {len(inputs)} inputs")
    outputs = model_output_names(model)
    if len(outputs) != 1:
        raise _refuse(model, f"it has {len(outputs)} outputs")
    if len(inputs[0].shape) < 2:
        raise _refuse(model, "its input has no time axis (batch, time, ...)")
    if reading is None:
        reading = read_model(model)
    names = [inputs[0].name, outputs[0], INDEX_NAME]
    names += [CACHE_PREFIX + name for name in reading.names]
    names += [UPDATED_CACHE_PREFIX + name for name in reading.names]
    if len(set(names)) != len(names):
        raise _refuse(model, f"its input/output names clash: {names}")
    step = DecodeStep(reading, inputs[0], outputs[0], max_length)
    probe = teacher_probe(step, decode_check.PROBE_LENGTH)
    decode_check.check(reading, probe, _ACTION)
    return step


def read_model(model: keras.Model) -> cached_model.Reading:
    """`model` read for its decoding step (`cached_model.read`; a
    subclassed one through its `cached_model.functional_view`).

    Raises:
        ValueError: for a structure that cannot decode (one line).
    """
    return cached_model.read(cached_model.functional_view(model, _ACTION), _ACTION)


def teacher_probe(step: DecodeStep, length: int, batch: int = 2, seed: int = 0):
    """A random input sequence `(batch, length, ...)` without padding: token
    ids in [1, vocabulary) (no 0: padding is not supported), float features
    standard normal."""
    rng = np.random.default_rng(seed)
    shape = (batch, length, *step.input.shape[2:])
    if "int" in step.input.dtype:
        vocabulary = vocabulary_size(step.reading.every)
        values = rng.integers(1, max(vocabulary, 2), size=shape)
    elif step.input.dtype == "bool":
        values = np.ones(shape, bool)
    else:
        values = rng.standard_normal(shape)
    return values.astype(step.input.dtype)
