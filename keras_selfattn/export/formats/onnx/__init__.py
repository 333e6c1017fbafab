"""ONNX: the format (`format`) and the passes that write its graph.

`format` converts (tf2onnx, with handlers of the TensorFlow ops it has
no conversion for, or Keras's own route), then `fused` replaces each
SelfAttention core by ONNX's `Attention` op and `integer` puts quantized
layers on ONNX Runtime's integer kernels (`int8_layers` its int8
layers); `graph` holds the small utilities both passes share.
`formats.get("onnx")` reads `FORMAT`.
"""

from keras_selfattn.export.formats.onnx.format import FORMAT

__all__ = ["FORMAT"]
