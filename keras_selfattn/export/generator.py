"""Export a model's whole generation as one call: prompts in, tokens out.

Serving generation through an exported decoding step means one request per
new token, each carrying every layer's cache both ways. A generator keeps
the loop inside the artifact (`keras_selfattn.generation.loop`): one call,
signature "generate", takes

    prompt_tokens   int32 (batch, time)   right-padded prompts
                    (value models: prompt_values (batch, time, features))
    prompt_lengths  int32 (batch,)        each in [1, time]
    max_new_tokens  int32 ()              1 .. max_length - time
    temperature     float32 ()            0: greedy                (token models)
    top_k           int32 ()              >= 1; >= vocabulary keeps all
    top_p           float32 ()            (0, 1]; 1 keeps all
    seed            int32 ()              any: the uniform stream's seed
    end_token       int32 ()              -1 (none) or an id

and returns `tokens` int32 (batch, max_new_tokens), -1 after each row's
end (value models: `values`), and `lengths` int32 (batch,). The caches
(`max_length` positions, fixed at export) never leave the artifact.

Bad arguments: the SavedModel raises InvalidArgument naming the argument,
which TF Serving returns to the client; runtimes that cannot raise inside
a graph (ONNX Runtime, LiteRT: their converters drop TensorFlow's asserts)
return lengths 0 and tokens -1 (values NaN) for every row, never tokens
they did not compute. A prompt longer than the cache fails in every
runtime.

Formats: SavedModel (TF Serving's layout, warmup and `models.config`),
ONNX (the loop as an ONNX `Loop`) and LiteRT (the loop as its `WHILE` op,
builtin ops only), from every backend. TensorFlow traces the loop: JAX's
exporters cannot bound the prompt's symbolic length by the cache's
(jax2tf: "symbolic dimension comparison '- time + max_length' >= '0' is
inconclusive") and torch.export cannot trace the loop, so on JAX and torch
a TensorFlow process writes the artifact from the model's .keras file
(`_tf_writer`).

The LiteRT file has two more signatures, for runtimes that drive the loop
themselves: "prefill" and "decode", the model's decoding step
(`decode_step`) with the caches as inputs and outputs,

    inputs:  <model input>          (batch, time): prompts; decode: (batch, 1)
             cache_<layer>          (batch, 2, max_length, kv_heads, key_dim)
             cache_update_index     int32 (): the first new position
    outputs: <model output>         the new positions' logits (or values)
             updated_cache_<layer>  the caches the next call takes

"prefill" takes prompts of one length (zero caches, index 0); each
"decode" call the token chosen from the last position's logits, the caches
the call before returned and the number of positions so far.

Each generator is staged and checked in a fresh process of its runtime
against `keras_selfattn.generate` on the caller's backend, on the same
prompts and seeds: greedy and seeded top-k/top-p tokens must be identical,
and so must the greedy tokens the LiteRT pair decodes one "decode" call at
a time (`pair_run`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

import keras
import numpy as np
from keras import ops

from keras_selfattn import _checks
from keras_selfattn.attention import nan_safe
from keras_selfattn.export import _tf_writer, formats, pipeline
from keras_selfattn.export._runtimes import Artifact, Run
from keras_selfattn.export._target import ExportTarget, NamedInput
from keras_selfattn.export.decode_step import (
    INDEX_NAME,
    DecodeStep,
    build_decode_step,
    refuse_quantized,
)
from keras_selfattn.export.formats import table
from keras_selfattn.export.parity.arguments import PATH_ARGUMENT, artifact_paths
from keras_selfattn.export.parity.engine import (
    check_artifacts,
    collect_artifacts,
    run_checked,
)
from keras_selfattn.export.parity.report import ParityReport, finish_report
from keras_selfattn.export.parity.rules import ParityRow, parity_row
from keras_selfattn.generation import arguments, generate, loop

GENERATE_SIGNATURE = "generate"
# The LiteRT file's decoding step: the prompt, then one new token a call.
PREFILL_SIGNATURE = "prefill"
DECODE_SIGNATURE = "decode"
# The check's report row of the LiteRT pair generating.
PAIR_RUNTIME = "litert prefill/decode"
CONTROLS = ("temperature", "top_k", "top_p", "seed", "end_token")
_CONTROL_DTYPES = ("float32", "int32", "float32", "int32", "int32")
# Formats a generator can be written in (by TensorFlow, from every backend).
FORMATS = ("saved_model", "onnx", "litert")
# The checks' generations: greedy, then seeded top-k / top-p with an end.
_SAMPLED = {"temperature": 0.9, "top_k": 12, "top_p": 0.9, "seed": 1234}


@dataclasses.dataclass(frozen=True)
class Generator:
    """A model's generation as an export target.

    Attributes:
        read: The model, read by `generation.arguments.read_model`.
        max_length: The caches' length: prompt and new tokens together.
        jit_compile: Whether the loop is compiled by XLA (SavedModel only).
    """

    read: arguments.Model
    max_length: int
    jit_compile: bool = False

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
        `max_length` wide; compiled by XLA in one piece when `jit_compile`
        (the slice to `max_new_tokens` columns, a shape XLA cannot know
        before it runs, stays outside)."""

        def run(prompts, lengths, steps, *controls):
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
            )

        if not self.jit_compile:
            return run
        import tensorflow as tf

        return tf.function(run, jit_compile=True)

    def target(self) -> ExportTarget:
        """The generator as an `ExportTarget`: signature "generate" (LiteRT:
        with "prefill" and "decode" beside it, `pair`)."""
        return ExportTarget(
            self.read.model,
            self.inputs(),
            self.output_names,
            self.call,
            signature_name=GENERATE_SIGNATURE,
            what="generator",
            examples=self.example,
            extra_signatures=self.pair,
        )

    def pair(self) -> tuple[ExportTarget, ExportTarget]:
        """The model's decoding step as the LiteRT signatures "prefill" (any
        number of new positions: the prompts) and "decode" (one).

        Raises:
            ValueError: for a model whose decoding step cannot be exported
                (`decode_step.build_decode_step`: an input named by Keras).
        """
        step = build_decode_step(self.read.model, self.max_length)
        return (step.target(PREFILL_SIGNATURE), step.target(DECODE_SIGNATURE, new=1))

    def example(self, batch: int, time: int, seed: int = 0) -> dict[str, np.ndarray]:
        """A valid greedy request (warmup): `batch` prompts of up to `time`
        positions, as many new tokens as fit (at most 8)."""
        time = max(1, min(time, self.max_length - 1))
        prompts, lengths = _prompts(self.read, batch, time, seed)
        request = {
            self.prompt_name: prompts,
            "prompt_lengths": lengths,
            "max_new_tokens": np.int32(min(8, self.max_length - time)),
        }
        if self.read.tokens:
            request.update(_controls({"temperature": 0.0, "seed": seed}, self.read))
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


