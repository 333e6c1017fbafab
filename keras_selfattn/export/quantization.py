"""Quantized models in exports: Keras's own integers, on each runtime's kernels.

`model.quantize(mode)` stores each `Dense` kernel (SelfAttention's
projections included) as integers with per-channel or per-group scales.
Keras computes such a layer with its own quantized call (int8: activations
quantized per token, symmetric, then an integer matmul), which no converter
maps to a runtime's integer kernels and which TensorFlow's CPU runs slower
than float. An export instead traces each quantized `Dense` as a matmul
with its *dequantized* kernel (`QuantizedDense.kernel`, Keras's own
dequantization formula) in one of these forms (`traced`):

- `VARIABLES`: the graph reads the stored integer variables and dequantizes
  them once per call (SavedModel, `.pt2`): the file keeps the integers,
  the arithmetic is float (int8 in float32: the input times the integers,
  then each output column times 1 / scale, `_scales_outputs`).
- `INTEGERS` (SavedModel): the graph holds each int8 kernel's integers and
  scales as constants and dequantizes them in the graph: the file keeps the
  integers (in the graph instead of in variables), and TensorFlow folds the
  dequantization into a float kernel once, when it optimizes the loaded
  graph (grappler's constant folding), so a call multiplies floats as the
  float file does. A kernel whose float form exceeds what the folding takes
  (`FOLDED_BYTES`), and the other modes, are read as in `VARIABLES`.
- `CONSTANTS`: the graph holds the dequantized kernel as a constant, which
  the format's own pass then stores again as Keras's integers for its
  runtime's integer kernels (ONNX `MatMulInteger`/`MatMulNBits`, LiteRT's
  dynamic-range kernels, OpenVINO's compressed weights), found by value.
- `CAPTURED` (ONNX): as `CONSTANTS`, the kernel a tensor made once when the
  block starts, which a traced function captures as an input (the ONNX
  conversion stores it once, as an initializer, however many graphs read
  it: a generator's prompt pass and loop body, without the float copies
  each graph's constants would make while it converts). An int8 `Dense`
  on TensorFlow is traced instead as Keras's dequantization of its stored
  variable (`in_graph`), which the ONNX pass finds by its integers: its
  float kernel is never made (the 0.59 B Llama's 2.2 GiB of them).

An int8 `Embedding` keeps its int8 table in every form; while traced it
gathers rows and multiplies them by the reciprocal of their scales, both
gathered from 2-D tables (`_embedding_call`): Keras's own call gathers the
scales from a vector and divides, which torch exports as `aten::ravel` and
`aten::divide`, ops neither torch.onnx nor OpenVINO's torch frontend
converts.

`describe` reads a layer's stored values into a `QuantizedDense`
(`quantized_kernels`).

Checks compare a quantized model's artifact with two references computed
by Keras on the same inputs: the quantized model itself, and the same model
with the dequantized kernels in float (`traced` with `CONSTANTS`); see
`verify`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import keras
import numpy as np
from keras import ops

from keras_selfattn._model_layers import every_layer
from keras_selfattn.export.quantized_kernels import (
    QuantizedDense,
    grouped_layer,
    input_quantizer,
    stored_array,
    unpacked,
)

VARIABLES = "variables"
INTEGERS = "integers"
CONSTANTS = "constants"
CAPTURED = "captured"
FORMS = (VARIABLES, INTEGERS, CONSTANTS, CAPTURED)
# The forms holding the dequantized kernel (found by value afterwards).
DEQUANTIZED = (CONSTANTS, CAPTURED)
# Grappler folds constants of at most 10 MiB (`max_constant_size_in_bytes`).
FOLDED_BYTES = 10 * 1024 * 1024
# Keras's modes whose kernels an export re-expresses (Embedding keeps its
# own call: a gather of int8 rows, which every converter keeps as integers).
MODES = ("int8", "int4", "float8", "gptq", "awq")


def describe(layer) -> QuantizedDense | None:
    """The `QuantizedDense` of a quantized `Dense` layer; None otherwise."""
    mode = getattr(layer, "quantization_mode", None)
    if not isinstance(layer, keras.layers.Dense) or mode not in MODES:
        return None
    if mode == "int8":
        integers = stored_array(layer._kernel).astype(np.int8)
        scale = stored_array(layer.kernel_scale).astype(np.float32)
        return QuantizedDense(
            layer, mode, None, integers, scale, activations=input_quantizer(layer)
        )
    if mode == "int4":
        integers = unpacked(layer._kernel, layer._orig_output_dim, -1, "int8")
        if getattr(layer, "_int4_block_size", None) in (None, -1):
            scale = stored_array(layer.kernel_scale).astype(np.float32)
            return QuantizedDense(
                layer,
                mode,
                None,
                integers,
                scale,
                bits=4,
                activations=input_quantizer(layer),
            )
        return grouped_layer(layer, integers, mode, 4)
    if mode in ("gptq", "awq"):
        if mode == "gptq" and not layer.is_gptq_calibrated:
            return None
        if mode == "awq" and not layer.is_awq_calibrated:
            return None
        from keras_selfattn._keras_private import gptq_weight_bits

        bits = 4 if mode == "awq" else gptq_weight_bits(layer)
        codes = layer.quantized_kernel
        codes = (
            unpacked(codes, layer.units, 0, "uint8")
            if bits == 4
            else stored_array(codes)
        )
        divisor = None
        if mode == "awq":
            divisor = stored_array(layer.awq_scales).astype(np.float32)
        return grouped_layer(layer, codes.T, mode, bits, divisor)
    # float8: the kernel rounded to float8 with its scale, as Keras's call does.
    from keras import quantizers

    kernel = quantizers.quantize_and_dequantize(
        ops.convert_to_tensor(layer._kernel),
        ops.convert_to_tensor(layer.kernel_scale),
        "float8_e4m3fn",
        "float32",
    )
    return QuantizedDense(
        layer, mode, stored_array(kernel).astype(np.float32), None, None
    )


def quantized_layers(model: keras.Model) -> tuple[QuantizedDense, ...]:
    """Every quantized `Dense` of `model`, nested ones included."""
    described = (describe(layer) for layer in every_layer(model))
    return tuple(q for q in described if q is not None)


def quantized_embeddings(model: keras.Model) -> tuple[keras.layers.Embedding, ...]:
    """Every int8 `Embedding` of `model`, nested ones included."""
    return tuple(
        layer
        for layer in every_layer(model)
        if isinstance(layer, keras.layers.Embedding)
        and layer.quantization_mode == "int8"
    )


def modes(model: keras.Model) -> tuple[str, ...]:
    """The quantization modes of `model`'s layers (Embedding too), sorted."""
    return tuple(
        sorted(
            {
                layer.quantization_mode
                for layer in every_layer(model)
                if getattr(layer, "quantization_mode", None) is not None
            }
        )
    )


