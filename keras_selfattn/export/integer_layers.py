"""The quantized layers an ONNX generator computes on ONNX Runtime's
integer kernels.

A generator runs every layer once per new token inside its loop. The ONNX
generator traces these layers with their dequantized kernels as constants
(`quantization.CAPTURED`) and the ONNX pass stores Keras's integers again
(`formats.onnx.integer`), as the forward export does, in the prompt pass
and in the `Loop` body:

- weight-only modes (int4 by default, gptq, awq, int8 without an
  activation quantizer) on `MatMulNBits`: each token reads the packed
  codes, with float activations as Keras computes them, and nothing
  unpacks a whole kernel;
- int8 with Keras's activation quantizer on `MatMulIntegerToFloat`
  (`formats.onnx.int8_layers`): Keras's exact scheme, its kernel chosen by
  a probe of the CPU that runs the file (exact on every CPU), the input's
  quantization shared by the layers that read it, where Keras's own call
  ran an int8 x int8 `MatMulInteger` behind a dozen float ops per layer.

Besides `Dense` layers this covers the reverse projection of an untied
int4 or int8 `ReversibleEmbedding` (keras-hub's LM head), which Keras
computes by the same formulas (`describe_reverse`). float8 layers, groups
`MatMulNBits` does not take and tied reverse projections keep Keras's own
calls.
"""

from __future__ import annotations

import keras
import numpy as np

from keras_selfattn._model_layers import every_layer
from keras_selfattn.export.quantization import quantized_layers
from keras_selfattn.export.quantized_kernels import (
    QuantizedDense,
    grouped_layer,
    input_quantizer,
    stored_array,
    unpacked,
)


def describe_reverse(layer) -> QuantizedDense | None:
    """The reverse projection (`layer(x, reverse=True)`, an LM head) of an
    untied int4 or int8 `ReversibleEmbedding`, as a `QuantizedDense` (in:
    the embedding's width, out: its vocabulary); None otherwise (Keras's
    own call stays).

    Keras multiplies by `(codes - zero[g]) * scale[g]` grouped along the
    width (int4 in groups), or by the integers and then divides each column
    by its scale (per channel; int8 with its input quantized per token
    first), as a `Dense` of the same mode does.
    """
    mode = getattr(layer, "quantization_mode", None)
    if (
        not isinstance(layer, keras.layers.ReversibleEmbedding)
        or mode not in ("int4", "int8")
        or layer.tie_weights
    ):
        return None
    activations = input_quantizer(layer)
    if mode == "int8":
        integers = stored_array(layer.reverse_embeddings).astype(np.int8)
    else:
        if activations is not None:
            return None
        integers = unpacked(layer.reverse_embeddings, layer.output_dim, 0, "int8")
    bits = 8 if mode == "int8" else 4
    if mode == "int8" or getattr(layer, "_int4_block_size", None) in (None, -1):
        scale = stored_array(layer.reverse_embeddings_scale).astype(np.float32)
        return QuantizedDense(
            layer, mode, None, integers, scale, bits=bits, activations=activations
        )
    sz = (layer.reverse_embeddings_scale, layer.reverse_embeddings_zero)
    return grouped_layer(layer, integers, "int4", 4, sz=sz)


def nbits_fits(quantized: QuantizedDense) -> bool:
    """Whether `MatMulNBits` computes `quantized` as Keras does: a
    weight-only mode (no activation quantizer, not float8), per channel or in
    ordered groups of a power of two of at least 16 inputs."""
    if quantized.mode == "float8" or quantized.activations is not None:
        return False
    if quantized.zero is None:
        return True
    size = quantized.group_size
    return size is not None and size >= 16 and not size & (size - 1)


def exact_int8(quantized: QuantizedDense) -> bool:
    """Whether `quantized` is int8 with Keras's activation quantizer (its
    file computes Keras's exact scheme: `formats.onnx.int8_layers`)."""
    return quantized.mode == "int8" and quantized.activations is not None


def integer_layers(model: keras.Model) -> tuple[QuantizedDense, ...]:
    """The layers of `model` an ONNX generator computes on integer kernels
    (module docstring): `Dense` layers and untied reverse projections that
    `nbits_fits` or are `exact_int8`."""
    layers = [describe_reverse(layer) for layer in every_layer(model)]
    layers += quantized_layers(model)
    return tuple(
        q for q in layers if q is not None and (nbits_fits(q) or exact_int8(q))
    )
