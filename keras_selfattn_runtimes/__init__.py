"""The export formats' table and the runtimes that run exported artifacts,
never Keras: a package beside `keras_selfattn`, importable by name without
it (`keras_selfattn`'s `__init__` imports Keras).

`table` has one row per format (the standard library only: the command
line reads it for `--help`). One module per runtime, each importing only
numpy and its runtime (a format's row names its module:
`FormatRow.runtime_module`), each with one `load(path, signature,
**options)` returning a `_common.Loaded`: the artifact's input and output
names, what it says of a quantized model (`description`), and a call from
{input name: array} to {output name: array}. The check's runtime process
(`keras_selfattn/export/parity/_runner_process.py`) and the benchmarks
import it by name. Nothing here imports Keras or keras_selfattn, and
importing the package imports no runtime (nor numpy).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._common import Loaded

# The signature a Keras export serves (a SavedModel's, LiteRT's).
SERVING = "serving_default"


def load(module: str, path: str, signature: str = SERVING, **options: object) -> Loaded:
    """The artifact at `path` loaded by the runtime module `module`
    (`FormatRow.runtime_module`), its `signature`, with the module's
    `options`."""
    runtime = importlib.import_module(f"{__name__}.{module}")
    return runtime.load(path, signature, **options)
