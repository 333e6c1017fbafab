"""Export a model's decoding step: new positions + caches + index -> output + caches.

A decoding step runs the model on the positions `index .. index + new - 1`
only, with one key/value cache per causal SelfAttention layer:

    inputs:  <model input>       (batch, new, ...)   the model's own input
             cache_<layer name>   (batch, 2, max_length, kv_heads, key_dim)
             cache_update_index   int32 scalar, the first new position
    outputs: <model output>       (batch, new, ...)   the new positions' outputs
             updated_cache_<layer name>              the caches after the step

This module holds only what is the step's own: finding the cached layers
(`build_decode_step`), threading the caches through the model
(`DecodeStep.call`), and the step-by-step check against Keras
(`verify_decode_step`). The step is an `ExportTarget` (`DecodeStep.target()`)
and rides the forward export's pipeline: `export_decode_step` writes it in
any format the backend can export (`formats.table`; SavedModel signature
"decode_step" for TF Serving, also aliased as "serving_default"; ONNX with
dynamic "batch" and "time" axes), checking it before it appears: a whole
sequence decoded step by step (a prompt, then one position per step up to
`max_length`) through the export, in a fresh process of its runtime, and
through Keras's cached calls, and Keras's cached calls against the model's
full (uncached) forward.

Supported models: a Sequential model, or a Functional model with one named
`keras.Input` and one output, in which every SelfAttention is a top-level
layer with `causal=True`, called once on a single tensor without masks.
Any graph around them (Embedding, Dense, LayerNormalization, residual Adds)
works as long as it is position-wise: position t's output may depend on
earlier positions only through the SelfAttention layers. That is checked
numerically (the cached decode must equal the full forward), not assumed.
Refused with a ValueError: subclassed models, several inputs or outputs,
SelfAttention nested in another layer or called twice, non-causal layers,
padding masks (`mask_zero=True`, `Masking`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

import keras
import numpy as np

from keras_selfattn import _checks
from keras_selfattn.export import _runtimes, pipeline, quantization
from keras_selfattn.export._endpoint import _output_names, model_inputs
from keras_selfattn.export._inputs import vocabulary_size
from keras_selfattn.export._target import ExportTarget, NamedInput
from keras_selfattn.export.formats import table
from keras_selfattn.export.parity.arguments import (
    PATH_ARGUMENT,
    artifact_paths,
    check_tolerance,
)
from keras_selfattn.export.parity.engine import check_artifacts, collect_artifacts
from keras_selfattn.export.parity.report import ParityReport, finish_report
from keras_selfattn.export.parity.rules import DEFAULT_ATOL, DEFAULT_RTOL, parity_row
from keras_selfattn.generation import cached_model
from keras_selfattn.self_attention import SelfAttention

_ACTION = "export a decoding step of"
STEP_SIGNATURE = "decode_step"
INDEX_NAME = "cache_update_index"
CACHE_PREFIX = "cache_"
UPDATED_CACHE_PREFIX = "updated_cache_"
# (batch, prompt length) of the sequences `verify_decode_step` decodes: one
# position per step from the start, a prompt of 3, and the whole sequence in
# one step (prompts longer than max_length are cut to it).
DEFAULT_SCHEDULES: tuple[tuple[int, int], ...] = ((1, 1), (2, 3), (3, 1 << 30))


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
        return tuple(CACHE_PREFIX + layer.name for layer in self.layers)

    @property
    def updated_cache_names(self) -> tuple[str, ...]:
        """Output names of the updated caches, one per layer."""
        return tuple(UPDATED_CACHE_PREFIX + layer.name for layer in self.layers)

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
    ) -> ExportTarget:
        """The step as an `ExportTarget`.

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

        return ExportTarget(
            self.model,
            (step_input, *caches, NamedInput(INDEX_NAME, (), "int32")),
            self.output_names,
            function,
            signature_name=signature_name,
            what="decode step",
        )


# Formats whose converters cannot take Keras's quantized layers inside a
# decoding step or a generator (the forward export gives them their own
# quantized forms, which a step-by-step check would not accept).
_NO_QUANTIZED_DECODING = {
    table.LITERT.name: "LiteRT's converter has no int8 batch matmul",
    table.OPENVINO.name: "OpenVINO's conversion computes other numbers",
}


