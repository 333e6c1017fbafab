"""Whether TensorFlow is tracing a graph for a converter.

TensorFlow's converters (tf2onnx, LiteRT's) take a narrower set of ops than
TensorFlow runs: within `for_converter()`, the decoding cache is written
with XlaDynamicUpdateSlice (which they convert; TensorFlow's own
TensorStridedSliceUpdate they do not) and sampling selects between greedy
and sampled tokens instead of branching (tf2onnx cannot convert the
sampling ops inside an ONNX `If`). Decided while a call is traced; it
nests, and holds in the thread (or asyncio task) that entered it.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

_FOR_CONVERTER: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "keras_selfattn_for_converter", default=False
)


@contextlib.contextmanager
def for_converter() -> Iterator[None]:
    """Within this context, traced calls use the ops TensorFlow's converters
    take (module docstring)."""
    token = _FOR_CONVERTER.set(True)
    try:
        yield
    finally:
        _FOR_CONVERTER.reset(token)


def tracing_for_converter() -> bool:
    """Whether the call is traced within `for_converter()`."""
    return _FOR_CONVERTER.get()
