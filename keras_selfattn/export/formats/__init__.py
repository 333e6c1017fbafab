"""The export formats: one module each, behind one protocol.

`table` (`keras_selfattn_runtimes.table`, which imports no Keras) has one
row per format (names, suffixes, backends, extras, the command line's
options); each format's module (`saved_model`, `onnx`,
`litert`, `openvino`, `torch`) implements `_base.Format` for its row and is
imported on first use (`get`), so that importing the export package loads
no converter or runtime.
"""

from __future__ import annotations

import importlib

from keras_selfattn.export.formats._base import (
    Destination,
    ExportError,
    Format,
    Writer,
    model_weight_bytes,
    one_line,
    released,
)
from keras_selfattn_runtimes import table
from keras_selfattn_runtimes.table import BY_NAME, NAMES, ROWS

__all__ = [
    "Destination",
    "ExportError",
    "Format",
    "NAMES",
    "ROWS",
    "Writer",
    "get",
    "model_weight_bytes",
    "one_line",
    "released",
    "table",
]


def get(name: str) -> Format:
    """The `Format` named `name` (one of `table.NAMES`).

    Raises:
        ValueError: for an unknown name.
    """
    if name not in BY_NAME:
        raise ValueError(
            f"`export_format` must be one of {NAMES}. Received: export_format={name!r}"
        )
    return importlib.import_module(f"{__name__}.{name}").FORMAT