def _prompts(
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


def _controls(values: dict, read: arguments.Model) -> dict[str, np.ndarray]:
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
    model: keras.Model, max_length: int, jit_compile: bool = False
) -> Generator:
    """Checks that `model` can generate and describes its generator.

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
    read = arguments.read_model(model)
    return Generator(read, max_length, _checks.boolean("jit_compile", jit_compile))


def _sizes(generator: Generator) -> tuple[int, int]:
    """The checks' (prompt width, new tokens): up to 9 and 12 that fit."""
    width = max(1, min(9, generator.max_length // 2))
    return width, min(12, generator.max_length - width)


def requests(generator: Generator, seed: int = 0) -> list[tuple[str, dict]]:
    """The checks' requests: 8 prompts of mixed lengths, greedy and (token
    models) seeded top-k / top-p with an end token; (label, inputs)."""
    width, steps = _sizes(generator)
    prompts, lengths = _prompts(generator.read, 8, width, seed)
    base = {
        generator.prompt_name: prompts,
        "prompt_lengths": lengths,
        "max_new_tokens": np.int32(steps),
    }
    if not generator.read.tokens:
        return [(f"8x{width} +{steps}", base)]
    sampled = {**_SAMPLED, "top_k": min(_SAMPLED["top_k"], generator.read.vocabulary)}
    return [
        (f"8x{width} +{steps} greedy", {**base, **_controls({}, generator.read)}),
        (
            f"8x{width} +{steps} sampled",
            {**base, **_controls({**sampled, "end_token": 0}, generator.read)},
        ),
    ]


def keras_generate(generator: Generator, request: dict) -> dict[str, np.ndarray]:
    """`keras_selfattn.generate` on an exported generator's request."""
    read = generator.read
    options = {}
    if read.tokens:
        temperature = float(request["temperature"])
        top_k, top_p = int(request["top_k"]), float(request["top_p"])
        sampling = temperature > 0
        options = {
            "temperature": temperature,
            "top_k": top_k if sampling and top_k < read.vocabulary else None,
            "top_p": top_p if sampling and top_p < 1 else None,
            "seed": int(request["seed"]),
            "end_token": None
            if int(request["end_token"]) < 0
            else int(request["end_token"]),
        }
    result = generate(
        read.model,
        request[generator.prompt_name],
        int(request["max_new_tokens"]),
        prompt_lengths=request["prompt_lengths"],
        max_length=generator.max_length,
        **options,
    )
    return dict(
        zip(generator.output_names, (result.tokens, result.lengths), strict=True)
    )


def pair_run(
    generator: Generator, step: DecodeStep, seed: int = 0
) -> tuple[str, Run, dict]:
    """The greedy generation the LiteRT pair is checked on: 4 prompts of one
    length through "prefill", then one "decode" call per new token, each
    fed the argmax of the last logits (value models: the last output) and
    the caches the call before returned.

    Returns:
        (label, the `Run`, the generator request whose tokens it must give).
    """
    width, steps = _sizes(generator)
    prompts, lengths = _prompts(generator.read, 4, width, seed, mixed=False)
    request = {
        generator.prompt_name: prompts,
        "prompt_lengths": lengths,
        "max_new_tokens": np.int32(steps),
    }
    if generator.read.tokens:
        request.update(_controls({}, generator.read))
    prefill = {
        step.input.name: prompts,
        **step.empty_caches(len(prompts)),
        INDEX_NAME: np.asarray(0, np.int32),
    }
    decode = [{INDEX_NAME: np.asarray(width + k, np.int32)} for k in range(steps - 1)]
    run = Run(
        (prefill, *decode),
        dict(zip(step.updated_cache_names, step.cache_names, strict=True)),
        signatures=(PREFILL_SIGNATURE,) + (DECODE_SIGNATURE,) * (steps - 1),
        generated={step.output_name: step.input.name},
    )
    label = f"4x{width} +{steps}" + (" greedy" if generator.read.tokens else "")
    return label, run, request


def _pair_row(
    generator: Generator, artifact: Artifact, tolerance: float, seed: int
) -> ParityRow:
    """The LiteRT file's "prefill" and "decode" generating `pair_run` in a
    fresh process, against `keras_selfattn.generate`."""
    step = build_decode_step(generator.read.model, generator.max_length)
    label, run, request = pair_run(generator, step, seed)
    outcome = run_checked(
        step.target(PREFILL_SIGNATURE),
        {PAIR_RUNTIME: artifact},
        [run],
        [label],
        "generating {label} through prefill and decode",
        tolerance,
        tolerance,
    )[PAIR_RUNTIME]
    last = np.concatenate(
        [outputs[step.output_name][:, -1:] for outputs in outcome.outputs[0]], axis=1
    )
    produced = np.argmax(last, axis=-1) if generator.read.tokens else last
    wanted = keras_generate(generator, request)[generator.output_names[0]]
    return parity_row(PAIR_RUNTIME, label, [(wanted, produced)], tolerance, tolerance)


def verify_generator(
    model: keras.Model,
    saved_model_dir: str | os.PathLike | None = None,
    onnx_path: str | os.PathLike | None = None,
    *,
    max_length: int,
    litert_path: str | os.PathLike | None = None,
    seed: int = 0,
) -> ParityReport:
    """Runs exported generators in fresh processes of their runtimes and
    compares their outputs with `keras_selfattn.generate` on the same
    requests (`requests`): tokens and lengths must be identical (value
    models: values within float32 rounding, 1e-5). A LiteRT file also
    generates through its "prefill" and "decode" signatures (`pair_run`;
    report row "litert prefill/decode"), whose greedy tokens must be
    generate's.

    Returns:
        The `ParityReport`.

    Raises:
        ParityError: if any output differs, or an export's names differ.
    """
    generator = build_generator(model, max_length)
    paths = artifact_paths(saved_model_dir, onnx_path, litert_path, None, None)
    artifacts = collect_artifacts(paths)
    labelled = requests(generator, seed)
    labels = [label for label, _ in labelled]
    runs = [Run((request,)) for _, request in labelled]
    expected = [[keras_generate(generator, request)] for _, request in labelled]
    tolerance = 0.0 if generator.read.tokens else 1e-5
    rows = check_artifacts(
        generator.target(),
        artifacts,
        runs,
        expected,
        labels,
        tolerance,
        tolerance,
        action="generating {label}",
    )
    litert = artifacts.get(table.LITERT.name)
    if litert is not None:
        rows += (_pair_row(generator, litert, tolerance, seed),)
    return finish_report(list(rows), tolerance, tolerance, "generations differ", "")


def export_generator(
    model: keras.Model,
    path: str | os.PathLike,
    export_format: str,
    *,
    max_length: int,
    name: str | None = None,
    version: int | None = None,
    warmup: bool = False,
    models_config: bool = True,
    opset: int | None = None,
    jit_compile: bool = False,
    check: bool = True,
) -> str:
    """Exports `model`'s whole generation as one call (module docstring).

    Args:
        model: A token model (integer input, logits out) or a value model
            (float input, its output the next input) that SelfAttention's
            caches can decode (`keras_selfattn.generate`).
        path: The SavedModel base dir ("saved_model": `path/name/VERSION/`,
            signature "generate") or the ONNX or LiteRT file.
        export_format: "saved_model", "onnx" or "litert" (written by
            TensorFlow: on JAX and torch, by a TensorFlow process from the
            model's .keras file, then checked against this backend's
            `generate`).
        max_length: The caches' length: the longest prompt plus new tokens.
        name, version, warmup, models_config: The SavedModel's (as in
            `export_saved_model`); `name` is required there.
        opset: ONNX opset, 13 to 18 (ONNX only). Defaults to 17.
        jit_compile: SavedModel only: compile the loop with XLA (2 to 15
            times the tokens per second measured on a CPU; TF Serving then
            needs `--xla_cpu_compilation_enabled=true` on a CPU, without
            which it answers every request with an error). Default False:
            servable by any TF Serving.
        check: Whether to run the generator in its runtime against
            `keras_selfattn.generate` before it appears.

    Returns:
        The version folder or the file.

    Raises:
        ValueError: for a format that cannot hold the loop (one line naming
            the ones that can), a model that cannot generate (or, off
            TensorFlow, cannot be saved as .keras), or an invalid argument.
        FileExistsError: if the target exists.
        ParityError: if the check fails (nothing is left on disk).

    Example:

    ```python
    import keras
    from keras_selfattn import SelfAttention
    from keras_selfattn.export import export_generator

    tokens = keras.Input((None,), dtype="int32", name="tokens")
    h = keras.layers.Embedding(20, 16)(tokens)
    h = SelfAttention(num_heads=2, causal=True, rope_max_wavelength=100)(h)
    model = keras.Model(tokens, keras.layers.Dense(20)(h))
    export_generator(model, "serving", "saved_model", max_length=32, name="lm")
    ```
    """
    if export_format in table.NAMES and export_format not in FORMATS:
        raise ValueError(
            f"A generator exports as {' or '.join(FORMATS)} (the loop stays in "
            "the graph; OpenVINO and .pt2 get the decoding step: "
            "export_decode_step). Received: export_format="
            f"{export_format!r}"
        )
    refuse_quantized(model, export_format, "generator")
    options = {}
    if export_format == table.SAVED_MODEL.name:
        options = {
            "name": name,
            "version": version,
            "warmup": warmup,
            "models_config": models_config,
        }
    elif export_format == table.ONNX.name:
        options = {"opset": opset}
    if jit_compile and export_format != table.SAVED_MODEL.name:
        raise ValueError(
            "`jit_compile` compiles a SavedModel's loop with XLA; ONNX and "
            "LiteRT runtimes run their own graphs. Received: jit_compile=True, "
            f"export_format={export_format!r}"
        )
    destination = check_destination(export_format, path, **options)
    generator = build_generator(model, max_length, jit_compile)

    def checked(staged: str) -> None:
        verify_generator(
            model, max_length=max_length, **{PATH_ARGUMENT[export_format]: staged}
        )

    target, check_staged = generator.target(), checked if check else None
    if keras.backend.backend() == _tf_writer.WRITER_BACKEND:
        return pipeline.export(target, destination, check_staged)
    with _tf_writer.keras_file(model) as keras_path:
        write = writer(generator, keras_path, export_format)
        return pipeline.export(target, destination, check_staged, write)


def writer(
    generator: Generator, keras_path: str, export_format: str
) -> formats.Writer | None:
    """Who writes `generator`'s artifact on this backend: None (the format's
    own writer) on TensorFlow, else a TensorFlow process that loads the
    model from `keras_path` (`_tf_writer`)."""
    if keras.backend.backend() == _tf_writer.WRITER_BACKEND:
        return None
    return _tf_writer.writer(
        keras_path, export_format, generator.max_length, generator.jit_compile
    )


def check_destination(
    export_format: str, path: str | os.PathLike, **options: object
) -> formats.Destination:
    """`pipeline.check_destination` for a generator: checked for TensorFlow,
    which writes it from every backend."""
    return pipeline.check_destination(
        export_format, path, backend=_tf_writer.WRITER_BACKEND, **options
    )
