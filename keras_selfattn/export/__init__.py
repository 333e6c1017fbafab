"""Export models containing SelfAttention, proven equal to Keras.

- `export_saved_model`: TF Serving layout `base_dir/name/VERSION/`, signature
  `serving_default` with named inputs and outputs, optional warmup file and
  `models.config` (TensorFlow, JAX).
- `export_onnx`: an ONNX file (tf2onnx on TensorFlow, optionally with fused
  Attention nodes; Keras's jax2onnx / torch.onnx route on JAX and torch).
- `export_litert` (.tflite; TensorFlow, torch at fixed shapes),
  `export_openvino` (.xml + .bin; TensorFlow, torch), `export_torch` (.pt2;
  torch): through Keras's own `model.export`.
- `export_decode_step` (any format), `export_decode_step_saved_model`,
  `export_decode_step_onnx`, `verify_decode_step`: a decoding step (new
  positions + one key/value cache per causal SelfAttention + index ->
  output + updated caches), checked step by step over whole sequences
  (`keras_selfattn.export.decode_step`).
- `verify`: compares any of these artifacts (Keras's own exports too) with
  Keras on several shapes, each in a fresh process running only its
  runtime, and returns a `ParityReport`, raising `ParityError` beyond
  tolerance.

Every export is written beside its target, verified, then moved into place.
Importing this package loads neither TensorFlow nor any runtime; the
exporters import them on use and name the extra to install when one is
missing (`[onnx]`, `[litert]`, `[openvino]`). Where Keras has no route for a
format on the current backend the exporters raise a one-line ValueError
naming the backend that works (see `_backends`).
"""

from types import ModuleType

from keras_selfattn.export.decode_step import (
    export_decode_step,
    export_decode_step_onnx,
    export_decode_step_saved_model,
    verify_decode_step,
)
from keras_selfattn.export.formats import (
    export_litert,
    export_openvino,
    export_torch,
)
from keras_selfattn.export.saved_model import export_saved_model
from keras_selfattn.export.verify import ParityError, ParityReport, ParityRow, verify

__all__ = [
    "ParityError",
    "ParityReport",
    "ParityRow",
    "export_decode_step",
    "export_decode_step_onnx",
    "export_decode_step_saved_model",
    "export_litert",
    "export_onnx",
    "export_openvino",
    "export_saved_model",
    "export_torch",
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
