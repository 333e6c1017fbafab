"""An OpenVINO IR (.xml + .bin) compiled for OpenVINO's CPU plugin."""

from __future__ import annotations

import json

from ._common import Loaded

# Where the exporter says how a quantized model computes (its rt_info;
# formats.openvino.SCHEME_KEY, not imported: no Keras here).
SCHEME_KEY = "keras_selfattn_quantization"


class OpenVINOModel(Loaded):
    """An IR compiled for the CPU at one precision (module docstring)."""

    def __init__(self, path: str, precision: str):
        import openvino

        core = openvino.Core()
        model = core.read_model(path)
        config = {"INFERENCE_PRECISION_HINT": precision} if precision else {}
        self._compiled = core.compile_model(model, "CPU", config)
        self.description = {}
        if model.has_rt_info(SCHEME_KEY):
            stated = json.loads(model.get_rt_info(SCHEME_KEY).astype(str))
            scheme = "; ".join(sorted(set(stated["layers"].values())))
            self.description = {"scheme": scheme, "exact": stated["exact"]}
        self.input_names = [port.get_any_name() for port in model.inputs]
        self.output_names = [
            port.get_any_name() if port.get_names() else f"output_{index}"
            for index, port in enumerate(model.outputs)
        ]

    def __call__(self, arrays):
        result = self._compiled([arrays[name] for name in self.input_names])
        values = [result[port] for port in self._compiled.outputs]
        return dict(zip(self.output_names, values, strict=True))


def load(path: str, signature: str, precision: str = "f32") -> OpenVINOModel:
    """The IR `path` compiled for the CPU (`signature`: an IR has one).

    Args:
        path: The .xml file (its .bin beside it).
        signature: Unused: an IR has one model.
        precision: OpenVINO's INFERENCE_PRECISION_HINT ("f32", "bf16"), or
            "" for the CPU's default (bf16 on CPUs with AVX512-BF16).
    """
    return OpenVINOModel(path, precision)
