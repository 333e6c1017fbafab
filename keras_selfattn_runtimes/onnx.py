"""An ONNX model in an ONNX Runtime CPU session."""

from __future__ import annotations

import json

import numpy as np

from ._common import Loaded

# Where the exporter says how a quantized model computes
# (formats.onnx.integer.METADATA_KEY; not imported: no Keras here).
METADATA_KEY = "keras_selfattn.quantization"
_ONNX_RUNTIME_QUANTIZER = {
    "DynamicQuantizeLinear",
    "DynamicQuantizeMatMul",
    "MatMulIntegerToFloat",
}


class OnnxSession(Loaded):
    """An ONNX Runtime CPU session (module docstring)."""

    def __init__(self, path: str, spinning: bool):
        import onnxruntime

        options = onnxruntime.SessionOptions()
        if not spinning:
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self._session = onnxruntime.InferenceSession(
            path, options, providers=["CPUExecutionProvider"]
        )
        self.input_names = [i.name for i in self._session.get_inputs()]
        self.output_names = [o.name for o in self._session.get_outputs()]
        self.description = self._describe(path)

    def _describe(self, path: str) -> dict:
        stated = self._session.get_modelmeta().custom_metadata_map.get(METADATA_KEY)
        if stated:
            stated = json.loads(stated)
            schemes = sorted(set(stated["layers"].values()))
            return {"scheme": "; ".join(schemes), "exact": stated["exact"]}
        import onnx  # the ONNX runtime's own package, no Keras

        graph = onnx.load(path, load_external_data=False).graph  # no weights
        ops = {node.op_type for node in graph.node}
        if ops & _ONNX_RUNTIME_QUANTIZER:
            scheme = "int8 activations per tensor, asymmetric (quantize_dynamic)"
            return {"scheme": scheme, "exact": False}
        return {}

    def __call__(self, arrays):
        feed = {k: np.asarray(v) for k, v in arrays.items()}
        values = self._session.run(None, feed)
        return dict(zip(self.output_names, values, strict=True))


def load(path: str, signature: str, spinning: bool = True) -> OnnxSession:
    """The ONNX file `path` in a CPU session (`signature`: ONNX has one).

    Args:
        path: The .onnx file.
        signature: Unused: an ONNX model has one graph.
        spinning: Whether the session's threads spin after each call (ONNX
            Runtime's default); False leaves the cores to whatever runs next
            (a benchmark's interleaved rounds).
    """
    return OnnxSession(path, spinning)
