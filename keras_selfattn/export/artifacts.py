"""File exports (LiteRT, OpenVINO IR, torch .pt2, ONNX): checks, writing, staging.

Each is written by Keras's own `model.export` on the `ExportTarget`
(`ExportTarget.keras_model()`) into a hidden folder beside its target
(`_files.atomic_files`) and linked into place after its check (see
`pipeline`); a failure leaves nothing. What this module adds to Keras's
exporters: named inputs and outputs, dynamic "batch" and "time" dimensions
for `torch.export` (Keras traces fixed sizes unless told), and one-line
refusals where Keras has no route (`_backends`). ONNX on TensorFlow is
converted by `onnx_export` (tf2onnx) and staged here too.

The runtimes are imported on first use; a missing one is named with its
install extra (`require_runtime`).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import warnings
from collections.abc import Callable, Iterator

import keras

from keras_selfattn.export import _backends, _files
from keras_selfattn.export._runtimes import LITERT, ONNX, OPENVINO, TORCH
from keras_selfattn.export._target import ExportTarget
from keras_selfattn.export.verify import is_shape

# The file name each format's target must end with.
SUFFIX = {LITERT: ".tflite", OPENVINO: ".xml", TORCH: ".pt2"}
# The packages each format's export imports, and the extra that installs them.
_NEEDS = {
    ONNX: (("onnx", "tf2onnx", "onnxruntime"), "onnx"),
    LITERT: (("ai_edge_litert",), "litert"),
    OPENVINO: (("openvino",), "openvino"),
}
_NEEDS_ON = {
    (ONNX, "jax"): ("jax2onnx",),
    (ONNX, "torch"): ("onnxscript",),
    (LITERT, "torch"): ("litert_torch",),
}


def require_runtime(export_format: str) -> None:
    """Imports what exporting `export_format` here needs, or says what to install.

    Raises:
        ImportError: one line naming the missing package and the extra.
    """
    if export_format not in _NEEDS:
        return
    modules, extra = _NEEDS[export_format]
    modules += _NEEDS_ON.get((export_format, keras.backend.backend()), ())
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as error:
            raise ImportError(
                f"{_backends.TITLE[export_format]} export needs {module} ({error}). "
                f"Install it with: pip install 'keras_selfattn[{extra}]'"
            ) from error


def artifact_files(path: str, export_format: str) -> list[str]:
    """The files an export at `path` consists of (OpenVINO: .xml and .bin)."""
    if export_format == OPENVINO:
        return [path, path[: -len(SUFFIX[OPENVINO])] + ".bin"]
    return [path]


def check_file_target(
    path: str | os.PathLike, export_format: str, *, argument: str = "path"
) -> str:
    """Checks a file export's target before any work; returns it as a str.

    Args:
        path: The file to create.
        export_format: `_runtimes.ONNX`, `LITERT`, `OPENVINO` or `TORCH`.
        argument: How the caller names `path` in errors (the CLI: "--litert").

    Raises:
        ValueError: for a backend that cannot export the format (see
            `_backends`), an empty path, a folder, or a wrong suffix.
        FileExistsError: if one of its files exists.
    """
    _backends.require_backend(export_format)
    path = _files.check_path(argument, path)
    if path.endswith(("/", os.sep)):
        raise ValueError(
            f"`{argument}` must name a file, not a folder. "
            f"Received: {argument}={path!r}"
        )
    suffix = SUFFIX.get(export_format)
    if suffix and not path.endswith(suffix):
        raise ValueError(
            f"`{argument}` must end with {suffix!r} "
            f"({_backends.TITLE[export_format]}). Received: {argument}={path!r}"
        )
    for file in artifact_files(path, export_format):
        _files.refuse_existing(file, "Output file")
    return path


def check_shape(shape: object) -> tuple[int, int] | None:
    """Returns a fixed (batch, time) shape, or None (dynamic).

    Raises:
        ValueError: if it is not None or a pair of positive ints.
    """
    if shape is None:
        return None
    if not is_shape(shape):
        raise ValueError(
            "`shape` must be None or a (batch, time) pair of positive ints. "
            f"Received: shape={shape!r}"
        )
    return (shape[0], shape[1])


@contextlib.contextmanager
def stage_file(
    path: str, export_format: str, write: Callable[[str], None]
) -> Iterator[_files.Staged]:
    """Stages a file export: `write` fills it in a hidden folder beside `path`.

    The block sees the export at `staged.path` (same base name as `path`,
    so OpenVINO's .xml finds its .bin); after the block its files are linked
    into place, and an exception in the block removes them all.
    """
    with _files.atomic_files(artifact_files(path, export_format)) as folder:
        staged = os.path.join(folder, os.path.basename(path))
        write(staged)
        yield _files.Staged(staged, path)


def _fixed(target: ExportTarget, shape: tuple[int, int]) -> list:
    """`target.input_signature()` with every dynamic dim set from `shape`."""
    batch, time = shape
    return [
        [
            keras.InputSpec(
                shape=tuple(
                    (batch if axis == 0 else time) if dim is None else dim
                    for axis, dim in enumerate(spec.shape)
                ),
                dtype=spec.dtype,
                name=spec.name,
            )
            for spec in target.inputs
        ]
    ]


def _torch_dynamic_shapes(target: ExportTarget) -> list:
    """`torch.export` dims: axis 0 "batch", other dynamic axes one "time"."""
    import torch

    dims = {
        "batch": torch.export.Dim("batch"),
        "time": torch.export.Dim("time"),
    }
    per_input = [
        {
            axis: dims[name]
            for axis, name in enumerate(spec.axis_names())
            if name in dims
        }
        or None
        for spec in target.inputs
    ]
    return [(per_input,)]  # Keras's module takes one positional list


def write(
    target: ExportTarget,
    path: str,
    export_format: str,
    *,
    shape: tuple[int, int] | None = None,
    opset: int | None = None,
) -> None:
    """Writes `target` to `path` with Keras's `model.export`.

    Args:
        target: What to export.
        path: The file (its suffix as `SUFFIX` says).
        export_format: `ONNX`, `LITERT`, `OPENVINO` or `TORCH`.
        shape: A fixed (batch, time) for the inputs' dynamic dims, or None
            to keep them dynamic (LiteRT from torch needs one).
        opset: The ONNX opset (ONNX only).
    """
    if export_format == OPENVINO:
        _write_openvino(target, path)
        return
    signature = target.input_signature() if shape is None else _fixed(target, shape)
    options = {}
    if export_format == TORCH and shape is None:
        options["dynamic_shapes"] = _torch_dynamic_shapes(target)
    if export_format == ONNX and opset is not None:
        options["opset_version"] = opset
    model = target.keras_model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.export(
            path,
            format=export_format,
            verbose=False,
            input_signature=signature,
            **options,
        )


def _write_openvino(target: ExportTarget, path: str) -> None:
    """OpenVINO IR of `target`, its inputs and outputs named like the target's.

    On TensorFlow, OpenVINO converts the target's `tf.function` (the
    converter Keras uses, but on a function returning only the outputs:
    Keras's own export adds stray outputs there). On torch, Keras's export
    traces the model; its tensors get the target's names (Keras leaves
    "input").
    """
    import openvino

    if keras.backend.backend() == "tensorflow":
        model = openvino.convert_model(target.tf_function().get_concrete_function())
    else:
        traced = path[: -len(SUFFIX[OPENVINO])] + ".keras.xml"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            target.keras_model().export(
                traced,
                format=OPENVINO,
                verbose=False,
                input_signature=target.input_signature(),
            )
        model = openvino.Core().read_model(traced)
    for ports, names in (
        (model.inputs, target.input_names),
        (model.outputs, target.output_names),
    ):
        for port, name in zip(ports, names, strict=True):
            port.get_tensor().set_names({name})
    openvino.save_model(model, path, compress_to_fp16=False)


def require_dynamic_litert() -> None:
    """Refuses dynamic LiteRT shapes where Keras's route fixes them (torch).

    Raises:
        ValueError: on the torch backend, naming the two ways that work.
    """
    if keras.backend.backend() == "torch":
        raise ValueError(
            "LiteRT export on the torch backend has fixed input shapes "
            "(litert-torch): pass shape=(batch, time) (CLI: --litert-shape "
            "BATCH,TIME), or export under KERAS_BACKEND=tensorflow for dynamic "
            "shapes. Received: shape=None"
        )
