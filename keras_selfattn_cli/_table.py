"""The export formats' table, read without importing keras_selfattn.

The table is `keras_selfattn/export/formats/table.py`, which imports only
the standard library. Importing it the usual way would first run
`keras_selfattn/__init__.py`, which imports Keras and TensorFlow (it must:
it registers the layer for `keras.saving.load_model`), so the command line
loads the file by its path, found without running the package
(`importlib.util.find_spec` of a top-level package only locates it). Once
keras_selfattn is imported, its own module is used.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType

_MODULE = "keras_selfattn.export.formats.table"


def load() -> ModuleType:
    """The table module (`ROWS`, `BY_NAME`, `FILE_ROWS`, ...)."""
    if _MODULE in sys.modules:
        return sys.modules[_MODULE]
    package = importlib.util.find_spec("keras_selfattn")
    path = os.path.join(
        package.submodule_search_locations[0], "export", "formats", "table.py"
    )
    name = f"{__name__}.format_table"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module
