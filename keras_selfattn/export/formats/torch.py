"""torch.export programs (.pt2), torch backend only.

The program takes the inputs as one list, in the target's input order, with
dynamic "batch" and "time" dimensions (Keras traces fixed sizes unless
told), and returns the outputs as a list. Quantized layers dequantize their
stored integers once per call (`quantization.VARIABLES`).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping

from keras_selfattn.export import quantization
from keras_selfattn.export.formats._base import Format, converting
from keras_selfattn.export.signature import Signature
from keras_selfattn_runtimes import table


def dynamic_shapes(target: Signature) -> list:
    """`torch.export` dims: axis 0 "batch", other dynamic axes one "time"."""
    import torch

    dims = {
        "batch": torch.export.Dim("batch"),
        "time": torch.export.Dim("time"),
    }
    per_input = [
        {
            axis: dims[name]
            for axis, name in enumerate(spec.axis_names())
            if name in dims
        }
        or None
        for spec in target.inputs
    ]
    return [(per_input,)]  # Keras's module takes one positional list


class TorchFormat(Format):
    """`torch.export` programs, checked with `torch.export.load`."""

    row = table.TORCH
    quantized_form = quantization.VARIABLES
    advice = "export ONNX instead"

    def write(
        self, target: Signature, path: str, options: Mapping[str, object]
    ) -> None:
        with (
            converting(self.row.title, self.advice),
            target.traced(self.quantized_form),
            warnings.catch_warnings(),
        ):
            warnings.simplefilter("ignore")
            target.keras_model().export(
                path,
                format="torch",
                verbose=False,
                input_signature=target.input_signature(),
                dynamic_shapes=dynamic_shapes(target),
            )


FORMAT = TorchFormat()
