"""Export a model's decoding step: new positions + caches + index -> output + caches.

A decoding step runs the model on the positions `index .. index + new - 1`
only, with one key/value cache per causal SelfAttention layer:

    inputs:  <model input>       (batch, new, ...)   the model's own input
             cache_<layer name>   (batch, 2, max_length, kv_heads, key_dim)
             cache_update_index   int32 scalar, the first new position
    outputs: <model output>       (batch, new, ...)   the new positions' outputs
             updated_cache_<layer name>              the caches after the step

`export_decode_step_saved_model` writes it for TF Serving
(`base_dir/name/VERSION/`, signature "decode_step", also aliased as
"serving_default"); `export_decode_step_onnx` converts the same
`tf.function` with tf2onnx (dynamic "batch" and "time" axes). Both check the
export before it appears with `verify_decode_step`: a whole sequence decoded
step by step (a prompt, then one position per step up to `max_length`)
through the export and through Keras's cached calls, and Keras's cached
calls against the model's full (uncached) forward.

Supported models: a Sequential model, or a Functional model with one named
`keras.Input` and one output, in which every SelfAttention is a top-level
layer with `causal=True`, called once on a single tensor without masks.
Any graph around them (Embedding, Dense, LayerNormalization, residual Adds)
works as long as it is position-wise: position t's output may depend on
earlier positions only through the SelfAttention layers. That is checked
numerically (the cached decode must equal the full forward), not assumed.
Refused with a ValueError: subclassed models, several inputs or outputs,
SelfAttention nested in another layer or called twice, non-causal layers,
padding masks (`mask_zero=True`, `Masking`). Exports need
KERAS_BACKEND=tensorflow (the step is a `tf.function` over the Keras layers).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterator, Mapping, Sequence

import keras
import numpy as np

from keras_selfattn.export import _files
from keras_selfattn.export._endpoint import NamedInput, _output_names, model_inputs
from keras_selfattn.export._inputs import vocabulary_size
from keras_selfattn.export.verify import (
    DEFAULT_ATOL,
    DEFAULT_RTOL,
    ParityError,
    ParityReport,
    ParityRow,
    _brief,
    _check_tolerance,
    _compare,
    require_saved_model_pb,
    session_runner,
    signature_runner,
)
from keras_selfattn.self_attention import SelfAttention

SIGNATURE_NAME = "decode_step"
INDEX_NAME = "cache_update_index"
CACHE_PREFIX = "cache_"
UPDATED_CACHE_PREFIX = "updated_cache_"
# (batch, prompt length) of the sequences `verify_decode_step` decodes: one
# position per step from the start, a prompt of 3, and the whole sequence in
# one step (prompts longer than max_length are cut to it).
DEFAULT_SCHEDULES: tuple[tuple[int, int], ...] = ((1, 1), (2, 3), (3, 1 << 30))

Runner = Callable[[Mapping[str, np.ndarray]], Mapping[str, np.ndarray]]


def require_tensorflow() -> None:
    """The one-line refusal off the TensorFlow backend (as in `_backends`)."""
    backend = keras.backend.backend()
    if backend != "tensorflow":
        raise ValueError(
            f"Decode-step export does not run on the {backend} backend (the "
            "step is traced as a tf.function over the Keras layers): save the "
            "model as .keras, load it under KERAS_BACKEND=tensorflow and "
            "export there"
        )


def _check_max_length(max_length: object) -> int:
    if (
        isinstance(max_length, bool)
        or not isinstance(max_length, int)
        or max_length < 1
    ):
        raise ValueError(
            "`max_length` must be a positive integer. "
            f"Received: max_length={max_length!r}"
        )
    return max_length


def _all_layers(model: keras.Model) -> list:
    layers, stack = [], list(model.layers)
    while stack:
        layer = stack.pop()
        layers.append(layer)
        stack.extend(getattr(layer, "_layers", None) or [])
    return layers


def _refuse(model: keras.Model, why: str) -> ValueError:
    return ValueError(
        f"Cannot export a decoding step of model {model.name!r}: {why} "
        "(supported: one input, one output, top-level causal SelfAttention "
        "layers each called once on one tensor, no padding masks)"
    )


def _attention_nodes(model: keras.Model) -> list[SelfAttention]:
    """The model's SelfAttention layers in call order; refuses the rest."""
    if isinstance(model, keras.Sequential):
        top = list(model.layers)
        calls = [layer for layer in top if isinstance(layer, SelfAttention)]
    else:
        top = list(model.layers)
        calls = []
        depths = sorted(model._nodes_by_depth, reverse=True)
        for depth in depths:
            for node in model._nodes_by_depth[depth]:
                if isinstance(node.operation, SelfAttention):
                    calls.append(node.operation)
                    tensors = [
                        value
                        for value in keras.tree.flatten(
                            (node.arguments.args, node.arguments.kwargs)
                        )
                        if isinstance(value, keras.KerasTensor)
                    ]
                    extra = {
                        k: v
                        for k, v in node.arguments.kwargs.items()
                        if v is not None and v is not False
                    }
                    if len(tensors) != 1 or extra:
                        raise _refuse(
                            model,
                            f"SelfAttention {node.operation.name!r} is called "
                            f"with more than one input tensor or with {sorted(extra)}",
                        )
    names = [layer.name for layer in calls]
    duplicated = sorted({name for name in names if names.count(name) > 1})
    if duplicated:
        raise _refuse(model, f"SelfAttention {duplicated} is called more than once")
    nested = [
        layer.name
        for layer in _all_layers(model)
        if isinstance(layer, SelfAttention) and layer not in top
    ]
    if nested:
        raise _refuse(model, f"SelfAttention {nested} is nested inside another layer")
    if not calls:
        raise _refuse(model, "it has no SelfAttention layer")
    for layer in calls:
        if not layer.causal:
            raise _refuse(model, f"SelfAttention {layer.name!r} has causal=False")
    masking = [
        layer.name
        for layer in _all_layers(model)
        if isinstance(layer, keras.layers.Masking) or getattr(layer, "mask_zero", 0)
    ]
    if masking:
        raise _refuse(
            model,
            f"layers {masking} make padding masks, which a step over the new "
            "positions cannot apply to the cached ones",
        )
    return calls


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
        by_layer = dict(zip(self.layers, caches, strict=True))
        updated = {}

        def call_layer(layer, *args, **kwargs):
            if not isinstance(layer, SelfAttention):
                return layer(*args, **kwargs)
            kwargs = {k: v for k, v in kwargs.items() if k not in ("mask",)}
            output, cache = layer(
                *args, cache=by_layer[layer], cache_update_index=index, **kwargs
            )
            updated[layer] = cache
            return output

        if isinstance(self.model, keras.Sequential):
            x = inputs
            for layer in self.model.layers:
                x = call_layer(layer, x)
            output = x
        else:
            output = self.model._run_through_graph(
                [inputs], operation_fn=lambda op: op, call_fn=call_layer
            )
            output = keras.tree.flatten(output)[0]
        return output, [updated[layer] for layer in self.layers]

    def call_named(self, arrays: Mapping[str, object]) -> dict[str, object]:
        """`call` on inputs keyed by name; outputs keyed by name."""
        output, caches = self.call(
            arrays[self.input.name],
            [arrays[name] for name in self.cache_names],
            arrays[INDEX_NAME],
        )
        return dict(zip(self.output_names, [output, *caches], strict=True))

    def tensor_specs(self) -> list:
        """`tf.TensorSpec`s of the inputs, in `input_names` order."""
        import tensorflow as tf

        specs = [
            tf.TensorSpec(
                (None, None, *self.input.shape[2:]),
                tf.as_dtype(self.input.dtype),
                name=self.input.name,
            )
        ]
        for name, layer in zip(self.cache_names, self.layers, strict=True):
            shape = (None, *tuple(layer.empty_cache(1, self.max_length).shape)[1:])
            specs.append(tf.TensorSpec(shape, tf.as_dtype(layer.compute_dtype), name))
        specs.append(tf.TensorSpec((), tf.int32, name=INDEX_NAME))
        return specs

    def tf_function(self):
        """The step as a `tf.function` with named inputs, returning a dict."""
        import tensorflow as tf

        names = self.input_names

        @tf.function(input_signature=self.tensor_specs())
        def decode_step(*tensors):
            return self.call_named(dict(zip(names, tensors, strict=True)))

        return decode_step


