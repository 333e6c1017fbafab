"""How a call is traced: the modes a caller sets around tracing, in one place.

Each mode changes the graph that calls traced within it write, for a caller
that needs a different graph; the numbers stay the layer's (up to float32
rounding where a mode says so):

- `FOR_CONVERTER`: TensorFlow traces for a converter (tf2onnx, LiteRT's),
  which takes a narrower set of ops than TensorFlow runs: the exported
  graphs build converter caches (`attention.cache.ConverterCache`, written
  with XlaDynamicUpdateSlice, which they convert; TensorFlow's own
  TensorStridedSliceUpdate they do not) and sampling selects between
  greedy and sampled tokens instead of branching (tf2onnx cannot convert
  the sampling ops inside an ONNX `If`).
- `CONVERTER_BRANCHES`: with `FOR_CONVERTER`, for a converter that takes
  TensorFlow's branches (LiteRT's writes `tf.cond` as its IF operator):
  sampling branches on the temperature as it does outside converters, so
  a greedy step skips the two sorts of the vocabulary.
- `EXACT_UNCHUNKED`: calls take an exact unchunked path, never the chunked
  one (a loop over blocks), for formats that cannot hold that loop: the
  artifact computes attention whole, the chunked path's numbers up to
  float32 rounding, without `chunk_size`'s memory bound.

`traced_as(*modes)` sets modes within a context and `active(mode)` reads
one; `torch_traced()` says whether PyTorch itself traces the call. A
mode is decided while a call is traced, so a traced function keeps the
graph it was traced with; it nests, and holds only in the thread (or
asyncio task) that entered it (a `contextvars.ContextVar` each).

`FUSABLE_CORE_SCOPE` is the other contract of a traced graph: the name
scope under which the explicit path computes its core, (B, H, T, K) query
and key, (B, H, T, V) value and the bool mask in, (B, H, T, V) heads out,
which the fused ONNX export (`export.formats.onnx.fused`) replaces by ONNX's
Attention operator. `FUSABLE_STEP_SCOPE` is its decoding step's
counterpart: the name scope under which the single-query path
(`attention.single_query`) computes one new position's attention over the
cache, (B, 1, H, K) query, the keys and values as read from the cache
(time-major (Tk, B, H_kv, D) or (B, Tk, H_kv, D)) and the bool key mask
(None, or (Tk, B or 1, 1, 1), resp. (B or 1, Tk, 1, 1)) in, (B, 1, H, V)
out, which the fused ONNX generator (`export.formats.onnx.loop_attention`)
replaces by ONNX's Attention operator. A name scope adds no computation.

Example:

>>> from keras_selfattn import tracing
>>> with tracing.traced_as(tracing.EXACT_UNCHUNKED):
...     tracing.active(tracing.EXACT_UNCHUNKED)
True
>>> tracing.active(tracing.EXACT_UNCHUNKED)
False
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

FOR_CONVERTER = "for_converter"
CONVERTER_BRANCHES = "converter_branches"
EXACT_UNCHUNKED = "exact_unchunked"
MODES = (FOR_CONVERTER, CONVERTER_BRANCHES, EXACT_UNCHUNKED)

FUSABLE_CORE_SCOPE = "fusable_attention_core"
FUSABLE_STEP_SCOPE = "fusable_step_core"

_FLAGS = {
    mode: contextvars.ContextVar(f"keras_selfattn_{mode}", default=False)
    for mode in MODES
}


def _check(mode: str) -> contextvars.ContextVar:
    if mode not in _FLAGS:
        raise ValueError(f"`mode` must be one of {MODES}. Received: mode={mode!r}")
    return _FLAGS[mode]


@contextlib.contextmanager
def traced_as(*modes: str) -> Iterator[None]:
    """Within this context, calls are traced in `modes` (module docstring).

    Args:
        *modes: Any of `MODES`.

    Raises:
        ValueError: if a mode is unknown (before any is set).
    """
    flags = [_check(mode) for mode in modes]
    tokens = [(flag, flag.set(True)) for flag in flags]
    try:
        yield
    finally:
        for flag, token in reversed(tokens):
            flag.reset(token)


def active(mode: str) -> bool:
    """Whether calls traced now are within `traced_as(mode)`.

    Raises:
        ValueError: if `mode` is unknown.
    """
    return _check(mode).get()


_TORCH_RECORDING = contextvars.ContextVar(
    "keras_selfattn_torch_recording", default=False
)


@contextlib.contextmanager
def torch_recording() -> Iterator[None]:
    """Within this context, PyTorch records the calls made as a graph of its
    ops (`make_fx`, for `generate`'s replayed steps): they are traced as
    `torch_traced()` says, sizes and values known only when the graph runs."""
    token = _TORCH_RECORDING.set(True)
    try:
        yield
    finally:
        _TORCH_RECORDING.reset(token)


def torch_recorded() -> bool:
    """Whether the call being made is recorded (`torch_recording`)."""
    return _TORCH_RECORDING.get()


def torch_traced() -> bool:
    """Whether PyTorch traces the call being made: `torch.jit.trace`
    (Keras's ONNX export with dynamic shapes, its OpenVINO export),
    `torch.export` (its `.pt2`, LiteRT and static-shape ONNX exports),
    `torch.compile`, or a recording (`torch_recording`). For the torch
    backend (it imports torch)."""
    import torch

    return (
        torch_recorded()
        or torch.jit.is_tracing()
        or torch.compiler.is_exporting()
        or torch.compiler.is_compiling()
    )
