"""The pip extra that installs TensorFlow and TF Serving's protos (not in the
base install), and the one-line ImportError of what needs them."""

from __future__ import annotations

import importlib.util

EXTRA = "tensorflow"
MODULES = ("tensorflow", "tensorflow_serving")


def missing(what: str, error: ImportError | str) -> ImportError:
    """The one-line ImportError of `what` needing the extra."""
    return ImportError(
        f"{what} needs TensorFlow and TF Serving's protos ({error}). "
        f"Install them with: pip install 'keras_selfattn[{EXTRA}]'"
    )


def is_missing(error: ImportError) -> bool:
    """Whether `error` is one of the extra's modules not found."""
    return (getattr(error, "name", None) or "").split(".")[0] in MODULES


def require(what: str) -> None:
    """Raises `missing(what, ...)` unless the extra's modules are installed."""
    for module in MODULES:
        if importlib.util.find_spec(module) is None:
            raise missing(what, f"No module named {module!r}")
