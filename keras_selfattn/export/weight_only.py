"""The quantized layers an ONNX generator computes on `MatMulNBits`.

A generator runs every layer once per new token inside its loop. Where
Keras quantizes a layer's weights only (int4 by default, gptq, awq, int8
without an activation quantizer), the ONNX generator traces the layer with
its dequantized kernel as a constant (`quantization.CONSTANTS`) and the ONNX
pass stores Keras's integers again for ONNX Runtime's `MatMulNBits`
(`formats.onnx.integer`), as the forward export does: each token reads the
packed codes, with float activations as Keras computes them, and nothing
unpacks a whole kernel. Besides `Dense` layers this covers the reverse
projection of an untied int4 `ReversibleEmbedding` (keras-hub's LM head),
which Keras computes by the same formula (`describe_reverse`). The other
quantized layers (int8 with activation quantization, float8) keep Keras's
own calls, which run on integer kernels already.
"""

from __future__ import annotations

import keras
import numpy as np

from keras_selfattn._model_layers import every_layer
from keras_selfattn.export.quantization import (
    QuantizedDense,
    _grouped,
    _numpy,
    _unpack,
    quantized_layers,
)


def describe_reverse(layer) -> QuantizedDense | None:
    """The reverse projection (`layer(x, reverse=True)`, an LM head) of an
    untied int4 `ReversibleEmbedding` without activation quantization, as a
    `QuantizedDense` (in: the embedding's width, out: its vocabulary); None
    otherwise (Keras's own call stays).

    Keras multiplies by `(codes - zero[g]) * scale[g]` grouped along the
    width (per channel: the integers times the input, then divided by each
    column's scale), as a grouped int4 `Dense`.
    """
    if (
        not isinstance(layer, keras.layers.ReversibleEmbedding)
        or layer.quantization_mode != "int4"
        or layer.tie_weights
        or getattr(layer, "inputs_quantizer", None) is not None
    ):
        return None
    integers = _unpack(layer.reverse_embeddings, layer.output_dim, 0, "int8")
    if getattr(layer, "_int4_block_size", None) in (None, -1):
        scale = _numpy(layer.reverse_embeddings_scale).astype(np.float32)
        kernel = integers.astype(np.float32) / scale
        return QuantizedDense(layer, "int4", kernel, integers, scale, bits=4)
    sz = (layer.reverse_embeddings_scale, layer.reverse_embeddings_zero)
    return _grouped(layer, integers, "int4", 4, sz=sz)


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


def weight_only_layers(model: keras.Model) -> tuple[QuantizedDense, ...]:
    """The layers of `model` an ONNX generator computes on `MatMulNBits`
    (module docstring): weight-only `Dense` layers and untied int4 reverse
    projections that `nbits_fits`."""
    layers = [describe_reverse(layer) for layer in every_layer(model)]
    layers += quantized_layers(model)
    return tuple(q for q in layers if q is not None and nbits_fits(q))