def build_decode_step(model: keras.Model, max_length: int) -> DecodeStep:
    """Checks the model's structure (module docstring) and builds its step.

    Raises:
        TypeError: if `model` is not a keras.Model.
        ValueError: for an unsupported model or `max_length`.
    """
    max_length = _check_max_length(max_length)
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
    layers = tuple(_attention_nodes(model))
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


def decode(
    run: Runner, step: DecodeStep, sequence: np.ndarray, prompt_length: int
) -> list[dict[str, np.ndarray]]:
    """Decodes `sequence` with `run`: the prompt, then one position per step.

    Returns:
        Every step's outputs keyed by name (caches as returned, fed back).
    """
    caches = step.empty_caches(sequence.shape[0])
    results, index = [], 0
    while index < sequence.shape[1]:
        new = prompt_length if index == 0 else 1
        arrays = {
            step.input.name: sequence[:, index : index + new],
            **caches,
            INDEX_NAME: np.asarray(index, np.int32),
        }
        result = {k: np.asarray(v) for k, v in run(arrays).items()}
        caches = {
            name: result[updated]
            for name, updated in zip(
                step.cache_names, step.updated_cache_names, strict=True
            )
        }
        results.append(result)
        index += new
    return results


def keras_runner(step: DecodeStep) -> Runner:
    """Keras's cached calls (eager), the reference of the exports."""

    def run(arrays):
        outputs = step.call_named(arrays)
        return {k: keras.ops.convert_to_numpy(v) for k, v in outputs.items()}

    return run


