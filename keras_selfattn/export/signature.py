"""What an export writes: named inputs, named outputs, and the callable.

A `Signature` is the one description every exporter and check
accepts: the forward `Endpoint` and the decoding step both provide one
(`Endpoint.target()`, `DecodeStep.target()`), so staging, conversion and
verification never depend on which of the two they export. A quantized
model's target carries its quantized layers (`quantized`); each format
traces them in its own form (`traced`, see `quantization`). Checks and
TF Serving's warmup run a signature on deterministic `example_inputs`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

import keras
import numpy as np

from keras_selfattn._model_layers import every_layer
from keras_selfattn.export import quantization, quantized_kernels

# Names of dynamic axes in exports: axis 0 is the batch, every other dynamic
# axis the one sequence the model attends over (tokens, masks and
# `(time, time)` attention weights all have its length).
BATCH_AXIS = "batch"
TIME_AXIS = "time"
# The signature TF Serving (and LiteRT) calls when a request names none.
SERVING_SIGNATURE = "serving_default"


@dataclasses.dataclass(frozen=True)
class NamedInput:
    """One named input: `shape` has None for dynamic dims."""

    name: str
    shape: tuple[int | None, ...]
    dtype: str

    def axis_names(self) -> tuple[int | str, ...]:
        """`shape` with dynamic dims named `BATCH_AXIS` (axis 0) or `TIME_AXIS`."""
        return tuple(
            (BATCH_AXIS if index == 0 else TIME_AXIS) if dim is None else dim
            for index, dim in enumerate(self.shape)
        )


@dataclasses.dataclass(frozen=True)
class Signature:
    """A callable over named tensors, as an export exposes it.

    Attributes:
        model: The Keras model whose weights the callable uses (tracked by
            the exporters).
        inputs: The named inputs, in the callable's order.
        output_names: The callable's outputs, in order.
        function: Takes the inputs as a list (in `inputs` order) and returns
            the outputs as a list (in `output_names` order).
        signature_name: The SavedModel signature (and LiteRT signature) name.
        what: How errors name it ("model", "decode step").
        quantized: The model's quantized `Dense` layers (empty for a float
            model), from `quantization.quantized_layers`.
        embeddings: Its int8 `Embedding` layers
            (`quantization.quantized_embeddings`).
        examples: Builds valid example inputs `(batch, time, seed) -> {name:
            array}` for targets whose inputs are not a model's (a
            generator's controls); None: `example_inputs`' random
            ones.
        extra_signatures: Builds more targets over the same model that a
            LiteRT file holds beside this one, each under its own
            `signature_name` (a generator's "prefill" and "decode"); the
            other formats write this target alone. Called only when a LiteRT
            file is written, so a model whose extra targets cannot be built
            still exports elsewhere. None: this target alone.
        cached_as: Builds this target with its decoding caches of another
            class (`attention.cache`: a format's own write); None: a target
            without caches (`with_caches`).
        meanwhile: Work of the exporting process's own (the check's Keras
            references, `export.generator`) that a format whose conversion
            runs in another process does while it waits for it (LiteRT's
            converter; off TensorFlow, the TensorFlow process writing a
            generator); it must not raise, and may be called again. None:
            nothing.
    """

    model: keras.Model
    inputs: tuple[NamedInput, ...]
    output_names: tuple[str, ...]
    function: Callable[[Sequence], Sequence]
    signature_name: str = SERVING_SIGNATURE
    what: str = "model"
    quantized: tuple[quantized_kernels.QuantizedDense, ...] = ()
    embeddings: tuple[keras.layers.Embedding, ...] = ()
    examples: Callable[[int, int, int], dict] | None = None
    extra_signatures: Callable[[], tuple[Signature, ...]] | None = None
    cached_as: Callable[[type], Signature] | None = None
    meanwhile: Callable[[], None] | None = None

    def with_caches(self, cache_class: type) -> Signature:
        """This target with its decoding caches of `cache_class`, the write
        a format takes (`attention.cache.ConverterCache` for TensorFlow's
        converters, `GatheredCache` for OpenVINO's), its `meanwhile` kept; a
        target without caches is returned as it is."""
        if self.cached_as is None:
            return self
        return dataclasses.replace(
            self.cached_as(cache_class), meanwhile=self.meanwhile
        )

    @contextlib.contextmanager
    def traced(self, form: str) -> Iterator[None]:
        """While the block runs (the conversion), quantized layers compute in
        `form` (`quantization.VARIABLES` or `CONSTANTS`)."""
        with quantization.traced(self.quantized, form, self.embeddings):
            yield

    @property
    def input_names(self) -> tuple[str, ...]:
        """The input names, in order."""
        return tuple(spec.name for spec in self.inputs)

    def call_named(self, arrays: Mapping[str, object]) -> dict[str, object]:
        """Runs `function` on inputs keyed by name; outputs keyed by name."""
        outputs = self.function([arrays[name] for name in self.input_names])
        return dict(zip(self.output_names, outputs, strict=True))

    def tf_specs(self) -> list:
        """Named `tf.TensorSpec`s of the inputs."""
        import tensorflow as tf

        return [
            tf.TensorSpec(spec.shape, tf.as_dtype(spec.dtype), name=spec.name)
            for spec in self.inputs
        ]

    def tf_function(self):
        """The callable as a `tf.function` with named inputs, returning a dict."""
        import tensorflow as tf

        @tf.function(input_signature=self.tf_specs())
        def serve(*tensors):
            return self.call_named(dict(zip(self.input_names, tensors, strict=True)))

        return serve

    def keras_model(self) -> keras.Model:
        """The callable as a Keras model taking one list, for `model.export`."""
        return _TargetModel(self)

    def input_signature(self) -> list:
        """`model.export`'s input_signature for `keras_model()`: one list."""
        return [
            [
                keras.InputSpec(shape=spec.shape, dtype=spec.dtype, name=spec.name)
                for spec in self.inputs
            ]
        ]


class _TargetModel(keras.Model):
    """A Keras model calling a `Signature`'s function on a list."""

    def __init__(self, target: Signature):
        super().__init__(name=f"{target.model.name}_export")
        self.wrapped = target.model
        self._function = target.function
        self.built = True

    def call(self, inputs, training=False):
        return list(self._function(list(inputs)))


# Token range when no Embedding layer tells the vocabulary size.
_FALLBACK_VOCAB = 10


def vocabulary_size(layers: Iterable[keras.layers.Layer]) -> int:
    """The smallest `input_dim` of the Embedding layers among `layers` (a
    model's, nested too: `every_layer`)."""
    sizes = [
        layer.input_dim for layer in layers if isinstance(layer, keras.layers.Embedding)
    ]
    return min(sizes) if sizes else _FALLBACK_VOCAB


def is_padded(target: Signature, batch: int, time: int) -> bool:
    """Whether `example_inputs` pads rows for this shape (see there)."""
    discrete = any(
        spec.dtype == "bool" or "int" in spec.dtype for spec in target.inputs
    )
    return discrete and batch > 1 and time > 1


def example_inputs(
    target: Signature, batch: int, time: int, seed: int = 0
) -> dict[str, np.ndarray]:
    """Random inputs keyed by input name; every dynamic dim after batch is `time`
    (or the target's own `examples`).

    Float inputs are standard normal. Integer inputs are token ids in
    [1, vocabulary) and boolean inputs are True; in both, rows after the first
    end with padding (0 / False) from a random length in [1, time] on, the
    first row staying full length.

    Args:
        target: The export target whose inputs to build.
        batch: Batch size.
        time: Size of every dynamic dimension after the batch.
        seed: Seed of the random generator.

    Returns:
        A dict {input name: numpy array}.
    """
    if target.examples is not None:
        return target.examples(batch, time, seed)
    rng = np.random.default_rng(seed)
    vocab = vocabulary_size(every_layer(target.model))
    lengths = np.concatenate([[time], rng.integers(1, time + 1, size=batch - 1)])
    result = {}
    for spec in target.inputs:
        shape = (batch,) + tuple(time if d is None else d for d in spec.shape[1:])
        if spec.dtype == "bool":
            values = np.ones(shape, dtype=bool)
        elif "int" in spec.dtype:
            values = rng.integers(1, max(vocab, 2), size=shape)
        else:
            values = rng.standard_normal(shape)
        if values.dtype.kind in "bi" and len(shape) > 1:
            padding = np.arange(shape[1])[None, :] >= lengths[:, None]
            padding = padding.reshape(padding.shape + (1,) * (len(shape) - 2))
            values[np.broadcast_to(padding, shape)] = 0
        result[spec.name] = values.astype(spec.dtype)
    return result
