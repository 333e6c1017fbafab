"""ONNX: tf2onnx on TensorFlow, Keras's jax2onnx / torch.onnx route elsewhere.

Conversion (tf2onnx's missing conversions: `tf2onnx_handlers`) ->
dynamic axes named "batch" and "time" -> (`fuse_attention`:
each SelfAttention core becomes one ONNX `Attention` node) -> quantized
layers stored as Keras's integers on ONNX Runtime's integer kernels
(`integer`) -> `onnx.checker` -> the file. TensorFlow and tf2onnx are
imported on use.

Weights: the conversion sees them as graph inputs, never as constants
(`convert_to_onnx`), so no graph TensorFlow or tf2onnx builds holds them
and the model holds them once. Protobuf serializes at most 2 GiB, so a
model whose weights come near it is written with its weights as ONNX
external data: `model.onnx` beside one file `model.onnx.data`
(`external_data_file`), which ONNX Runtime reads from the .onnx file's path
alone, each weight written there as it is converted (`external`). Smaller
models stay one file.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import keras
import numpy as np

from keras_selfattn import _checks, tracing
from keras_selfattn.attention.cache import ConverterCache
from keras_selfattn.export import quantization
from keras_selfattn.export.formats._base import (
    APART_BYTES,
    Format,
    converting,
    weight_bytes,
)
from keras_selfattn.export.formats.onnx import external
from keras_selfattn.export.signature import BATCH_AXIS, TIME_AXIS, Signature
from keras_selfattn_runtimes import table

if TYPE_CHECKING:  # onnx is an extra, imported when a file is written
    import onnx

DEFAULT_OPSET = 17
# The opset of BitwiseAnd, which tf2onnx writes for the unpacking of 4-bit
# codes that `integer.rewrite` leaves (a generator's loop body), and the
# modes that store them.
NIBBLE_OPSET = 18
NIBBLE_MODES = ("int4", "gptq", "awq")
# `int8_matmul`: the default, and "vnni", deprecated (the default file probes
# the CPU and runs uint8 x int8 where exact: `int8_layers`).
INT8_MATMUL, DEPRECATED_INT8_MATMUL = "any_cpu", "vnni"
# `int4_inputs`: the 4-bit layers' inputs as Keras computes them (float, the
# default), or rounded to int8 in the weights' blocks (`integer.rewrite`).
INT4_INPUTS = ("float", "int8")
# tf2onnx 1.17 converts up to opset 18; below 13 it lacks ops these models use.
MIN_OPSET = 13
MAX_OPSET = 18
# The backend whose graph the fused-Attention rewrite reads (tf2onnx's names).
FUSED_BACKEND = "tensorflow"
# Tensor bytes from which the file keeps its weights as external data.
EXTERNAL_DATA_BYTES = APART_BYTES
# Tensors this large or larger go to the external data file.
_EXTERNAL_TENSOR_BYTES = 1024


def check_opset(opset: object, backend: str | None = None) -> int | None:
    """Returns the opset to use on `backend` (default: this process's).

    None means `DEFAULT_OPSET` on TensorFlow (tf2onnx) and the converter's
    own default on JAX and torch (jax2onnx writes newer ops than opset 17
    allows when told 17), where None is returned.

    Raises:
        ValueError: if `opset` is not an int in [MIN_OPSET, MAX_OPSET].
    """
    if opset is None:
        backend = backend or keras.backend.backend()
        return DEFAULT_OPSET if backend == "tensorflow" else None
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


def convert_to_onnx(
    target: Signature, opset: int, weights: external.WeightFile | None = None
) -> onnx.ModelProto:
    """Converts the target's `tf.function` with tf2onnx (TensorFlow backend).

    Inputs keep the target's input names (through named TensorSpecs) and
    outputs get its output names (the keys of the returned dict). The key/
    value cache write of a decoding step converts through
    `CUSTOM_OP_HANDLERS`.

    The weights never enter the graphs TensorFlow and tf2onnx convert
    (`conversion`): they are graph inputs there, and each becomes an
    initializer of the returned model afterwards, named as the input was.
    A tensor the trace captured otherwise (a constant the model computed
    when built, as keras-hub's `GemmaBackbone` does its embedding scale) is
    stored the same way. The returned model holds the weights once, in
    memory, or, given `weights`, in its file (the model's weights past 2
    GiB: `external`).
    """
    import tensorflow as tf
    from onnx import numpy_helper
    from tf2onnx import tf_loader
    from tf2onnx.convert import tensor_names_from_structed
    from tf2onnx.tf_utils import compress_graph_def
    from tf2onnx.tfonnx import process_tf_graph

    from keras_selfattn.export.formats.onnx import conversion, tf2onnx_handlers

    concrete = conversion.traced(target)
    inputs = [tensor.name for tensor in concrete.inputs]
    outputs = [tensor.name for tensor in concrete.outputs]
    renames = tensor_names_from_structed(
        concrete, inputs[: len(target.inputs)], outputs
    )
    with tf.device("/cpu:0"):
        graph_def = conversion.graph_def(concrete, inputs, outputs)
        with tf.Graph().as_default() as graph:
            # Constants the trace computed (a quantized layer's kernel) stay
            # out of TensorFlow's graph, which protobuf limits to 2 GiB.
            constants = compress_graph_def(graph_def)
            tf.import_graph_def(graph_def, name="")

            def process():
                return process_tf_graph(
                    graph,
                    const_node_values=constants,
                    custom_op_handlers=dict(tf2onnx_handlers.CUSTOM_OP_HANDLERS),
                    continue_on_error=True,
                    opset=opset,
                    input_names=inputs,
                    output_names=outputs,
                    tensors_to_rename=renames,
                )

            try:
                converted = conversion.optimize(process)
                proto = converted.make_model(f"converted from {concrete.name}")
            finally:
                # tf2onnx keeps the graphs of the functions it converted (a
                # generator's loop body) until its next conversion starts:
                # 0.48 of the 0.85 GiB a 28-layer generator's conversion
                # left resident.
                tf_loader.clear_functions()
            del converted
    captured = {inner.name: outer for outer, inner in concrete.graph.captures}
    for value_info in list(proto.graph.input):
        if value_info.name in captured:
            proto.graph.input.remove(value_info)
            # A view of the tensor (`.numpy()` copies it).
            value = np.asarray(captured[value_info.name])
            proto.graph.initializer.append(
                weights.initializer(value_info.name, value)
                if weights
                else numpy_helper.from_array(value, value_info.name)
            )
    return proto


def external_data_file(path: str) -> str:
    """The file beside the ONNX file `path` holding its external weights."""
    return path + ".data"


def save(proto: onnx.ModelProto, path: str, external: bool) -> None:
    """Writes `proto` at `path` and checks the file (`onnx.checker`, full);
    with `external` (its model's weights past `EXTERNAL_DATA_BYTES`), every
    tensor of 1 KiB or more not yet in `external_data_file(path)` (the
    weights `external.WeightFile` wrote) appended to it, referred to by its
    base name (moved out of `proto`)."""
    import onnx

    if not external:
        onnx.save(proto, path)
    else:
        # Each tensor's bytes leave the proto as they are written.
        onnx.save_model(
            proto,
            path,
            save_as_external_data=True,
            all_tensors_to_one_file=True,
            location=os.path.basename(external_data_file(path)),
            size_threshold=_EXTERNAL_TENSOR_BYTES,
        )
    # The file, not the proto: checking a proto serializes a copy of it.
    onnx.checker.check_model(path, full_check=True)


def name_dynamic_axes(proto: onnx.ModelProto) -> onnx.ModelProto:
    """Names the dynamic axes of graph inputs and outputs "batch" and "time".

    Axis 0 is "batch" and every other dynamic axis is "time" (see
    `signature.TIME_AXIS`). Fixed axes keep their sizes.
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
    import onnx

    for output, name in zip(proto.graph.output, names, strict=True):
        if output.name != name:
            proto.graph.node.append(
                onnx.helper.make_node("Identity", [output.name], [name])
            )
            output.name = name
    return proto


def keras_export(target: Signature, path: str, opset: int | None) -> None:
    """Keras's own `model.export(format="onnx")` of the target (JAX, torch)."""
    options = {} if opset is None else {"opset_version": opset}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        target.keras_model().export(
            path,
            format="onnx",
            verbose=False,
            input_signature=target.input_signature(),
            **options,
        )


class OnnxFormat(Format):
    """ONNX, checked by onnx.checker and onnxruntime."""

    row = table.ONNX
    quantized_form = quantization.CAPTURED
    advice = "export a SavedModel instead, or pass another opset"

    def files(self, path: str) -> list[str]:
        """The .onnx file, and its external data where its weights need it
        (`save`; written only then)."""
        return [path, external_data_file(path)]

    def check_options(
        self, options: Mapping[str, object], backend: str | None = None
    ) -> dict[str, object]:
        """`opset` (13 to 18), `fuse_attention` (TensorFlow only),
        `int8_matmul` (`INT8_MATMUL`; `DEPRECATED_INT8_MATMUL` warns and
        writes the default file) and `int4_inputs` (`INT4_INPUTS`).

        Raises:
            ValueError: for an unknown `int8_matmul` or `int4_inputs`.
        """
        super().check_options(options)
        fuse = _checks.boolean("fuse_attention", options.get("fuse_attention", False))
        backend = backend or keras.backend.backend()
        if fuse and backend != FUSED_BACKEND:
            raise ValueError(
                f"Fused-Attention ONNX export does not run on the {backend} "
                "backend (the rewrite reads the names of tf2onnx's graph): save "
                f"the model as .keras, load it under KERAS_BACKEND={FUSED_BACKEND} "
                "and export there"
            )
        int8_matmul = options.get("int8_matmul") or INT8_MATMUL
        if int8_matmul not in (INT8_MATMUL, DEPRECATED_INT8_MATMUL):
            raise ValueError(
                f"`int8_matmul` must be {INT8_MATMUL!r} (exact on every CPU) or "
                f"{DEPRECATED_INT8_MATMUL!r} (deprecated). Received: "
                f"int8_matmul={int8_matmul!r}"
            )
        if int8_matmul != INT8_MATMUL:
            warnings.warn(
                f"`int8_matmul={int8_matmul!r}` is deprecated and will be "
                "removed: the default int8 ONNX file now picks the CPU's fast "
                "exact kernel by itself (uint8 x int8 with VNNI or AMX, uint8 x "
                "uint8 elsewhere); this writes the default file",
                FutureWarning,
                stacklevel=2,
            )
        int4_inputs = options.get("int4_inputs") or INT4_INPUTS[0]
        if int4_inputs not in INT4_INPUTS:
            raise ValueError(
                f"`int4_inputs` must be {INT4_INPUTS[0]!r} (Keras's float inputs) "
                f"or {INT4_INPUTS[1]!r} (rounded to int8 in blocks, as "
                f"onnxruntime-genai's int4 models). Received: "
                f"int4_inputs={int4_inputs!r}"
            )
        return {
            "opset": check_opset(options.get("opset"), backend),
            "opset_given": options.get("opset") is not None,
            "fuse_attention": fuse,
            "int4_inputs": int4_inputs,
        }

    def detail(self, options: Mapping[str, object]) -> str:
        """The opset and the fused opset, as asked."""
        detail = f" (opset {options['opset'] or 'default'})"
        if options["fuse_attention"]:
            from keras_selfattn.export.formats.onnx import fused  # needs onnx

            detail = detail.replace(")", f" -> {fused.FUSED_OPSET}, fused Attention)")
        return detail

    def messages(
        self, options: Mapping[str, object]
    ) -> contextlib.AbstractContextManager[list[str]]:
        """With `fuse_attention`: which layers were fused, and why not."""
        if not options.get("fuse_attention"):
            return super().messages(options)
        from keras_selfattn.export.formats.onnx import fused

        return fused.collect_log()

    def write(
        self, target: Signature, path: str, options: Mapping[str, object]
    ) -> None:
        import onnx

        from keras_selfattn.export.formats.onnx import graph as og

        opset = options["opset"]
        size = weight_bytes(target)
        large = size >= EXTERNAL_DATA_BYTES
        backend = keras.backend.backend()
        nibbles = any(mode in NIBBLE_MODES for mode in quantization.modes(target.model))
        if nibbles and backend == "tensorflow" and not options["opset_given"]:
            opset = max(opset, NIBBLE_OPSET)
        if backend != "tensorflow" and large:
            raise ValueError(
                f"ONNX export of {size / 2**30:.2f} GiB of weights on {backend}: "
                "Keras's ONNX export writes one protobuf, which holds at most 2 "
                "GiB; save the model as .keras and export it under "
                "KERAS_BACKEND=tensorflow (weights as ONNX external data)"
            )
        # A quantized model's weights go to the file too (`external`): its
        # int4, grouped and float8 kernels are float32 in the converted
        # graph until the integer pass (int8 ones are their integers).
        spill = backend == "tensorflow" and (large or bool(target.quantized))
        data = external_data_file(path)
        weights = external.WeightFile(data) if spill else None
        with (
            converting(self.row.title, self.advice),
            target.traced(self.quantized_form),
            weights or contextlib.nullcontext(),
        ):
            if backend == "tensorflow":
                # Ops tf2onnx converts (a decoding step's cache write as
                # XlaDynamicUpdateSlice, for `dynamic_update_slice`).
                with tracing.traced_as(tracing.FOR_CONVERTER):
                    proto = convert_to_onnx(
                        target.with_caches(ConverterCache), opset, weights
                    )
            else:
                keras_export(target, path, opset)
                proto = name_outputs(onnx.load(path), target.output_names)
        folder = os.path.dirname(path)
        with og.external_data_in(folder) if spill else contextlib.nullcontext():
            proto = _rewritten(name_dynamic_axes(proto), target, options)
            if spill and not large:
                external.load(proto, data)
            elif spill and target.quantized:
                external.compact(proto, data)
            if (
                nibbles
                and opset < NIBBLE_OPSET
                and og.has_op(proto.graph, "BitwiseAnd")
            ):
                raise ValueError(
                    f"ONNX export at opset {opset}: tf2onnx writes the unpacking "
                    f"of this model's 4-bit weights as BitwiseAnd, an opset "
                    f"{NIBBLE_OPSET} op; pass opset={NIBBLE_OPSET} or leave opset "
                    "unset"
                )
            save(proto, path, external=large)


def _rewritten(
    proto: onnx.ModelProto, target: Signature, options: Mapping[str, object]
) -> onnx.ModelProto:
    """The converted `proto` after the passes its model and `options` take
    (each imported when it runs: a float model without fusion runs none)."""
    if options["fuse_attention"]:
        from keras_selfattn.export.formats.onnx import fused

        proto, _ = fused.fuse_attention(proto, target.model)
    looped = any(node.op_type == "Loop" for node in proto.graph.node)
    if looped:  # a generator
        from keras_selfattn.export.formats.onnx import (
            generator_fusion,
            loop_invariant,
        )

        proto = loop_invariant.optimize_loops(proto)
        proto = generator_fusion.fuse_generator(proto, target.model)
    if target.quantized:  # after the loop passes: their upgrade is onnx's
        from keras_selfattn.export.formats.onnx import integer

        rounded = options["int4_inputs"] == INT4_INPUTS[1]
        proto, _ = integer.rewrite(proto, target.quantized, rounded)
    if looped:  # last: each pass above writes per-layer nodes too
        from keras_selfattn.export.formats.onnx import (
            common_nodes,
            matmul_rows,
            packed_matmuls,
            squeeze_reshape,
        )

        matmul_rows.read_rows_in_place(proto)
        squeeze_reshape.skip_squeezes(proto)
        common_nodes.merge(proto)
        packed_matmuls.pack(proto)  # of layers reading one (merged) input
    return proto


FORMAT = OnnxFormat()