def saved_model_runner(directory: str, step: DecodeStep) -> Runner:
    """The SavedModel's "decode_step" signature (`tf.saved_model.load`)."""
    import tensorflow as tf

    require_saved_model_pb(directory)
    loaded = tf.saved_model.load(directory)
    return signature_runner(
        loaded,
        f"SavedModel {directory}",
        SIGNATURE_NAME,
        step.input_names,
        step.output_names,
        owner="decode step",
    )


def onnx_runner(path: str, step: DecodeStep) -> Runner:
    """The ONNX file in onnxruntime (CPU)."""
    import onnxruntime

    if not os.path.isfile(path):
        raise FileNotFoundError(f"ONNX file not found: {path}")
    session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
    return session_runner(
        session,
        f"ONNX model {path}",
        step.input_names,
        step.output_names,
        owner="decode step",
    )


def _row(runtime, label, pairs, atol, rtol) -> ParityRow:
    results = [_compare(want, have, atol, rtol) for want, have in pairs]
    return ParityRow(
        runtime,
        label,
        max(r[0] for r in results),
        max(r[1] for r in results),
        all(r[2] for r in results),
    )


def verify_decode_step(
    model: keras.Model,
    saved_model_dir: str | os.PathLike | None = None,
    onnx_path: str | os.PathLike | None = None,
    *,
    max_length: int,
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
    - "saved_model" / "onnx": each step's output and updated caches
      against Keras's cached call on the same inputs and caches.

    With neither export given, only the "keras_cache" rows are computed
    (whether the model decodes at all).

    Returns:
        The `ParityReport`, every row within |err| <= atol + rtol |keras|.

    Raises:
        ParityError: beyond tolerance, or if an export's names differ.
        ValueError: for an unsupported model or argument.
    """
    step = build_decode_step(model, max_length)
    atol = _check_tolerance("atol", atol)
    rtol = _check_tolerance("rtol", rtol)
    runners: dict[str, Runner] = {}
    if saved_model_dir is not None:
        runners["saved_model"] = saved_model_runner(os.fspath(saved_model_dir), step)
    if onnx_path is not None:
        runners["onnx"] = onnx_runner(os.fspath(onnx_path), step)
    reference = keras_runner(step)
    rows = []
    for number, (batch, prompt) in enumerate(schedules):
        prompt = min(prompt, step.max_length)
        label = f"{batch}x{step.max_length} prompt {prompt}"
        sequence = teacher_inputs(step, batch, seed + number)
        expected = decode(reference, step, sequence, prompt)
        full = keras.ops.convert_to_numpy(model(sequence, training=False))
        cached = np.concatenate([r[step.output_name] for r in expected], axis=1)
        rows.append(_row("keras_cache", label, [(full, cached)], atol, rtol))
        for runtime, run in runners.items():
            try:
                actual = decode(run, step, sequence, prompt)
            except Exception as error:
                raise ParityError(
                    f"{runtime} failed decoding {label} where Keras runs: "
                    f"{_brief(error)}",
                    ParityReport(tuple(rows), atol, rtol),
                ) from error
            pairs = [
                (want[name], have[name])
                for want, have in zip(expected, actual, strict=True)
                for name in step.output_names
            ]
            rows.append(_row(runtime, label, pairs, atol, rtol))
    report = ParityReport(tuple(rows), atol, rtol)
    if not report.ok:
        worst = max(report.failures, key=lambda row: row.max_abs_err)
        hint = (
            " (Keras's cached decode differs from the full forward: a layer "
            "outside SelfAttention mixes positions, so the model cannot be "
            "decoded step by step)"
            if worst.runtime == "keras_cache"
            else ""
        )
        raise ParityError(
            f"{len(report.failures)} of {len(rows)} decode checks differ beyond "
            f"atol={atol:g}, rtol={rtol:g}; worst: {worst.runtime} on "
            f"{worst.shape}, max abs err {worst.max_abs_err:.3g}{hint}",
            report,
        )
    return report


# -- exporters ----------------------------------------------------------------


@contextlib.contextmanager
def stage_saved_model(
    model: keras.Model,
    base_dir: str | os.PathLike,
    name: str,
    version: int | None = None,
    *,
    max_length: int,
    models_config: bool = True,
) -> Iterator[_files.Staged]:
    """Writes the SavedModel into a hidden folder, moved into place after the block.

    Arguments as in `export_decode_step_saved_model`; an exception in the
    block removes the folder (see `saved_model.stage_saved_model`).
    """
    from keras_selfattn.export.saved_model import check_target, stage_version

    require_tensorflow()
    target = check_target(base_dir, name, version)
    step = build_decode_step(model, max_length)
    with stage_version(
        base_dir,
        target,
        lambda tmp: write_saved_model(step, tmp),
        models_config=models_config,
    ) as staged:
        yield staged


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

    Args:
        model: See the module docstring for the supported structures.
        base_dir, name, version, models_config: As in `export_saved_model`.
        max_length: The caches' length (the longest sequence decoded).
        check: Whether to verify the export before it appears.
        atol, rtol: Tolerances of that check.

    Returns:
        The version folder.

    Raises:
        ValueError: for a backend other than TensorFlow, an unsupported model,
            an invalid name, version or max_length.
        FileExistsError: if the version exists.
        ParityError: if the check fails (nothing is left on disk).
    """
    with stage_saved_model(
        model,
        base_dir,
        name,
        version,
        max_length=max_length,
        models_config=models_config,
    ) as staged:
        if check:
            verify_decode_step(
                model, staged.path, max_length=max_length, atol=atol, rtol=rtol
            )
    return staged.target


def write_saved_model(step: DecodeStep, directory: str) -> None:
    """Writes the step's SavedModel (signatures "decode_step", "serving_default")."""
    archive = keras.export.ExportArchive()
    archive.track(step.model)
    names = step.input_names
    archive.add_endpoint(
        SIGNATURE_NAME,
        lambda *tensors: step.call_named(dict(zip(names, tensors, strict=True))),
        input_signature=step.tensor_specs(),
    )
    archive.write_out(directory, verbose=False)


def convert_to_onnx(step: DecodeStep, opset: int):
    """Converts the step's `tf.function` with tf2onnx; names dynamic axes."""
    import tf2onnx

    from keras_selfattn.export import onnx_export_module
    from keras_selfattn.export._xla_update_slice import CUSTOM_OP_HANDLERS

    function = step.tf_function()
    proto, _ = tf2onnx.convert.from_function(
        function,
        input_signature=step.tensor_specs(),
        opset=opset,
        custom_op_handlers=CUSTOM_OP_HANDLERS,
    )
    return onnx_export_module().name_dynamic_axes(proto)


@contextlib.contextmanager
def stage_onnx(
    model: keras.Model,
    path: str | os.PathLike,
    *,
    max_length: int,
    opset: int | None = None,
) -> Iterator[_files.Staged]:
    """Converts and writes the file beside `path`, linked in after the block."""
    from keras_selfattn.export import onnx_export_module

    onnx_export = onnx_export_module()

    require_tensorflow()
    opset = onnx_export.check_opset(opset)
    path = onnx_export.check_target(path)
    step = build_decode_step(model, max_length)
    with onnx_export.stage_proto(convert_to_onnx(step, opset), path) as staged:
        yield staged


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
    """Exports the decoding step to an ONNX file through tf2onnx.

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
    with stage_onnx(model, path, max_length=max_length, opset=opset) as staged:
        if check:
            verify_decode_step(
                model,
                onnx_path=staged.path,
                max_length=max_length,
                atol=atol,
                rtol=rtol,
            )
    return staged.target