def in_graph(quantized: QuantizedDense, form: str) -> bool:
    """Whether `form` traces this layer's kernel as Keras's dequantization of
    its stored int8 variable, in the graph, rather than as a tensor of the
    dequantized kernel: `CAPTURED` on TensorFlow, int8 `Dense` layers (the
    ONNX integer pass finds them by their integers, `value_key`, and the
    float kernel is never made)."""
    return (
        form == CAPTURED
        and quantized.mode == "int8"
        and not _reversed(quantized)
        and keras.backend.backend() == "tensorflow"
    )


def kernel_tensor(quantized: QuantizedDense):
    """The dequantized kernel as a tensor: the one `dequantized` made, or one
    made from `quantized.kernel`."""
    if quantized.tensor is not None:
        return quantized.tensor
    return ops.convert_to_tensor(quantized.kernel)


def _kernel_of(quantized: QuantizedDense, form: str):
    """The traced kernel: a constant, or Keras's dequantization of the
    stored variables (the float8 kernel is rounded once, a constant)."""
    layer = quantized.layer
    if form in DEQUANTIZED or quantized.mode == "float8":
        return kernel_tensor(quantized)
    if quantized.mode == "int8":
        return ops.divide(ops.cast(layer._kernel, "float32"), layer.kernel_scale)
    from keras import quantizers

    if quantized.mode == "int4":
        codes = quantizers.unpack_int4(layer._kernel, layer._orig_output_dim, axis=-1)
        if quantized.zero is None:
            return ops.divide(ops.cast(codes, "float32"), layer.kernel_scale)
        return _dequantize_groups(
            quantized, codes, layer.kernel_scale, layer.kernel_zero, 0
        )
    codes = layer.quantized_kernel
    if quantized.bits == 4:
        codes = quantizers.unpack_int4(codes, layer.units, axis=0, dtype="uint8")
    kernel = ops.transpose(
        _dequantize_groups(quantized, codes, layer.kernel_scale, layer.kernel_zero, 1)
    )
    if quantized.input_divisor is not None:
        kernel = ops.divide(kernel, ops.expand_dims(layer.awq_scales, -1))
    return kernel


