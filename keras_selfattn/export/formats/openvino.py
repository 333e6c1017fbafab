"""OpenVINO IR (.xml + .bin): OpenVINO's converter on TensorFlow, Keras's
export on torch.

Inputs and outputs get the target's names. A quantized model is traced with
its dequantized kernels as constants; `compress` then stores each as
Keras's integers (int8 with per-channel scales, or 4/8-bit codes in groups
with zero points) behind OpenVINO's decompression pattern
(Constant -> Convert -> [Subtract] -> Multiply), which its CPU plugin keeps
compressed in its matmuls. That plugin also quantizes a compressed
matmul's activations to int8, symmetric, in groups of
`DYNAMIC_QUANTIZATION_GROUP_SIZE` inputs (32 by default); the file sets
that option (its rt_info `runtime_options`, read when a model is compiled)
to the input width of Keras's int8 layers, so that each row is one group:
Keras's own per-token scheme (measured equal to Keras within 1e-6 on an
AVX-512 VNNI CPU), and 0 (float activations, as Keras computes them) for
weight-only models (int4, gptq, awq). A layer whose input width differs
from the group gets float activations. The plugin decides when it compiles
the model whether it quantizes activations at all: on a CPU without int8
dot-product instructions (AVX2 without VNNI, measured) it multiplies float
activations by the decompressed weights. Which of the two a file computes
therefore depends on the machine that runs it, so the file never claims
Keras's exact scheme, and its check is the quantization rule that both
satisfy.

`without_fused_attention` works around a bug of OpenVINO 2026.4's CPU
plugin: the converter fuses attention without a mask into one
`ScaledDotProductAttention`, which the plugin compiles into its MHA
snippet; once a compiled model has been called with one key (time 1), its
later calls with more keys compute wrong results (max abs error 25-600
measured, float and quantized models alike; `SNIPPETS_MODE=DISABLE` avoids
it). The node is replaced by its matmuls and softmax, with a `Select`
before the softmax that the MHA snippet does not take in. The export's
check calls a 1x1 input first, so a runtime that still goes wrong is
caught.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping

import keras
import numpy as np

from keras_selfattn.attention.cache import GatheredCache
from keras_selfattn.export import quantization, quantized_kernels
from keras_selfattn.export.formats._base import Format, converting
from keras_selfattn.export.signature import Signature
from keras_selfattn_runtimes import table

# Where a quantized export says what it computes (the model's rt_info).
SCHEME_KEY = "keras_selfattn_quantization"
# The CPU plugin's activation quantization group, set in the model's rt_info.
GROUP_OPTION = ["runtime_options", "DYNAMIC_QUANTIZATION_GROUP_SIZE"]
# OpenVINO's INFERENCE_PRECISION_HINT values a check runs an IR at
# (`verify`'s `openvino_precision`), and the one it runs at unless told:
# on CPUs with AVX512-BF16 OpenVINO's default is bf16, which is not the
# model's arithmetic.
PRECISIONS = ("f32", "bf16")
EXACT_PRECISION = "f32"
PER_TOKEN_INT8 = (
    "int8 activations per token, symmetric (Keras's scheme) where the CPU "
    "plugin quantizes activations (VNNI, AMX), float activations elsewhere"
)


def _decompressed(quantized: quantized_kernels.QuantizedDense, transposed: bool):
    """The decompression subgraph of one kernel, (out, in) if `transposed`."""
    import openvino as ov
    from openvino import opset13 as ops

    if quantized.zero is None:  # int8 / int4 per channel: q / scale
        integers = quantized.integers
        codes = integers.T if transposed else integers
        element = ov.Type.i8 if quantized.bits == 8 else ov.Type.i4
        weight = ops.convert(
            ops.constant(np.ascontiguousarray(codes), element), ov.Type.f32
        )
        scale = (1.0 / quantized.scale).astype(np.float32)
        scale = scale[:, None] if transposed else scale[None, :]
        return ops.multiply(weight, ops.constant(scale))
    inputs, outputs = quantized.shape
    size = quantized.group_size
    groups = inputs // size
    element = ov.Type.u8 if quantized.bits == 8 else ov.Type.u4
    codes = quantized.integers.T.reshape(outputs, groups, size)  # (out, groups, size)
    weight = ops.convert(
        ops.constant(np.ascontiguousarray(codes), element), ov.Type.f32
    )
    zero = ops.constant(np.ascontiguousarray(quantized.zero.T[:, :, None]), ov.Type.f32)
    scale = ops.constant(np.ascontiguousarray(quantized.scale.T[:, :, None]))
    kernel = ops.multiply(ops.subtract(weight, zero), scale)
    kernel = ops.reshape(kernel, ops.constant(np.array([outputs, inputs])), False)
    if quantized.input_divisor is not None:
        divisor = ops.constant(quantized.input_divisor[None, :].astype(np.float32))
        kernel = ops.divide(kernel, divisor)
    return (
        kernel if transposed else ops.transpose(kernel, ops.constant(np.array([1, 0])))
    )


def _scores_kept(scores, mask, causal: bool):
    """The scores with SDPA's mask (additive float or boolean) and causal
    rule applied, behind a `Select` (see the module docstring)."""
    import openvino as ov
    from openvino import opset13 as ops

    minus_inf = ops.constant(np.float32(-np.inf))
    keep = ops.constant(np.array(True))
    if mask is not None and mask.get_element_type() == ov.Type.boolean:
        keep = mask
    elif mask is not None:
        scores = ops.add(scores, mask)
    if causal:
        shape = ops.shape_of(scores)
        queries = ops.gather(shape, ops.constant(np.int64(-2)), ops.constant(0))
        keys = ops.gather(shape, ops.constant(np.int64(-1)), ops.constant(0))
        one = ops.constant(np.int64(1))
        rows = ops.unsqueeze(
            ops.range(ops.constant(np.int64(0)), queries, one, "i64"), ops.constant(1)
        )
        cols = ops.range(ops.constant(np.int64(0)), keys, one, "i64")
        keep = ops.logical_and(keep, ops.less_equal(cols, rows))
    return ops.select(keep, scores, minus_inf)


def without_fused_attention(model) -> int:
    """Replaces each `ScaledDotProductAttention` by its decomposition (module
    docstring); returns how many it replaced."""
    from openvino import opset13 as ops

    replaced = 0
    for node in model.get_ordered_ops():
        if node.get_type_name() != "ScaledDotProductAttention":
            continue
        inputs = [node.input_value(i) for i in range(node.get_input_size())]
        query, key, value = inputs[:3]
        scores = ops.matmul(query, key, False, True)
        if len(inputs) > 4:
            scores = ops.multiply(scores, inputs[4])
        else:
            depth = ops.gather(
                ops.shape_of(query), ops.constant(np.int64(-1)), ops.constant(0)
            )
            scores = ops.divide(scores, ops.sqrt(ops.convert(depth, "f32")))
        mask = inputs[3] if len(inputs) > 3 else None
        causal = bool(node.get_attributes().get("causal", False))
        weights = ops.softmax(_scores_kept(scores, mask, causal), -1)
        node.output(0).replace(ops.matmul(weights, value, False, False).output(0))
        replaced += 1
    return replaced


def _fits(quantized: quantized_kernels.QuantizedDense) -> bool:
    if quantized.mode == "float8":
        return False
    if quantized.zero is None:
        return True
    inputs = quantized.shape[0]
    return quantized.group_size is not None and inputs % quantized.group_size == 0


def activation_group(quantized) -> int:
    """The group that makes Keras's int8 layers per-token (module
    docstring): their widest input, or 0 when there are none or a
    weight-only layer has that width too (it would be quantized)."""
    widths = {q.shape[0] for q in quantized if q.activations is not None}
    if not widths:
        return 0
    group = max(widths)
    weight_only = {q.shape[0] for q in quantized if q.activations is None}
    return 0 if group in weight_only else group


def _describe_layers(quantized, schemes: dict[str, str], group: int) -> dict:
    """{"layers": {name: scheme}, "exact": False}: whether the CPU plugin
    computes Keras's own scheme depends on the CPU (module docstring)."""
    for q in quantized:
        if schemes[q.layer.name].startswith("float32"):
            continue
        if q.activations is not None and q.shape[0] == group:
            schemes[q.layer.name] += "; " + PER_TOKEN_INT8
        else:
            schemes[q.layer.name] += "; float activations"
    return {"layers": schemes, "exact": False}


