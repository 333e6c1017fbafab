"""Where a cached call runs, as the caches that must know it read it: in a
TensorFlow graph that XLA does not compile, or in eager PyTorch; and
whether it is a step of the generation loop with time-major caches."""

from __future__ import annotations

import keras

from keras_selfattn import decoding, tracing


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


def time_major_step() -> bool:
    """Whether this call is a step of the generation loop whose caches are
    time-major (`layouts.TimeMajorCache`: a TensorFlow graph without XLA,
    the SavedModel generator's and `generate`'s on TensorFlow), as the
    active decoding scope holds them."""
    scope = decoding.active()
    return scope is not None and any(c.time_major for c in scope.caches.values())
