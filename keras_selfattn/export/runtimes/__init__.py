"""Exported artifacts loaded and called in their own runtime, never Keras.

One module per runtime, each importing only numpy and its runtime (a
format's row names its module: `FormatRow.runtime_module`), each with one
`load(path, signature, **options)` returning a `_common.Loaded`: the
artifact's input and output names, what it says of a quantized model
(`description`), and a call from {input name: array} to {output name:
array}. The check's runtime process (`export/parity/_runner_process.py`)
imports this package from its path, without keras_selfattn; the benchmarks
import it by name. Nothing here imports Keras or keras_selfattn.
"""

from __future__ import annotations

import importlib

from ._common import Loaded

# The signature a Keras export serves (a SavedModel's, LiteRT's).
SERVING = "serving_default"


def load(module: str, path: str, signature: str = SERVING, **options: object) -> Loaded:
    """The artifact at `path` loaded by the runtime module `module`
    (`FormatRow.runtime_module`), its `signature`, with the module's
    `options`."""
    runtime = importlib.import_module(f"{__name__}.{module}")
    return runtime.load(path, signature, **options)
