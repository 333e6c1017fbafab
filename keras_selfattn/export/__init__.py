"""Export models containing SelfAttention, proven equal to Keras.

- `export_saved_model`: TF Serving layout `base_dir/name/VERSION/`, signature
  `serving_default` with named inputs and outputs, optional warmup file and
  `models.config`.
- `export_onnx`: an ONNX file through tf2onnx, checked in onnxruntime.
- `verify`: compares either or both with Keras on several shapes and returns a
  `ParityReport`, raising `ParityError` beyond tolerance.
"""

from keras_selfattn.export.onnx_export import export_onnx
from keras_selfattn.export.saved_model import export_saved_model
from keras_selfattn.export.verify import ParityError, ParityReport, ParityRow, verify

__all__ = [
    "ParityError",
    "ParityReport",
    "ParityRow",
    "export_onnx",
    "export_saved_model",
    "verify",
]