def compress(model, quantized) -> dict[str, str]:
    """Replaces each quantized kernel constant (found by value, either
    orientation) by Keras's integers and their decompression; returns each
    layer's scheme."""
    import openvino as ov

    by_value = {}
    for q in quantized:
        by_value[(quantized_kernels.value_key(q.kernel), False)] = q
        by_value[(quantized_kernels.value_key(q.kernel.T), True)] = q
    schemes = {q.layer.name: "float32 (kernel not found)" for q in quantized}
    for op in model.get_ordered_ops():
        if op.get_type_name() != "Constant" or op.get_element_type() != ov.Type.f32:
            continue
        if len(op.get_output_partial_shape(0)) != 2:
            continue
        key = quantized_kernels.value_key(op.get_data())
        for transposed in (False, True):
            match = by_value.get((key, transposed))
            if match is None:
                continue
            if not _fits(match):
                schemes[match.layer.name] = "float32 (" + (
                    "float8-rounded kernel)"
                    if match.mode == "float8"
                    else "groups do not divide the input)"
                )
                break
            replacement = _decompressed(match, transposed)
            for target_input in list(op.output(0).get_target_inputs()):
                target_input.replace_source_output(replacement.output(0))
            schemes[match.layer.name] = f"{match.bits}-bit weights kept compressed"
            break
    return schemes


