"""Export models containing SelfAttention, proven equal to Keras.

- `export_saved_model`: TF Serving layout `base_dir/name/VERSION/`, signature
  `serving_default` with named inputs and outputs, optional warmup file and
  `models.config` (TensorFlow, JAX).
- `export_onnx`: an ONNX file (tf2onnx on TensorFlow, optionally with fused
  Attention nodes; Keras's jax2onnx / torch.onnx route on JAX and torch).
- `export_litert` (.tflite; TensorFlow, torch at fixed shapes),
  `export_openvino` (.xml + .bin; TensorFlow, torch), `export_torch` (.pt2;
  torch).
- `export(model, path, format, **options)`: any of these by the format's
  name, its options as keywords (Keras's `model.export` shape).
- `export_decode_step` (any format), `export_decode_step_saved_model`,
  `export_decode_step_onnx`, `verify_decode_step`: a decoding step (new
  positions + one key/value cache per causal SelfAttention + index ->
  output + updated caches), checked step by step over whole sequences
  (`keras_selfattn.export.decode_step`).
- `export_generator`, `verify_generator`: the whole generation as one call
  (prompts in, tokens out; SavedModel signature `generate`, ONNX `Loop`),
  checked against `keras_selfattn.generate` (`keras_selfattn.export.generator`).
- `verify`: compares any of these artifacts (Keras's own exports too) with
  Keras on several shapes, each in a fresh process running only its
  runtime, and returns a `ParityReport`, raising `ParityError` beyond
  tolerance.

Each export target is one package: `forward` (the exporters above and
`verify`), `decode_step` and `generator`, each with its graph (`graph`) and
its check (`check`); the pipeline, files, precision, quantization and
example inputs they share sit here. Each format is one module of
`keras_selfattn.export.formats`, read from one table (`formats.table`, the
module `keras_selfattn_runtimes.table`). Every export is written beside its target,
verified, then moved into place. A quantized model (`model.quantize`)
exports with Keras's integers on each runtime's integer kernels
(`keras_selfattn.export.quantization`). Importing this package loads neither
TensorFlow nor any runtime; the exporters import them on use and name the
extra to install when one is missing (`[onnx]`, `[litert]`, `[openvino]`).
A conversion that fails raises `ExportError`, one line naming the format,
the cause and what to do; where Keras has no route for a format on the
current backend the exporters raise a one-line ValueError naming the
backend that works.
"""

from keras_selfattn.export.decode_step import (
    export_decode_step,
    export_decode_step_onnx,
    export_decode_step_saved_model,
    verify_decode_step,
)
from keras_selfattn.export.formats import ExportError
from keras_selfattn.export.forward import (
    export,
    export_litert,
    export_onnx,
    export_openvino,
    export_saved_model,
    export_torch,
)
from keras_selfattn.export.forward.check import (
    ParityError,
    ParityReport,
    ParityRow,
    verify,
)
from keras_selfattn.export.generator import export_generator, verify_generator

__all__ = [
    "ExportError",
    "ParityError",
    "ParityReport",
    "ParityRow",
    "export",
    "export_decode_step",
    "export_decode_step_onnx",
    "export_decode_step_saved_model",
    "export_generator",
    "export_litert",
    "export_onnx",
    "export_openvino",
    "export_saved_model",
    "export_torch",
    "verify",
    "verify_decode_step",
    "verify_generator",
]
