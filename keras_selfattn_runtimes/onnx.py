"""An ONNX model in an ONNX Runtime CPU session.

A float model whose weights are external data (`model.onnx.data`: past 2
GiB) runs without ONNX Runtime's prepacking by default: the session maps
the data file, and prepacking would copy every matrix multiplication's
weight beside it: about one copy of the weights more in the checking
process.
The float matrix multiplications compute the same without it (the weight
is packed on each call instead); a quantized model keeps it, since its
integer kernels compute otherwise unpacked.
"""

from __future__ import annotations

import json
import os

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
# An .onnx file at most this large is read to see whether its weights are
# external data (one whose weights are has only their names and shapes).
_WEIGHTLESS_BYTES = 2**28
# Ops of a quantized model whose prepacked form computes otherwise.
_INTEGER_OPS = _ONNX_RUNTIME_QUANTIZER | {
    "ConvInteger",
    "MatMulInteger",
    "MatMulNBits",
    "QLinearConv",
    "QLinearMatMul",
}


class OnnxSession(Loaded):
    """An ONNX Runtime CPU session (module docstring)."""

    def __init__(self, path: str, spinning: bool, prepacking: bool | None):
        import onnxruntime

        options = onnxruntime.SessionOptions()
        if not spinning:
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        if prepacking is None:
            prepacking = not _float_with_external_data(path)
        if not prepacking:
            options.add_session_config_entry("session.disable_prepacking", "1")
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
            return {
                "scheme": "; ".join(schemes),
                "exact": stated["exact"],
                "rounds_inputs": stated.get("rounds_inputs", False),
            }
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


def _ops(graph) -> set[str]:
    """The op types of `graph` and of its subgraphs, at any depth."""
    ops = set()
    for node in graph.node:
        ops.add(node.op_type)
        for attribute in node.attribute:
            inner = [*attribute.graphs]
            if attribute.HasField("g"):
                inner.append(attribute.g)
            for subgraph in inner:
                ops |= _ops(subgraph)
    return ops


def _float_with_external_data(path: str) -> bool:
    """Whether the model at `path` keeps weights as external data and has
    no integer kernel (module docstring); a file holding its weights is
    not read for it."""
    import onnx  # the ONNX runtime's own package, no Keras

    if os.path.getsize(path) > _WEIGHTLESS_BYTES:
        return False
    model = onnx.load(path, load_external_data=False)  # no weights
    external = any(
        tensor.data_location == onnx.TensorProto.EXTERNAL
        for tensor in model.graph.initializer
    )
    stated = any(entry.key == METADATA_KEY for entry in model.metadata_props)
    return external and not stated and not _ops(model.graph) & _INTEGER_OPS


def load(
    path: str, signature: str, spinning: bool = True, prepacking: bool | None = None
) -> OnnxSession:
    """The ONNX file `path` in a CPU session (`signature`: ONNX has one).

    Args:
        path: The .onnx file.
        signature: Unused: an ONNX model has one graph.
        spinning: Whether the session's threads spin after each call (ONNX
            Runtime's default); False leaves the cores to whatever runs next
            (a benchmark's interleaved rounds).
        prepacking: Whether ONNX Runtime prepacks the weights of its
            kernels. None (default): yes, except for a float model whose
            weights are external data (module docstring).
    """
    return OnnxSession(path, spinning, prepacking)
