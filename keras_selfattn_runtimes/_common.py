"""What every runtime module's `load` returns, and the names they sort."""

from __future__ import annotations

import re
from collections.abc import Mapping

import numpy as np

_NUMBERED = re.compile(r"^(.*?)(\d+)$")


def natural(name: str) -> tuple:
    """Sort key putting output_2 before output_10."""
    match = _NUMBERED.match(name)
    return (match.group(1), int(match.group(2))) if match else (name, -1)


class Loaded:
    """An artifact loaded in its runtime.

    Attributes:
        input_names: The artifact's input names, in its order.
        output_names: Its output names, in its order.
        description: How it computes a quantized model, as the artifact
            says or its runtime shows: {"scheme": str, "exact": bool}, or {};
            "rounds_inputs": True where it rounds inputs Keras's layers
            multiply as floats (an ONNX file's `int4_inputs="int8"`).
        positional_inputs: Whether its input names say only positions
            (torch.export keeps argument positions only).
    """

    input_names: list[str]
    output_names: list[str]
    description: dict
    positional_inputs = False

    def __call__(self, arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Outputs keyed by `output_names` of inputs keyed by `input_names`."""
        raise NotImplementedError