def _folded(quantized: QuantizedDense, form: str) -> bool:
    """Whether the kernel is traced from constant integers (`INTEGERS`)."""
    return (
        form == INTEGERS
        and quantized.mode == "int8"
        and np.prod(quantized.shape) * 4 <= FOLDED_BYTES
    )


def _dequantize_groups(quantized: QuantizedDense, values, scale, zero, axis: int):
    """Keras's `dequantize_with_sz_map` of `values` grouped along `axis` (the
    input axis; `scale` and `zero` hold one row per group there):
    (values - zero[g]) * scale[g].

    Groups of `group_size` consecutive inputs that tile the axis (Keras's own
    layout) are a reshape and a broadcast; any other `g_idx` is gathered, as
    Keras does.
    """
    size, inputs = quantized.group_size, quantized.shape[0]
    values = ops.cast(values, "float32")
    if size is None or inputs % size:
        groups = ops.cast(quantized.layer.g_idx, "int32")
        scales = ops.take(scale, groups, axis=axis)
        zeros = ops.cast(ops.take(zero, groups, axis=axis), scales.dtype)
        return ops.multiply(ops.subtract(values, zeros), scales)
    shape = tuple(values.shape)
    grouped = list(shape)
    grouped[axis : axis + 1] = [inputs // size, size]
    scale = ops.expand_dims(scale, axis + 1)
    zero = ops.cast(ops.expand_dims(zero, axis + 1), "float32")
    values = ops.reshape(values, grouped)
    return ops.reshape(ops.multiply(ops.subtract(values, zero), scale), shape)


def _scales_outputs(quantized: QuantizedDense, form: str, inputs) -> bool:
    """Whether the traced call multiplies the float32 input by the int8
    integers and then each output column by 1 / scale (`VARIABLES`, int8 per
    channel, float32): one cast of the integers per call instead of a cast
    and a divide of the whole kernel. The same products within float32
    rounding (each kernel element and each output an ulp apart); in float16
    integer-valued products could overflow, so half inputs keep the
    dequantized kernel."""
    return (
        form in (VARIABLES, INTEGERS)
        and not _folded(quantized, form)
        and quantized.mode == "int8"
        and keras.backend.standardize_dtype(inputs.dtype) == "float32"
    )


def _dense_call(quantized: QuantizedDense, form: str):
    """`Dense.call` with the kernel `_kernel_of` gives (LoRA kept)."""
    layer = quantized.layer
    # Read now: a variable's value cannot be read while a graph is traced.
    folded = captured = None
    if _folded(quantized, form):
        folded = (stored_array(layer._kernel), stored_array(layer.kernel_scale))
    # Keras's dequantization of the stored integers, in the graph.
    stored = in_graph(quantized, form)
    if form == CAPTURED and not stored:
        captured = kernel_tensor(quantized)
    elif form == CONSTANTS:
        _ = quantized.kernel  # made now, eagerly: a traced call cannot

    def call(inputs, training=None):
        if folded is not None:
            integers, scale = (ops.convert_to_tensor(x) for x in folded)
            kernel = ops.divide(ops.cast(integers, "float32"), scale)
            x = ops.matmul(inputs, ops.cast(kernel, inputs.dtype))
        elif _scales_outputs(quantized, form, inputs):
            integers = ops.cast(layer._kernel, "float32")
            x = ops.multiply(
                ops.matmul(inputs, integers), ops.reciprocal(layer.kernel_scale)
            )
        else:
            if captured is not None:
                kernel = captured
            else:
                kernel = _kernel_of(quantized, VARIABLES if stored else form)
            x = ops.matmul(inputs, ops.cast(kernel, inputs.dtype))
        if layer.lora_enabled:
            lora = ops.matmul(
                ops.matmul(inputs, layer.lora_kernel_a), layer.lora_kernel_b
            )
            x = ops.add(
                x, ops.cast((layer.lora_alpha / layer.lora_rank) * lora, x.dtype)
            )
        if layer.bias is not None:
            x = ops.add(x, ops.cast(layer.bias, x.dtype))
        if layer.activation is not None:
            x = layer.activation(x)
        return x

    return call


def _reversed(quantized: QuantizedDense) -> bool:
    """Whether `quantized` is an embedding's reverse projection."""
    return isinstance(quantized.layer, keras.layers.Embedding)


def _reverse_call(quantized: QuantizedDense):
    """A `ReversibleEmbedding`'s call with its reverse projection a matmul by
    the dequantized kernel (`describe_reverse`; `DEQUANTIZED` forms only: a
    tensor made now, captured), then Keras's soft cap; its embedding lookup
    is Keras's own."""
    layer = quantized.layer
    own = type(layer).quantized_call
    kernel = kernel_tensor(quantized)

    def call(inputs, reverse=False):
        if not reverse:
            return own(layer, inputs)
        logits = ops.matmul(inputs, ops.cast(kernel, inputs.dtype))
        cap = layer.logit_soft_cap
        if cap is not None:
            logits = ops.multiply(ops.tanh(ops.divide(logits, cap)), cap)
        return logits

    return call


def _embedding_call(layer: keras.layers.Embedding):
    """The int8 `Embedding`'s call as exports trace it (module docstring)."""

    def call(inputs, training=None):
        ids = inputs
        if ids.dtype not in ("int32", "int64"):
            ids = ops.cast(ids, "int32")
        rows = ops.take(layer._embeddings, ids, axis=0)
        rows = ops.cast(rows, layer.compute_dtype)
        inverse = ops.expand_dims(ops.reciprocal(layer.embeddings_scale), -1)
        return ops.multiply(rows, ops.take(ops.cast(inverse, rows.dtype), ids, axis=0))

    return call


@contextlib.contextmanager
def traced(
    layers: Sequence[QuantizedDense],
    form: str,
    embeddings: Sequence[keras.layers.Embedding] = (),
) -> Iterator[None]:
    """While the block runs, each layer computes with its dequantized kernel.

    Args:
        layers: From `quantized_layers` (or `integer_layers.integer_layers`,
            whose reverse projections are traced in `DEQUANTIZED` forms: in
            another form they keep Keras's own call).
        form: `VARIABLES` (dequantize the stored integers per call),
            `INTEGERS` (the int8 integers as constants, dequantized in the
            graph), `CONSTANTS` (the dequantized kernel as a constant) or
            `CAPTURED` (that kernel a tensor the traced function captures).
        embeddings: From `quantized_embeddings`: their export call, in
            either form.
    """
    if form not in FORMS:
        raise ValueError(f"`form` must be one of {FORMS}: {form!r}")
    calls = [
        (q.layer, _reverse_call(q) if _reversed(q) else _dense_call(q, form))
        for q in layers
        if form in DEQUANTIZED or not _reversed(q)
    ]
    calls += [(layer, _embedding_call(layer)) for layer in embeddings]
    replaced = []
    try:
        for layer, call in calls:
            object.__setattr__(layer, "quantized_call", call)
            replaced.append(layer)
        yield
    finally:
        for layer in replaced:
            object.__delattr__(layer, "quantized_call")
