"""Which Keras backend can export which format, and the way when it cannot.

Measured with Keras 3.15 (see the README's "Keras backends"):

- SavedModel: TensorFlow, and JAX through jax2tf (warmup records and the
  check against Keras run there too). Keras exports torch models to a
  SavedModel only through torch_xla.
- ONNX: TensorFlow only. This project converts with tf2onnx, which needs a
  TensorFlow graph, and its fused-Attention rewrite reads that graph's names.
  Keras's own routes are jax2onnx on JAX and torch.onnx on torch, whose
  tracer fixes the sequence length it traced (the file miscomputes longer
  sequences).

Every backend can `verify` an export: Keras runs on the current backend,
the SavedModel in TensorFlow and the ONNX file in onnxruntime.
"""

from __future__ import annotations

import keras

SAVED_MODEL = "SavedModel"
ONNX = "ONNX"

_SUPPORTED = {SAVED_MODEL: ("tensorflow", "jax"), ONNX: ("tensorflow",)}
_WHY_NOT = {
    (SAVED_MODEL, "torch"): "Keras exports torch models to it only through torch_xla",
    (ONNX, "jax"): "it converts through tf2onnx, which needs a TensorFlow graph",
    (ONNX, "torch"): (
        "torch.onnx fixes the sequence length it traced, so the file "
        "miscomputes other lengths"
    ),
}


def require_backend(export_format: str) -> None:
    """Raises a one-line ValueError if the current backend cannot export this.

    Args:
        export_format: `SAVED_MODEL` or `ONNX`.

    Raises:
        ValueError: naming the backend, why, and the way that works.
    """
    backend = keras.backend.backend()
    if backend in _SUPPORTED[export_format]:
        return
    reason = _WHY_NOT.get((export_format, backend), "Keras cannot export it there")
    raise ValueError(
        f"{export_format} export does not run on the {backend} backend "
        f"({reason}): save the model as .keras, load it under "
        "KERAS_BACKEND=tensorflow and export there"
    )
