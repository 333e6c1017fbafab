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
(`_writer`).

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
a time (`check.pair_run`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import warnings
from collections.abc import Iterator, Mapping, Sequence

import keras

from keras_selfattn.export import formats, pipeline, tensorflow_env
from keras_selfattn.export.decode_step.graph import refuse_quantized
from keras_selfattn.export.generator import _writer
from keras_selfattn.export.generator.check import (
    FORMATS,
    PAIR_RUNTIME,
    ROWS,
    References,
    check_generator,
    references,
    verify_generator,
)
from keras_selfattn.export.generator.graph import Generator, build_generator
from keras_selfattn.export.parity.engine import artifact_paths, collect_artifacts
from keras_selfattn.export.parity.report import ParityReport
from keras_selfattn.export.signature import Signature
from keras_selfattn.generation import arguments, decode_check
from keras_selfattn_runtimes import table

logger = logging.getLogger(__name__)
# What importers of `export_generator` find here besides it: its check.
__all__ = ["FORMATS", "PAIR_RUNTIME", "export_generator", "verify_generator"]


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
    int4_inputs: str = "float",
    check: bool = True,
) -> str:
    """Exports `model`'s whole generation as one call (module docstring).

    A model of 1 GiB of weights or more, exported on TensorFlow with its
    oneDNN ops on (TensorFlow's default on x86 Linux), warns that their
    allocator makes the export need more memory, and how to turn them off.

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
        int4_inputs: ONNX only: the inputs of a quantized model's 4-bit
            layers (Keras's int4, gptq, awq). "float" (default): Keras's
            float inputs, its tokens. "int8": rounded to int8 in the
            weights' blocks, as onnxruntime-genai's int4 models compute
            them (`MatMulNBits`' accuracy level 4): about twice the tokens
            per second on a CPU with int8 dot products (docs/quantization.md),
            and tokens that may differ from Keras's where its logits nearly
            tie (the check judges them there, as an int8 model's).
        check: Whether to run the generator in its runtime against
            `keras_selfattn.generate` before it appears (and the model's
            cached decode against its full forward pass first,
            docs/decoding.md); False skips both.

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
    options = {
        "name": name,
        "version": version,
        "warmup": warmup,
        "models_config": models_config,
        "opset": opset,
        "int4_inputs": int4_inputs,
    }
    exported = GeneratorExport(model, max_length, jit_compile, options)
    note = tensorflow_env.onednn_memory_warning(
        formats.model_weight_bytes(model), keras.backend.backend()
    )
    if note is not None:
        warnings.warn(note, stacklevel=2)
    with decode_check.waived(not check):
        return pipeline.export(exported, {export_format: path}, check)[export_format]


@dataclasses.dataclass
class GeneratorExport(pipeline.Target):
    """A model's generator as `pipeline.export` runs it: refused in a format
    that cannot hold its loop (`FormatRow.generator`), for a quantized model
    where the format cannot take it, and `jit_compile` where the runtime
    does not compile with XLA; written by TensorFlow (a TensorFlow process
    off it); checked against `keras_selfattn.generate` (`verify_generator`).

    Attributes:
        model, max_length, jit_compile: As given to `export_generator`.
        options: The exporter's format options; each format takes its own
            (`FormatRow.options`).
        keras_path: The model's .keras file where the caller has one (the
            command line loaded the model from it): off TensorFlow, the
            writer loads it instead of a new save of the model.
    """

    model: keras.Model
    max_length: int
    jit_compile: bool
    options: Mapping[str, object]
    keras_path: str | None = None
    _generator: Generator | None = None
    _structure: arguments.Model | None = None
    _formats: tuple[str, ...] = ()
    _checked: bool = False
    _references: References | None = None

    def _read(self) -> arguments.Model:
        """The model's one reading for this export
        (`arguments.read_structure`)."""
        if self._structure is None:
            self._structure = arguments.read_structure(self.model)
        return self._structure

    def refuse(self, export_format: str) -> None:
        if export_format in table.NAMES and export_format not in FORMATS:
            raise ValueError(
                f"A generator exports as {' or '.join(FORMATS)} (the loop stays "
                "in the graph; OpenVINO and .pt2 get the decoding step: "
                "export_decode_step). Received: export_format="
                f"{export_format!r}"
            )
        refuse_quantized(lambda: self._read().reading, export_format, "generator")
        row = table.BY_NAME.get(export_format)
        if self.jit_compile and (row is None or not row.jit_compile):
            raise ValueError(
                "`jit_compile` compiles a SavedModel's loop with XLA; ONNX and "
                "LiteRT runtimes run their own graphs. Received: "
                f"jit_compile=True, export_format={export_format!r}"
            )
        int4_inputs = self.options.get("int4_inputs")
        if int4_inputs not in (None, "float") and export_format != table.ONNX.name:
            raise ValueError(
                "`int4_inputs` picks the ONNX generator's 4-bit kernel; "
                f"{export_format!r} computes Keras's float inputs. Received: "
                f"int4_inputs={int4_inputs!r}, export_format={export_format!r}"
            )

    def destination(
        self, export_format: str, path: str | os.PathLike
    ) -> formats.Destination:
        self.refuse(export_format)
        options = pipeline.format_options(export_format, self.options)
        return check_destination(export_format, path, **options)

    def plan(self, export_formats: Sequence[str], check: bool) -> None:
        """Where `check`, each target built carries `prepare_check` (for
        the rows `export_formats` will allow)."""
        self._formats, self._checked = tuple(export_formats), check

    def build(self, export_format: str) -> Signature:
        if self._generator is None:
            self._generator = build_generator(
                self.model, self.max_length, self.jit_compile, self._structure
            )
        target = self._generator.target(export_format)
        if not self._checked:
            return target
        return dataclasses.replace(target, meanwhile=self.prepare_check)

    def prepare_check(self) -> None:
        """Computes the check's Keras references (`check.references`) for
        the rows its artifacts will allow (`Format.expected_generator_rows`),
        once: LiteRT's converter calls it while its process runs, and off
        TensorFlow the writer while the TensorFlow process writes
        (`Signature.meanwhile`). A failure leaves them to the check, which
        computes them again and reports what failed."""
        if self._references is not None:
            return
        weights = formats.model_weight_bytes(self.model)
        each = [formats.get(f).expected_generator_rows(weights) for f in self._formats]
        rows = min([limit for limit in each if limit] or [ROWS])
        paired = any(table.BY_NAME[f].extra_signatures for f in self._formats)
        try:
            self._references = references(self._generator, 0, rows, paired)
        except Exception:  # the check computes them again, and raises there
            logger.debug("The check's references failed early", exc_info=True)

    @contextlib.contextmanager
    def writing(self, export_format: str) -> Iterator[formats.Writer | None]:
        """Off TensorFlow, a TensorFlow process writing from the model's
        .keras file (`writer`): `keras_path`, else a new save."""
        if keras.backend.backend() == _writer.WRITER_BACKEND:
            yield None
            return
        if self.keras_path is not None:
            yield writer(self._generator, self.keras_path, export_format)
            return
        with _writer.keras_file(self.model) as keras_path:
            yield writer(self._generator, keras_path, export_format)

    def check(self, staged: Mapping[str, str]) -> ParityReport:
        """`verify_generator`'s check of the staged artifacts, on the
        generator built for them (`build`)."""
        artifacts = collect_artifacts(artifact_paths({}, staged, FORMATS))
        return check_generator(self._generator, artifacts, computed=self._references)


def writer(
    generator: Generator, keras_path: str, export_format: str
) -> formats.Writer | None:
    """Who writes `generator`'s artifact on this backend: None (the format's
    own writer) on TensorFlow, else a TensorFlow process that loads the
    model from `keras_path` (`_writer`)."""
    if keras.backend.backend() == _writer.WRITER_BACKEND:
        return None
    return _writer.writer(
        keras_path,
        export_format,
        generator.max_length,
        generator.jit_compile,
        _writer.class_modules(generator.read.reading.every),
    )


def check_destination(
    export_format: str, path: str | os.PathLike, **options: object
) -> formats.Destination:
    """`pipeline.check_destination` for a generator: checked for TensorFlow,
    which writes it from every backend."""
    return pipeline.check_destination(
        export_format, path, backend=_writer.WRITER_BACKEND, **options
    )