def _name_ports(model, target: Signature, output_order) -> None:
    for ports, names in (
        (model.inputs, target.input_names),
        (model.outputs, output_order),
    ):
        for port, name in zip(ports, names, strict=True):
            port.get_tensor().set_names({name})


class OpenVINOFormat(Format):
    """OpenVINO IR, checked by OpenVINO's CPU plugin at f32."""

    row = table.OPENVINO
    quantized_form = quantization.CONSTANTS
    advice = "export ONNX instead, or load the model on TensorFlow and export there"

    def files(self, path: str) -> list[str]:
        """The .xml and its .bin."""
        return [path, path[: -len(self.row.suffix)] + ".bin"]

    def runtime_options(self, keywords: Mapping[str, object]) -> dict[str, object]:
        """{"precision": `openvino_precision`} (`EXACT_PRECISION` unless
        given).

        Raises:
            ValueError: for a precision not in `PRECISIONS`.
        """
        precision = keywords.get("openvino_precision", EXACT_PRECISION)
        if precision not in PRECISIONS:
            raise ValueError(
                f"`openvino_precision` must be one of {PRECISIONS}. "
                f"Received: openvino_precision={precision!r}"
            )
        return {"precision": precision}

    def runtime_label(self, options: Mapping[str, object]) -> str:
        """The format's name, "_<precision>" added off `EXACT_PRECISION`."""
        precision = options.get("precision", EXACT_PRECISION)
        return self.name if precision == EXACT_PRECISION else f"{self.name}_{precision}"

    def write(
        self, target: Signature, path: str, options: Mapping[str, object]
    ) -> None:
        import openvino

        with (
            converting(self.row.title, self.advice),
            target.traced(self.quantized_form),
        ):
            if keras.backend.backend() == "tensorflow":
                # A decoding step's cache write as a gather: OpenVINO has no
                # conversion for TensorFlow's XlaDynamicUpdateSlice.
                gathered = target.with_caches(GatheredCache)
                function = gathered.tf_function().get_concrete_function()
                model = openvino.convert_model(function)
                # The function returns a dict: its outputs come in the order
                # of tf.nest.flatten, which sorts the keys.
                order = sorted(target.output_names)
            else:
                traced = path[: -len(self.row.suffix)] + ".keras.xml"
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    target.keras_model().export(
                        traced,
                        format="openvino",
                        verbose=False,
                        input_signature=target.input_signature(),
                    )
                model = openvino.Core().read_model(traced)
                order = target.output_names
        _name_ports(model, target, order)
        without_fused_attention(model)
        if target.quantized:
            schemes = compress(model, target.quantized)
            group = activation_group(target.quantized)
            model.set_rt_info(str(group), GROUP_OPTION)
            description = _describe_layers(target.quantized, schemes, group)
            model.set_rt_info(json.dumps(description), SCHEME_KEY)
        openvino.save_model(model, path, compress_to_fp16=False)


FORMAT = OpenVINOFormat()
