"""Export to ONNX through tf2onnx, checked by onnx.checker and onnxruntime.

The steps are separate functions so passes can be added between conversion
and checking (e.g. fusing attention into ONNX's Attention operator):
`convert_to_onnx` -> `name_dynamic_axes` -> [further passes] -> `onnx.checker`
-> write beside the target (`stage_onnx`) -> numeric check in onnxruntime
(`verify`) -> link into place. `check_target` is the argument check run
before any work (by the CLI too). TensorFlow and tf2onnx are imported on use.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping

import keras
import onnx

from keras_selfattn import _checks
from keras_selfattn.export import _backends, _files, fused_attention
from keras_selfattn.export._endpoint import (
    BATCH_AXIS,
    TIME_AXIS,
    Endpoint,
    build_endpoint,
)
from keras_selfattn.export.verify import DEFAULT_ATOL, DEFAULT_RTOL, verify

DEFAULT_OPSET = 17
# tf2onnx 1.17 converts up to opset 18; below 13 it lacks ops these models use.
MIN_OPSET = 13
MAX_OPSET = 18


def check_opset(opset: object) -> int:
    """Returns the opset to use (`DEFAULT_OPSET` for None).

    Raises:
        ValueError: if `opset` is not an int in [MIN_OPSET, MAX_OPSET].
    """
    if opset is None:
        return DEFAULT_OPSET
    if (
        isinstance(opset, bool)
        or not isinstance(opset, int)
        or not MIN_OPSET <= opset <= MAX_OPSET
    ):
        raise ValueError(
            f"Unsupported ONNX opset {opset!r}: supported opsets are "
            f"{MIN_OPSET} to {MAX_OPSET} (tf2onnx's maximum). Received: opset={opset!r}"
        )
    return opset


def convert_to_onnx(endpoint: Endpoint, opset: int) -> onnx.ModelProto:
    """Converts the endpoint's graph with tf2onnx.

    Inputs keep the model's input names (through named TensorSpecs) and
    outputs get the endpoint's output names (the keys of the returned dict).
    """
    import tensorflow as tf
    import tf2onnx

    specs = [
        tf.TensorSpec(spec.shape, tf.as_dtype(spec.dtype), name=spec.name)
        for spec in endpoint.inputs
    ]
    names = endpoint.output_names

    @tf.function(input_signature=specs)
    def forward(*tensors):
        outputs = endpoint.model(list(tensors), training=False)
        return dict(zip(names, keras.tree.flatten(outputs), strict=True))

    proto, _ = tf2onnx.convert.from_function(
        forward, input_signature=specs, opset=opset
    )
    return proto


def name_dynamic_axes(proto: onnx.ModelProto) -> onnx.ModelProto:
    """Names the dynamic axes of graph inputs and outputs "batch" and "time".

    Axis 0 is "batch" and every other dynamic axis is "time" (see
    `_endpoint.TIME_AXIS`). Fixed axes keep their sizes.
    """
    for value_info in [*proto.graph.input, *proto.graph.output]:
        for index, dim in enumerate(value_info.type.tensor_type.shape.dim):
            if not dim.HasField("dim_value"):
                dim.dim_param = BATCH_AXIS if index == 0 else TIME_AXIS
    return proto


def _write_onnx(proto: onnx.ModelProto, path: str) -> None:
    """Serializes the model to `path` (a temporary beside the target)."""
    onnx.save(proto, path)


def check_target(path: str | os.PathLike, *, argument: str = "path") -> str:
    """Checks an ONNX export's target before any work; returns it as a str.

    Args:
        path: The ONNX file to create.
        argument: How the caller names `path` in errors (the CLI: "--onnx").

    Raises:
        ValueError: for a backend that cannot export ONNX (see `_backends`),
            an empty path or one ending in a separator.
        FileExistsError: if `path` exists.
    """
    _backends.require_backend(_backends.ONNX)
    path = _files.check_path(argument, path)
    if path.endswith(("/", os.sep)):
        raise ValueError(
            f"`{argument}` must name a file, not a folder. "
            f"Received: {argument}={path!r}"
        )
    _files.refuse_existing(path, "Output file")
    return path


@contextlib.contextmanager
def stage_onnx(
    model: keras.Model,
    path: str | os.PathLike,
    opset: int | None = None,
    *,
    attention_outputs: str | Mapping[str, str] | None = None,
    fuse_attention: bool = False,
) -> Iterator[_files.Staged]:
    """Converts and writes the file beside `path`, linked in after the block.

    Arguments as in `export_onnx`. The model passes `onnx.checker` before it
    is written; the block sees the file at `staged.path` (e.g. to `verify`
    it), and an exception in the block removes it.

    Example:

    >>> with stage_onnx(model, "model.onnx") as staged:  # doctest: +SKIP
    ...     verify(model, onnx_path=staged.path)
    """
    opset = check_opset(opset)
    fuse_attention = _checks.boolean("fuse_attention", fuse_attention)
    path = check_target(path)
    endpoint = build_endpoint(model, attention_outputs)
    proto = convert_to_onnx(endpoint, opset)
    proto = name_dynamic_axes(proto)
    if fuse_attention:
        proto, _ = fused_attention.fuse_attention(proto, endpoint)
    with stage_proto(proto, path) as staged:
        yield staged


@contextlib.contextmanager
def stage_proto(proto: onnx.ModelProto, path: str) -> Iterator[_files.Staged]:
    """Checks `proto` with `onnx.checker` and writes it beside `path`.

    The block sees the file at `staged.path`; it is linked to `path` after
    the block, and an exception in the block removes it.

    Args:
        proto: The converted model.
        path: The checked target (from `check_target`).
    """
    onnx.checker.check_model(proto, full_check=True)
    with _files.atomic_file(path) as tmp:
        _write_onnx(proto, tmp)
        yield _files.Staged(tmp, path)


def export_onnx(
    model: keras.Model,
    path: str | os.PathLike,
    opset: int | None = None,
    *,
    attention_outputs: str | Mapping[str, str] | None = None,
    fuse_attention: bool = False,
    check: bool = True,
    atol: float = DEFAULT_ATOL,
    rtol: float = DEFAULT_RTOL,
) -> str:
    """Exports `model` to an ONNX file through tf2onnx.

    Inputs and outputs are named like the model's, with dynamic axes named
    "batch" and "time"; integer and boolean inputs keep their dtypes. Before
    the file appears at `path`, the model passes `onnx.checker` and (with
    `check`) runs in onnxruntime on several shapes, compared with Keras. The
    file is written beside `path` and linked into place, so a failure leaves
    nothing at `path`; an existing file is never replaced. Needs the
    TensorFlow backend.

    Args:
        model: A Functional or Sequential model with named `keras.Input`s.
        path: The ONNX file to create; missing parent folders are created.
        opset: ONNX opset, 13 to 18. Defaults to 17.
        attention_outputs: As in `export_saved_model`: a SelfAttention layer
            name (output "attention_weights") or {layer name: output name}.
        fuse_attention: If True, the model is upgraded to opset 23 and each
            SelfAttention call becomes one ONNX `Attention` node (see
            `keras_selfattn.export.fused_attention`); a layer that cannot be
            fused keeps its decomposed form and is logged with the reason.
        check: Whether to run the onnxruntime comparison (see `verify`).
        atol, rtol: Tolerances of that check.

    Returns:
        `path`, as a string.

    Raises:
        ValueError: for an unsupported opset, an invalid model input name,
            or a backend other than TensorFlow.
        FileExistsError: if `path` exists (left untouched).
        ParityError: if onnxruntime's results differ from Keras.

    Example:

    >>> from keras_selfattn.export import export_onnx  # doctest: +SKIP
    >>> export_onnx(model, "artifacts/model.onnx", opset=17)  # doctest: +SKIP
    'artifacts/model.onnx'
    """
    with stage_onnx(
        model,
        path,
        opset,
        attention_outputs=attention_outputs,
        fuse_attention=fuse_attention,
    ) as staged:
        if check:
            verify(
                model,
                onnx_path=staged.path,
                attention_outputs=attention_outputs,
                atol=atol,
                rtol=rtol,
            )
    return staged.target
