"""The cache's layout under the modes cached calls are traced in
(`keras_selfattn.tracing`: `CHECKED_BY_CALLER`, `TIME_MAJOR`,
`GATHERED_WRITES`), and whether a traced graph may have sizes known only
when it runs.
"""

from __future__ import annotations

import keras
from keras import ops

from keras_selfattn import tracing


def views_pay() -> bool:
    """Whether calls traced now would read time-major caches as views: in
    a TensorFlow graph that XLA does not compile, traced for no converter
    (XLA, JAX's and PyTorch's graphs and the converters slice to static
    lengths or gather, so there the public layout costs nothing more)."""
    return outside_xla() and not tracing.active(tracing.FOR_CONVERTER)


def torch_eager() -> bool:
    """Whether this call runs in eager PyTorch: not traced by
    `torch.jit.trace`, exported by `torch.export` or compiled."""
    return keras.backend.backend() == "torch" and not tracing.torch_traced()


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
    return tuple(cache.shape)[1 if tracing.active(tracing.TIME_MAJOR) else 2]


def batch_axis() -> int:
    return 2 if tracing.active(tracing.TIME_MAJOR) else 0


def to_time_major(cache):
    """`(B, 2, L, G, K)` -> `(2, L, B, G, K)`."""
    return ops.transpose(cache, (1, 2, 0, 3, 4))
