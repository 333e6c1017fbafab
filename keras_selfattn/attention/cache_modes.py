"""How cached calls are traced: three flags a caller sets around tracing
(`checked_by_caller`, `time_major`, `gathered_writes`), and the cache's
layout under them.

Each flag is decided while a call is traced, nests, and holds in the thread
(or asyncio task) that entered it.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import keras
from keras import ops

from keras_selfattn import _converting


@contextlib.contextmanager
def _raised(flag: contextvars.ContextVar) -> Iterator[None]:
    """Sets the bool `flag` within the context (the contexts below)."""
    token = flag.set(True)
    try:
        yield
    finally:
        flag.reset(token)


_CHECKED_BY_CALLER = contextvars.ContextVar(
    "keras_selfattn_cache_checked_by_caller", default=False
)


def checked_by_caller() -> contextlib.AbstractContextManager[None]:
    """Within this context, cached calls make no run-time checks (`Guard`),
    zero no cache slot and no output: for a caller that has proven every
    index, batch and cache shape it passes valid, whose caches hold zeros in
    every slot no query may attend (padded, or not yet written), and whose
    new positions are all real tokens (True in the padding mask), as the
    generation loop's steps after the prompt do. Decided while a call is
    traced; it nests."""
    return _raised(_CHECKED_BY_CALLER)


def is_checked_by_caller() -> bool:
    """Whether calls traced now are within `checked_by_caller()`."""
    return _CHECKED_BY_CALLER.get()


_TIME_MAJOR = contextvars.ContextVar("keras_selfattn_cache_time_major", default=False)


def time_major() -> contextlib.AbstractContextManager[None]:
    """Within this context, cached calls take and return their caches
    time-major, `(2, max_length, batch, num_key_value_heads, key_dim)`
    (`to_time_major`), and their keys and values are the leading slices
    `cache[0][:n]` and `cache[1][:n]`, which a TensorFlow graph reads as
    views of the cache; in the public layout `cache[:, 0, :n]` is a copy
    on every call. Only for callers that `views_pay()` and that decode one
    position per call within `checked_by_caller()`, as the generation
    loop's steps do. A call writes into the buffer of the cache it takes
    (`cache_writes`): callers read only the cache it returns. Decided
    while a call is traced; it nests."""
    return _raised(_TIME_MAJOR)


def is_time_major() -> bool:
    """Whether calls traced now are within `time_major()`."""
    return _TIME_MAJOR.get()


def views_pay() -> bool:
    """Whether calls traced now would read time-major caches as views: in
    a TensorFlow graph that XLA does not compile, traced for no converter
    (XLA, JAX's and PyTorch's graphs and the converters slice to static
    lengths or gather, so there the public layout costs nothing more)."""
    return outside_xla() and not _converting.tracing_for_converter()


_GATHERED_WRITES = contextvars.ContextVar(
    "keras_selfattn_gathered_cache_writes", default=False
)


def gathered_writes() -> contextlib.AbstractContextManager[None]:
    """Within this context, cached calls write their caches as one gather
    (`cache_writes`) instead of a dynamic update slice: for converters that
    have no such op (OpenVINO's TensorFlow frontend has no
    XlaDynamicUpdateSlice). Decided while a call is traced; it nests."""
    return _raised(_GATHERED_WRITES)


def is_gathered_writes() -> bool:
    """Whether calls traced now are within `gathered_writes()`."""
    return _GATHERED_WRITES.get()


def outside_xla() -> bool:
    """Whether this call is traced into a TensorFlow graph that XLA does not
    compile (not eager, not under `jit_compile=True`): there tensors may
    have sizes known only when it runs (eager calls know every size; XLA
    under `jax.jit` or `jit_compile=True` needs static ones)."""
    if keras.backend.backend() != "tensorflow":
        return False
    import tensorflow as tf

    if tf.executing_eagerly():
        return False
    try:
        from tensorflow.python.ops import control_flow_util
    except ImportError:  # pragma: no cover - TF internals moved: be safe.
        return False
    return not control_flow_util.GraphOrParentsInXlaContext(
        tf.compat.v1.get_default_graph()
    )


def max_length(cache):
    """The cache's `max_length` as its shape gives it (None where unknown)."""
    return tuple(cache.shape)[1 if _TIME_MAJOR.get() else 2]


def batch_axis() -> int:
    return 2 if _TIME_MAJOR.get() else 0


def to_time_major(cache):
    """`(B, 2, L, G, K)` -> `(2, L, B, G, K)`."""
    return ops.transpose(cache, (1, 2, 0, 3, 4))
