"""Export models containing SelfAttention, proven equal to Keras.

- `export_saved_model`: TF Serving layout `base_dir/name/VERSION/`, signature
  `serving_default` with named inputs and outputs, optional warmup file and
  `models.config`.
- `export_onnx`: an ONNX file through tf2onnx, checked in onnxruntime (needs
  the `onnx` extra: `pip install 'keras_selfattn[onnx]'`; imported on first
  use, so SavedModel export works without it).
- `export_decode_step_saved_model`, `export_decode_step_onnx`,
  `verify_decode_step`: a decoding step (new positions + one key/value
  cache per causal SelfAttention + index -> output + updated caches), checked
  step by step over whole sequences (`keras_selfattn.export.decode_step`;
  TensorFlow backend only).
- `verify`: compares either or both with Keras on several shapes and returns a
  `ParityReport`, raising `ParityError` beyond tolerance.

Importing this package loads neither TensorFlow nor the ONNX packages; the
exporters import them on use. SavedModel export runs on the TensorFlow and
JAX backends, ONNX export on TensorFlow, `verify` on every backend; elsewhere
the exporters raise a one-line ValueError saying how to export (see
`_backends`).
"""

from types import ModuleType

from keras_selfattn.export.decode_step import (
    export_decode_step_onnx,
    export_decode_step_saved_model,
    verify_decode_step,
)
from keras_selfattn.export.saved_model import export_saved_model
from keras_selfattn.export.verify import ParityError, ParityReport, ParityRow, verify

__all__ = [
    "ParityError",
    "ParityReport",
    "ParityRow",
    "export_decode_step_onnx",
    "export_decode_step_saved_model",
    "export_onnx",
    "export_saved_model",
    "verify",
    "verify_decode_step",
]


def onnx_export_module() -> ModuleType:
    """The ONNX exporter module, or an ImportError saying what to install."""
    try:
        from keras_selfattn.export import onnx_export
    except ImportError as error:
        raise ImportError(
            f"ONNX export needs onnx, tf2onnx and onnxruntime ({error}). "
            "Install them with: pip install 'keras_selfattn[onnx]'"
        ) from error
    return onnx_export


def __getattr__(name: str):
    if name == "export_onnx":
        return onnx_export_module().export_onnx
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
