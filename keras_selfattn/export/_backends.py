"""Which Keras backend can export which format, and the way when it cannot.

Measured with Keras 3.15 (see the README's "Keras backends"):

- SavedModel: TensorFlow, and JAX through jax2tf. Keras exports torch
  models to a SavedModel only through torch_xla.
- ONNX: TensorFlow (tf2onnx, the fused-Attention rewrite too), JAX
  (jax2onnx) and torch (torch.onnx), the last two through Keras's
  `model.export(format="onnx")`.
- LiteRT: TensorFlow (TFLite converter, dynamic shapes) and torch
  (litert-torch, fixed shapes). Keras has no JAX route.
- OpenVINO: TensorFlow and torch through Keras's exporter.
- torch (.pt2): torch only (`torch.export`).

Every artifact is checked against Keras on the current backend, in a fresh
process running the artifact's own runtime (`_runtimes`).
"""

from __future__ import annotations

import keras

from keras_selfattn.export._runtimes import (
    LITERT,
    ONNX,
    OPENVINO,
    SAVED_MODEL,
    TORCH,
)

# The fused-Attention ONNX rewrite, which reads tf2onnx's graph.
FUSED_ONNX = "fused_onnx"
# How errors name each format.
TITLE = {
    FUSED_ONNX: "Fused-Attention ONNX",
    SAVED_MODEL: "SavedModel",
    ONNX: "ONNX",
    LITERT: "LiteRT",
    OPENVINO: "OpenVINO",
    TORCH: "torch (.pt2)",
}
_SUPPORTED = {
    SAVED_MODEL: ("tensorflow", "jax"),
    ONNX: ("tensorflow", "jax", "torch"),
    LITERT: ("tensorflow", "torch"),
    OPENVINO: ("tensorflow", "torch"),
    TORCH: ("torch",),
    FUSED_ONNX: ("tensorflow",),
}
_WHY_NOT = {
    (SAVED_MODEL, "torch"): "Keras exports torch models to it only through torch_xla",
    (LITERT, "jax"): "Keras converts to LiteRT only from TensorFlow and torch",
    (OPENVINO, "jax"): (
        "Keras's jax2tf route gives XlaCallModule ops, which OpenVINO cannot convert"
    ),
    (FUSED_ONNX, "jax"): "the rewrite reads the names of tf2onnx's graph",
    (FUSED_ONNX, "torch"): "the rewrite reads the names of tf2onnx's graph",
    (TORCH, "tensorflow"): "torch.export needs the torch backend",
    (TORCH, "jax"): "torch.export needs the torch backend",
}


def require_backend(export_format: str) -> None:
    """Raises a one-line ValueError if the current backend cannot export this.

    Args:
        export_format: One of `_runtimes.FORMATS`, or `FUSED_ONNX`.

    Raises:
        ValueError: naming the backend, why, and the way that works.
    """
    backend = keras.backend.backend()
    supported = _SUPPORTED[export_format]
    if backend in supported:
        return
    reason = _WHY_NOT.get((export_format, backend), "Keras cannot export it there")
    raise ValueError(
        f"{TITLE[export_format]} export does not run on the {backend} backend "
        f"({reason}): save the model as .keras, load it under "
        f"KERAS_BACKEND={supported[0]} and export there"
    )
