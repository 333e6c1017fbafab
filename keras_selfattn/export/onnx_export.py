"""Export to ONNX, checked by onnx.checker and onnxruntime.

The steps are separate functions so passes can be added between conversion
and checking (e.g. fusing attention into ONNX's Attention operator):
conversion (tf2onnx on TensorFlow, `convert_to_onnx`; Keras's own exporter
on JAX and torch) -> `name_dynamic_axes` -> [further passes] ->
`onnx.checker` -> write beside the target (`stage_target`) -> numeric check
in a fresh onnxruntime process (`verify`) -> link into place.
`check_target` is the argument check run before any work (by the CLI too).
TensorFlow and tf2onnx are imported on use.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping, Sequence

import keras
import onnx

from keras_selfattn import _checks
from keras_selfattn.export import (
    _backends,
    _files,
    artifacts,
    fused_attention,
    pipeline,
)
from keras_selfattn.export._endpoint import Endpoint, build_endpoint
from keras_selfattn.export._runtimes import ONNX
from keras_selfattn.export._target import BATCH_AXIS, TIME_AXIS, ExportTarget
from keras_selfattn.export._xla_update_slice import CUSTOM_OP_HANDLERS
from keras_selfattn.export.verify import DEFAULT_ATOL, DEFAULT_RTOL, verify

DEFAULT_OPSET = 17
# tf2onnx 1.17 converts up to opset 18; below 13 it lacks ops these models use.
MIN_OPSET = 13
MAX_OPSET = 18


def check_opset(opset: object) -> int | None:
    """Returns the opset to use.

    None means `DEFAULT_OPSET` on TensorFlow (tf2onnx) and the converter's
    own default on JAX and torch (jax2onnx writes newer ops than opset 17
    allows when told 17), where None is returned.

    Raises:
        ValueError: if `opset` is not an int in [MIN_OPSET, MAX_OPSET].
    """
    if opset is None:
        return DEFAULT_OPSET if keras.backend.backend() == "tensorflow" else None
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


def convert_to_onnx(target: ExportTarget, opset: int) -> onnx.ModelProto:
    """Converts the target's `tf.function` with tf2onnx (TensorFlow backend).

    Inputs keep the target's input names (through named TensorSpecs) and
    outputs get its output names (the keys of the returned dict). The key/
    value cache write of a decoding step converts through
    `_xla_update_slice.CUSTOM_OP_HANDLERS`.
    """
    import tf2onnx

    proto, _ = tf2onnx.convert.from_function(
        target.tf_function(),
        input_signature=target.tf_specs(),
        opset=opset,
        custom_op_handlers=CUSTOM_OP_HANDLERS,
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


def name_outputs(proto: onnx.ModelProto, names: Sequence[str]) -> onnx.ModelProto:
    """Gives the graph's outputs `names`, in order, through Identity nodes.

    Keras's jax2onnx route names outputs after the last op ("add_out_4").
    """
    for output, name in zip(proto.graph.output, names, strict=True):
        if output.name != name:
            proto.graph.node.append(
                onnx.helper.make_node("Identity", [output.name], [name])
            )
            output.name = name
    return proto


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
    return artifacts.check_file_target(path, ONNX, argument=argument)


@contextlib.contextmanager
def stage_target(
    target: ExportTarget,
    path: str,
    opset: int | None,
    *,
    fuse: Endpoint | None = None,
) -> Iterator[_files.Staged]:
    """Converts `target` and writes it beside `path`, linked in after the block.

    On TensorFlow through tf2onnx, on JAX and torch through Keras's
    `model.export(format="onnx")` (jax2onnx, torch.onnx); then dynamic axes
    are named "batch" and "time", the model passes `onnx.checker`, and the
    block sees the file at `staged.path` (e.g. to `verify` it). An exception
    in the block removes it.

    Args:
        target: What to export.
        path: The checked target (from `check_target`).
        opset: The checked opset (`check_opset`; None off TensorFlow for
            the converter's default).
        fuse: The endpoint whose SelfAttention calls become ONNX Attention
            nodes (`fused_attention`; TensorFlow only), or None.
    """
    if fuse is not None:
        _backends.require_backend(_backends.FUSED_ONNX)

    def write(staged: str) -> None:
        if keras.backend.backend() == "tensorflow":
            proto = convert_to_onnx(target, opset)
        else:
            artifacts.write(target, staged, ONNX, opset=opset)
            proto = name_outputs(onnx.load(staged), target.output_names)
        proto = name_dynamic_axes(proto)
        if fuse is not None:
            proto, _ = fused_attention.fuse_attention(proto, fuse)
        onnx.checker.check_model(proto, full_check=True)
        onnx.save(proto, staged)

    with artifacts.stage_file(path, ONNX, write) as staged:
        yield staged


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

    Arguments as in `export_onnx`; see `stage_target`.

    Example:

    >>> with stage_onnx(model, "model.onnx") as staged:  # doctest: +SKIP
    ...     verify(model, onnx_path=staged.path)
    """
    fuse_attention = _checks.boolean("fuse_attention", fuse_attention)
    destination = pipeline.check_destination(ONNX, path, opset=opset)
    endpoint = build_endpoint(model, attention_outputs)
    fuse = endpoint if fuse_attention else None
    with pipeline.stage(endpoint.target(), destination, fuse=fuse) as staged:
        yield staged


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
    """Exports `model` to an ONNX file (tf2onnx; jax2onnx / torch.onnx via Keras).

    Inputs and outputs are named like the model's, with dynamic axes named
    "batch" and "time"; integer and boolean inputs keep their dtypes. Before
    the file appears at `path`, the model passes `onnx.checker` and (with
    `check`) runs in onnxruntime on several shapes, compared with Keras. The
    file is written beside `path` and linked into place, so a failure leaves
    nothing at `path`; an existing file is never replaced. On TensorFlow the
    conversion is tf2onnx's; on JAX and torch Keras's own
    `model.export(format="onnx")`, whose outputs get the model's names.

    Args:
        model: A Functional or Sequential model with named `keras.Input`s.
        path: The ONNX file to create; missing parent folders are created.
        opset: ONNX opset, 13 to 18. Defaults to 17 on TensorFlow, to the
            converter's own on JAX and torch.
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
            or `fuse_attention` off the TensorFlow backend.
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