def refuse_quantized(model: keras.Model, export_format: str, what: str) -> None:
    """Raises ValueError (one line) for a quantized `model`'s decoding step or
    generator (`what`) in a format that cannot compute its quantized layers
    as Keras does (`_NO_QUANTIZED_DECODING`)."""
    why = _NO_QUANTIZED_DECODING.get(export_format)
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

    Raises:
        TypeError: if `model` is not a keras.Model.
        ValueError: for an unsupported model or `max_length`.
    """
    max_length = _checks.positive_int("max_length", max_length)
    inputs = model_inputs(model)  # named, non-subclassed
    if not isinstance(model, keras.Sequential) and not hasattr(
        model, "_nodes_by_depth"
    ):
        raise _refuse(model, "it is not a Sequential or Functional model")
    if len(inputs) != 1:
        raise _refuse(model, f"it has {len(inputs)} inputs")
    outputs = _output_names(model)
    if len(outputs) != 1:
        raise _refuse(model, f"it has {len(outputs)} outputs")
    if len(inputs[0].shape) < 2:
        raise _refuse(model, "its input has no time axis (batch, time, ...)")
    layers = cached_model.cached_layers(model, _ACTION)
    names = [inputs[0].name, outputs[0], INDEX_NAME]
    names += [CACHE_PREFIX + layer.name for layer in layers]
    names += [UPDATED_CACHE_PREFIX + layer.name for layer in layers]
    if len(set(names)) != len(names):
        raise _refuse(model, f"its input/output names clash: {names}")
    return DecodeStep(model, inputs[0], outputs[0], layers, max_length)


# -- verification -------------------------------------------------------------


def teacher_inputs(step: DecodeStep, batch: int, seed: int = 0) -> np.ndarray:
    """A whole random input sequence (batch, max_length, ...) without padding.

    Token ids are in [1, vocabulary) (no 0: padding is not supported), float
    features standard normal.
    """
    rng = np.random.default_rng(seed)
    shape = (batch, step.max_length, *step.input.shape[2:])
    if "int" in step.input.dtype:
        values = rng.integers(1, max(vocabulary_size(step.model), 2), size=shape)
    elif step.input.dtype == "bool":
        values = np.ones(shape, bool)
    else:
        values = rng.standard_normal(shape)
    return values.astype(step.input.dtype)


def schedule(step: DecodeStep, sequence: np.ndarray, prompt_length: int):
    """The `_runtimes.Run` decoding `sequence`: the prompt, then one per step.

    The first step gets empty caches; later steps get the caches the step
    before returned (the run's feedback).
    """
    steps, index = [], 0
    while index < sequence.shape[1]:
        new = prompt_length if index == 0 else 1
        arrays = {
            step.input.name: sequence[:, index : index + new],
            INDEX_NAME: np.asarray(index, np.int32),
        }
        if index == 0:
            arrays.update(step.empty_caches(sequence.shape[0]))
        steps.append(arrays)
        index += new
    feedback = dict(zip(step.updated_cache_names, step.cache_names, strict=True))
    return _runtimes.Run(tuple(steps), feedback)


def _reference_call(target: ExportTarget):
    """`target.call_named`, under `jax.jit` on JAX: eagerly, every step's
    keys would have a new length (`cache_update_index` + new positions), and
    JAX compiles each op anew for each shape (about a second a step, most of
    an export's check). Compiled, the index is traced as in the exports (one
    program per input shape), with the model's variables as arguments."""
    if keras.backend.backend() != "jax":
        return target.call_named
    import jax

    variables = target.model.variables

    @jax.jit
    def stateless(values, arrays):
        mapping = list(zip(variables, values, strict=True))
        with keras.StatelessScope(state_mapping=mapping):
            return target.call_named(arrays)

    return lambda arrays: stateless([v.value for v in variables], arrays)


def keras_decode(step: DecodeStep, run: _runtimes.Run) -> list[dict[str, np.ndarray]]:
    """Keras's cached calls over `run` (eager; compiled on JAX, see
    `_reference_call`): the exports' reference."""
    results, state, target = [], {}, step.target()
    call = _reference_call(target)
    for arrays in run.steps:
        outputs = call({**arrays, **state})
        result = {k: keras.ops.convert_to_numpy(v) for k, v in outputs.items()}
        results.append(result)
        state = {inp: result[out] for out, inp in run.feedback.items()}
    return results


def verify_decode_step(
    model: keras.Model,
    saved_model_dir: str | os.PathLike | None = None,
    onnx_path: str | os.PathLike | None = None,
    *,
    max_length: int,
    litert_path: str | os.PathLike | None = None,
    openvino_path: str | os.PathLike | None = None,
    torch_path: str | os.PathLike | None = None,
    schedules: Sequence[tuple[int, int]] = DEFAULT_SCHEDULES,
    atol: float = DEFAULT_ATOL,
    rtol: float = DEFAULT_RTOL,
    seed: int = 0,
) -> ParityReport:
    """Decodes whole sequences step by step and compares every step.

    For each (batch, prompt length) in `schedules`, a random sequence of
    `max_length` positions (teacher forcing: the inputs are fixed, not
    generated) is decoded from empty caches: the prompt in one step, then
    one position per step. Rows of the report:

    - "keras_cache": Keras's cached calls, all steps' outputs concatenated,
      against the model's full uncached forward on the whole sequence.
    - "saved_model" / "onnx" / "litert" / "openvino" / "torch": each step's
      output and updated caches against Keras's cached call on the same
      inputs and caches, the export decoding in a fresh process of its
      runtime (caches fed back there).

    With no export given, only the "keras_cache" rows are computed
    (whether the model decodes at all).

    Returns:
        The `ParityReport`, every row within |err| <= atol + rtol |keras|.

    Raises:
        ParityError: beyond tolerance, or if an export's names differ.
        ValueError: for an unsupported model or argument.
    """
    step = build_decode_step(model, max_length)
    atol = check_tolerance("atol", atol)
    rtol = check_tolerance("rtol", rtol)
    paths = artifact_paths(
        saved_model_dir, onnx_path, litert_path, openvino_path, torch_path
    )
    artifacts = (
        {} if all(p is None for p in paths.values()) else collect_artifacts(paths)
    )
    runs, expected, labels, rows = [], [], [], []
    for number, (batch, prompt) in enumerate(schedules):
        prompt = min(prompt, step.max_length)
        label = f"{batch}x{step.max_length} prompt {prompt}"
        sequence = teacher_inputs(step, batch, seed + number)
        run = schedule(step, sequence, prompt)
        steps = keras_decode(step, run)
        full = keras.ops.convert_to_numpy(model(sequence, training=False))
        cached = np.concatenate([r[step.output_name] for r in steps], axis=1)
        rows.append(parity_row("keras_cache", label, [(full, cached)], atol, rtol))
        runs.append(run)
        expected.append(steps)
        labels.append(label)
    if artifacts:
        checked = check_artifacts(
            step.target(),
            artifacts,
            runs,
            expected,
            labels,
            atol,
            rtol,
            action="decoding {label}",
        )
        rows = [
            row for label in labels for row in [*rows, *checked] if row.shape == label
        ]
    worst = min(rows, key=lambda row: (row.ok, -row.max_abs_err))
    hint = (
        " (Keras's cached decode differs from the full forward: a layer "
        "outside SelfAttention mixes positions, so the model cannot be "
        "decoded step by step)"
        if worst.runtime == "keras_cache"
        else ""
    )
    return finish_report(rows, atol, rtol, "decode checks differ", hint)


# -- exporters ----------------------------------------------------------------


def export_decode_step(
    model: keras.Model,
    path: str | os.PathLike,
    export_format: str,
    *,
    max_length: int,
    name: str | None = None,
    version: int | None = None,
    models_config: bool = True,
    opset: int | None = None,
    check: bool = True,
    atol: float = DEFAULT_ATOL,
    rtol: float = DEFAULT_RTOL,
) -> str:
    """Exports the decoding step in any format, checked before it appears.

    The step (`DecodeStep.target()`) goes through the same staging,
    conversion and fresh-process check as the model's forward export; only
    the check differs: whole sequences decoded step by step
    (`verify_decode_step`).

    Args:
        model: See the module docstring for the supported structures.
        path: The SavedModel base dir ("saved_model": `path/name/VERSION/`,
            signature "decode_step") or the file to create.
        export_format: "saved_model", "onnx", "litert", "openvino" or "torch".
        max_length: The caches' length (the longest sequence decoded).
        name, version, models_config: The SavedModel's (as in
            `export_saved_model`); `name` is required there.
        opset: ONNX opset, 13 to 18 (ONNX only). Defaults to 17.
        check: Whether to verify the export before it appears.
        atol, rtol: Tolerances of that check.

    Returns:
        The version folder or the file.

    Raises:
        ValueError: for a backend that cannot export the format, an
            unsupported model, or an invalid argument.
        FileExistsError: if the target exists.
        ParityError: if the check fails (nothing is left on disk).
    """
    if export_format == table.LITERT.name and keras.backend.backend() == "torch":
        raise ValueError(
            "A decoding step exports to LiteRT from TensorFlow: litert-torch "
            "fixes every input's shape, and a step's number of new positions "
            "changes from prefill to decode. Save the model as .keras, load it "
            "under KERAS_BACKEND=tensorflow and export there. Received: "
            "export_format='litert' on the torch backend"
        )
    refuse_quantized(model, export_format, "decoding step")
    options = {}
    if export_format == table.SAVED_MODEL.name:
        options = {"name": name, "version": version, "models_config": models_config}
    elif export_format == table.ONNX.name:
        options = {"opset": opset}
    destination = pipeline.check_destination(export_format, path, **options)
    step = build_decode_step(model, max_length)

    def checked(staged: str) -> None:
        verify_decode_step(
            model,
            max_length=max_length,
            atol=atol,
            rtol=rtol,
            **{PATH_ARGUMENT[export_format]: staged},
        )

    return pipeline.export(step.target(), destination, checked if check else None)


def export_decode_step_saved_model(
    model: keras.Model,
    base_dir: str | os.PathLike,
    name: str,
    version: int | None = None,
    *,
    max_length: int,
    models_config: bool = True,
    check: bool = True,
    atol: float = DEFAULT_ATOL,
    rtol: float = DEFAULT_RTOL,
) -> str:
    """Exports the decoding step for TF Serving as `base_dir/name/VERSION/`.

    The SavedModel's signature "decode_step" (also under "serving_default")
    takes the model's input (batch, new, ...), one cache
    `cache_<layer>` (batch, 2, max_length, kv_heads, key_dim) per
    SelfAttention layer and the int32 scalar `cache_update_index`, and returns
    the model's output for the new positions and `updated_cache_<layer>`.
    Written beside the target and renamed into place after the check
    (`verify_decode_step`), under the version rules of `serving.layout`.
    TensorFlow and JAX backends (`export_decode_step`).

    Args:
        model: See the module docstring for the supported structures.
        base_dir, name, version, models_config: As in `export_saved_model`.
        max_length: The caches' length (the longest sequence decoded).
        check: Whether to verify the export before it appears.
        atol, rtol: Tolerances of that check.

    Returns:
        The version folder.

    Raises:
        ValueError: for a backend that cannot export a SavedModel, an
            unsupported model, an invalid name, version or max_length.
        FileExistsError: if the version exists.
        ParityError: if the check fails (nothing is left on disk).
    """
    options = {"name": name, "version": version, "models_config": models_config}
    checks = {"check": check, "atol": atol, "rtol": rtol}
    return export_decode_step(
        model,
        base_dir,
        table.SAVED_MODEL.name,
        max_length=max_length,
        **options,
        **checks,
    )


def export_decode_step_onnx(
    model: keras.Model,
    path: str | os.PathLike,
    *,
    max_length: int,
    opset: int | None = None,
    check: bool = True,
    atol: float = DEFAULT_ATOL,
    rtol: float = DEFAULT_RTOL,
) -> str:
    """Exports the decoding step to an ONNX file.

    Inputs and outputs are named as in `export_decode_step_saved_model`; axis
    0 is "batch", the new positions' axis "time" (the caches' max_length is
    fixed). The file passes `onnx.checker`, is written beside `path`, checked
    in onnxruntime (`verify_decode_step`) and linked into place.

    Args:
        model: See the module docstring.
        path: The ONNX file to create (never replaced).
        max_length: The caches' length.
        opset: ONNX opset, 13 to 18. Defaults to 17.
        check, atol, rtol: As in `export_decode_step_saved_model`.

    Returns:
        `path`, as a string.
    """
    checks = {"check": check, "atol": atol, "rtol": rtol}
    return export_decode_step(
        model, path, table.ONNX.name, max_length=max_length, opset=opset, **checks
    )
