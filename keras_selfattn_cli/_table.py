"""The export formats' table, read without importing keras_selfattn.

The table is `keras_selfattn_runtimes.table`, which imports only the
standard library, in a package beside `keras_selfattn`: importing it by name
does not run `keras_selfattn/__init__.py`, which imports Keras and
TensorFlow (it must: it registers the layer for `keras.saving.load_model`).
The exporters read the same module.
"""

from __future__ import annotations

from types import ModuleType


def load() -> ModuleType:
    """The table module (`ROWS`, `BY_NAME`, `FILE_ROWS`, ...)."""
    from keras_selfattn_runtimes import table

    return table
