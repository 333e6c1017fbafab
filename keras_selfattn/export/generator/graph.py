"""A model's generation as an export target: the graph of one "generate"
call (`Generator`), its inputs, their checks, and its example requests
(the module docstring of `generator` says what it takes and returns)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import keras
import numpy as np
from keras import ops

from keras_selfattn import _checks
from keras_selfattn.attention import cache as cache_lib
from keras_selfattn.attention import nan_safe
from keras_selfattn.export import integer_layers
from keras_selfattn.export.decode_step.graph import (
    build_decode_step,
)
from keras_selfattn.export.signature import NamedInput, Signature
from keras_selfattn.generation import arguments, loop

GENERATE_SIGNATURE = "generate"
# The LiteRT file's decoding step: the prompt, then one new token a call.
PREFILL_SIGNATURE = "prefill"
DECODE_SIGNATURE = "decode"
# The formats whose generator computes quantized layers on integer kernels.
INTEGER_FORMATS = ("onnx",)
CONTROLS = ("temperature", "top_k", "top_p", "seed", "end_token")
_CONTROL_DTYPES = ("float32", "int32", "float32", "int32", "int32")


@dataclasses.dataclass(frozen=True)
class Generator:
    """A model's generation as an export target.

    Attributes:
        read: The model, read by `generation.arguments.read_structure`
            (and its decode checked).
        max_length: The caches' length: prompt and new tokens together.
        jit_compile: Whether the loop is compiled by XLA (SavedModel only).
        cache_class: The class of the prompt's caches (`attention.cache`)
            where a format asks for its own (`Signature.with_caches`: the
            steps' then `CheckedCache`); None: the loop's own
            (`loop.cache_classes`).
    """

    read: arguments.Model
    max_length: int
    jit_compile: bool = False
    cache_class: type | None = None

    @property
    def prompt_name(self) -> str:
        return "prompt_tokens" if self.read.tokens else "prompt_values"

    @property
    def output_names(self) -> tuple[str, str]:
        return ("tokens" if self.read.tokens else "values", "lengths")

    def inputs(self) -> tuple[NamedInput, ...]:
        shape = (None, None) if self.read.tokens else (None, None, self.read.features)
        named = [
            NamedInput(self.prompt_name, shape, self.read.input_dtype),
            NamedInput("prompt_lengths", (None,), "int32"),
            NamedInput("max_new_tokens", (), "int32"),
        ]
        if self.read.tokens:
            named += [
                NamedInput(name, (), dtype)
                for name, dtype in zip(CONTROLS, _CONTROL_DTYPES, strict=True)
            ]
        return tuple(named)

    def _rules(self, prompts, lengths, steps, controls: loop.Controls) -> list:
        """(argument, holds: scalar bool, what it must be, its value)."""
        width = ops.shape(prompts)[1]
        rules = [
            (
                "prompt_lengths",
                ops.all(
                    ops.logical_and(
                        ops.greater_equal(lengths, 1), ops.less_equal(lengths, width)
                    )
                ),
                "must each be in [1, prompt width]",
                lengths,
            ),
            (
                "max_new_tokens",
                ops.logical_and(
                    ops.greater_equal(steps, 1),
                    ops.less_equal(ops.add(steps, width), self.max_length),
                ),
                f"must be >= 1 and fit the cache: prompt width + max_new_tokens "
                f"<= max_length={self.max_length}",
                steps,
            ),
        ]
        if not self.read.tokens:
            return rules
        vocabulary = self.read.vocabulary
        return rules + [
            (
                "prompt_tokens",
                ops.all(
                    ops.logical_and(
                        ops.greater_equal(prompts, 0), ops.less(prompts, vocabulary)
                    )
                ),
                f"must hold ids in [0, {vocabulary})",
                ops.max(prompts),
            ),
            (
                "temperature",
                ops.greater_equal(controls.temperature, 0.0),  # False for NaN
                "must be a number >= 0 (0: greedy)",
                controls.temperature,
            ),
            (
                "top_k",
                ops.greater_equal(controls.top_k, 1),
                "must be >= 1",
                controls.top_k,
            ),
            (
                "top_p",
                ops.logical_and(
                    ops.greater(controls.top_p, 0.0),
                    ops.less_equal(controls.top_p, 1.0),
                ),
                "must be in (0, 1]",
                controls.top_p,
            ),
            (
                "end_token",
                ops.logical_and(
                    ops.greater_equal(controls.end_token, -1),
                    ops.less(controls.end_token, vocabulary),
                ),
                f"must be -1 (none) or an id in [0, {vocabulary})",
                controls.end_token,
            ),
        ]

    def call(self, tensors: Sequence):
        """The generator's graph: [generated, lengths] from its inputs."""
        prompts, lengths, steps, *rest = tensors
        controls = loop.Controls(*rest) if rest else loop.Controls()
        lengths = ops.cast(lengths, "int32")
        steps = ops.cast(steps, "int32")
        rules = self._rules(prompts, lengths, steps, controls)
        prompts = _asserted(prompts, rules)
        valid = rules[0][1]
        for _, holds, _, _ in rules[1:]:
            valid = ops.logical_and(valid, holds)
        width = ops.shape(prompts)[1]
        lengths = ops.clip(lengths, 1, width)
        steps = ops.where(valid, steps, 1)
        if self.read.tokens:
            inside = ops.logical_and(
                ops.greater_equal(prompts, 0), ops.less(prompts, self.read.vocabulary)
            )
            prompts = ops.where(inside, prompts, ops.zeros_like(prompts))
            controls = loop.Controls(
                temperature=ops.where(valid, controls.temperature, 0.0),
                top_k=ops.where(valid, controls.top_k, self.read.vocabulary),
                top_p=ops.where(valid, controls.top_p, 1.0),
                seed=controls.seed,
                end_token=ops.where(valid, controls.end_token, -1),
            )
        generated, produced = self._loop()(
            prompts,
            lengths,
            steps,
            *(getattr(controls, field.name) for field in dataclasses.fields(controls)),
        )
        batch = ops.shape(generated)[0]
        size = (batch, steps) + tuple(ops.shape(generated)[2:])
        generated = ops.slice(generated, (0,) * len(size), size)
        nothing = loop.NOT_GENERATED if self.read.tokens else float("nan")
        generated = nan_safe.where(valid, generated, ops.full_like(generated, nothing))
        return [generated, ops.where(valid, produced, 0)]

    def _loop(self):
        """`loop.run` on (prompts, lengths, steps, *controls), its outputs
        `max_length` wide, its caches of `cache_class` where a format asked
        for its own; compiled by XLA in
        one piece when `jit_compile` (the slice to `max_new_tokens` columns,
        a shape XLA cannot know before it runs, stays outside)."""

        def run(prompts, lengths, steps, *controls):
            caches = None
            if self.cache_class is not None:
                caches = loop.CacheClasses(
                    prompt=self.cache_class, steps=cache_lib.CheckedCache
                )
            return loop.run(
                self.read.model,
                self.read.layers,
                prompts,
                lengths,
                max_length=self.max_length,
                capacity=self.max_length,
                steps=steps,
                controls=loop.Controls(*controls),
                tokens=self.read.tokens,
                caches=caches,
            )

        if not self.jit_compile:
            return run
        import tensorflow as tf

        return tf.function(run, jit_compile=True)

    def target(self, export_format: str | None = None) -> Signature:
        """The generator as a `Signature`: signature "generate" (LiteRT:
        with "prefill" and "decode" beside it, `pair`).

        For `export_format` "onnx" it carries the model's `integer_layers`:
        the file computes them on ONNX Runtime's integer kernels from
        Keras's integers (weight-only layers on `MatMulNBits`, int8 with
        activation quantization on `MatMulIntegerToFloat`). Every other
        quantized layer, and every one elsewhere, runs Keras's own call.
        """
        quantized = ()
        if export_format in INTEGER_FORMATS:
            quantized = integer_layers.integer_layers(self.read.model)
        return Signature(
            self.read.model,
            self.inputs(),
            self.output_names,
            self.call,
            signature_name=GENERATE_SIGNATURE,
            what="generator",
            quantized=quantized,
            examples=self.example,
            extra_signatures=self.pair,
            cached_as=lambda cls: dataclasses.replace(self, cache_class=cls).target(
                export_format
            ),
        )

    def pair(self) -> tuple[Signature, Signature]:
        """The model's decoding step as the LiteRT signatures "prefill" (any
        number of new positions: the prompts) and "decode" (one).

        Raises:
            ValueError: for a model whose decoding step cannot be exported
                (`decode_step.build_decode_step`: an input named by Keras).
        """
        step = build_decode_step(self.read.model, self.max_length, self.read.reading)
        return (
            step.target(PREFILL_SIGNATURE, cache_class=self.cache_class),
            step.target(DECODE_SIGNATURE, new=1, cache_class=self.cache_class),
        )

    def example(self, batch: int, time: int, seed: int = 0) -> dict[str, np.ndarray]:
        """A valid greedy request (warmup): `batch` prompts of up to `time`
        positions, as many new tokens as fit (at most 8)."""
        time = max(1, min(time, self.max_length - 1))
        prompts, lengths = random_prompts(self.read, batch, time, seed)
        request = {
            self.prompt_name: prompts,
            "prompt_lengths": lengths,
            "max_new_tokens": np.int32(min(8, self.max_length - time)),
        }
        if self.read.tokens:
            request.update(
                control_inputs({"temperature": 0.0, "seed": seed}, self.read)
            )
        return request


def _asserted(prompts, rules):
    """`prompts` after TensorFlow asserts of every rule (InvalidArgument
    naming the argument); unchanged on other backends."""
    if keras.backend.backend() != "tensorflow":
        return prompts
    import tensorflow as tf

    asserts = [
        tf.debugging.Assert(
            holds, [f"generate: `{name}` {what}. Received: {name}=", value]
        )
        for name, holds, what, value in rules
    ]
    with tf.control_dependencies(asserts):
        return tf.identity(prompts)


def random_prompts(
    read: arguments.Model, batch: int, width: int, seed: int, mixed: bool = True
):
    """Right-padded random prompts of lengths in [1, width] (the first full),
    or all `width` long when not `mixed`."""
    rng = np.random.default_rng(seed)
    lengths = np.full(batch, width)
    if mixed:
        lengths[1:] = rng.integers(1, width + 1, size=batch - 1)
    if read.tokens:
        prompts = rng.integers(1, read.vocabulary, size=(batch, width))
    else:
        prompts = rng.standard_normal((batch, width, read.features))
    prompts[np.arange(width)[None, :] >= lengths[:, None]] = 0
    return prompts.astype(read.input_dtype), lengths.astype(np.int32)


def control_inputs(values: dict, read: arguments.Model) -> dict[str, np.ndarray]:
    """The control inputs of a request, defaults filled in."""
    defaults = {
        "temperature": 0.0,
        "top_k": read.vocabulary,
        "top_p": 1.0,
        "seed": 0,
        "end_token": -1,
    }
    merged = {**defaults, **values}
    return {
        name: np.asarray(merged[name], dtype)
        for name, dtype in zip(CONTROLS, _CONTROL_DTYPES, strict=True)
    }


def build_generator(
    model: keras.Model,
    max_length: int,
    jit_compile: bool = False,
    structure: arguments.Model | None = None,
) -> Generator:
    """Checks that `model` can generate and describes its generator.

    `structure` is the model's `arguments.read_structure` where the caller
    has read it; else it is read here.

    Raises:
        TypeError: if `model` is not a keras.Model.
        ValueError: for a model that cannot generate, or a bad `max_length`.
    """
    max_length = _checks.positive_int("max_length", max_length)
    if max_length < 2:
        raise ValueError(
            "`max_length` must leave room for a prompt and a new token (>= 2). "
            f"Received: max_length={max_length}"
        )
    read = arguments.read_structure(model) if structure is None else structure
    arguments.check_decodes(read)
    return Generator(read, max_length, _checks.boolean("jit_compile", jit_compile))
