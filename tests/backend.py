"""What the tests need from the Keras backend they run on.

The suite runs under KERAS_BACKEND=tensorflow, jax and torch (tests/conftest.py
sets none when the variable is given). Layer tests go through these helpers
instead of `tf.GradientTape`, `tf.function` or `np.asarray` on tensors, so the
same assertions hold on every backend. Each helper imports only the current
backend's framework, and only when called.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np

BACKEND: str = keras.backend.backend()


def to_numpy(x: Any) -> np.ndarray:
    """A backend tensor, Keras variable or array-like as a numpy array.

    Torch tensors that require grad are detached; bfloat16 comes back as
    ml_dtypes' bfloat16.
    """
    if isinstance(x, keras.Variable):
        x = x.value
    return np.asarray(keras.ops.convert_to_numpy(x))


def value_and_grad(
    fn: Callable[..., Any],
    variables: Sequence[keras.Variable] = (),
    inputs: Sequence[Any] = (),
) -> tuple[np.ndarray, list[np.ndarray | None]]:
    """The scalar `fn(*inputs)` and its gradients, as numpy.

    Args:
        fn: Called as `fn(*input_tensors)` with `inputs` as backend tensors;
            returns a scalar loss. It may read `variables` (through layers),
            which must already exist: build layers before this call.
        variables: Trainable Keras variables to differentiate with respect to.
        inputs: Arrays (numpy or backend tensors) to differentiate with
            respect to; floating point.

    Returns:
        (loss, gradients): gradients of `variables` then of `inputs`, in
        order. A gradient is None where the loss does not depend on its
        target on TensorFlow and torch; JAX gives zeros there.
    """
    variables = list(variables)
    if BACKEND == "tensorflow":
        import tensorflow as tf

        tensors = [tf.convert_to_tensor(x) for x in inputs]
        with tf.GradientTape() as tape:
            tape.watch(tensors)
            loss = fn(*tensors)
        grads = tape.gradient(loss, [v.value for v in variables] + tensors)
    elif BACKEND == "jax":
        import jax
        import jax.numpy as jnp

        def pure(values, tensors):
            mapping = list(zip(variables, values, strict=True))
            with keras.StatelessScope(state_mapping=mapping):
                return fn(*tensors)

        values = [v.value for v in variables]
        tensors = [jnp.asarray(x) for x in inputs]
        loss, (variable_grads, input_grads) = jax.value_and_grad(pure, argnums=(0, 1))(
            values, tensors
        )
        grads = list(variable_grads) + list(input_grads)
    elif BACKEND == "torch":
        import torch

        tensors = [
            keras.ops.convert_to_tensor(x).detach().requires_grad_(True) for x in inputs
        ]
        loss = fn(*tensors)
        grads = torch.autograd.grad(
            loss, [v.value for v in variables] + tensors, allow_unused=True
        )
    else:
        raise NotImplementedError(f"No gradients for KERAS_BACKEND={BACKEND}")
    return to_numpy(loss), [None if g is None else to_numpy(g) for g in grads]


def compiled(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` traced into a graph: `tf.function` on TensorFlow, `jax.jit` on JAX.

    Torch runs `fn` eagerly (torch.compile is not part of the layer's
    contract and takes minutes on a CPU). On JAX the trace runs in a
    `keras.StatelessScope`: variable updates made inside it (a dropout
    seed's state) are dropped instead of leaking tracers, as in any pure
    jitted function.
    """
    if BACKEND == "tensorflow":
        import tensorflow as tf

        return tf.function(fn)
    if BACKEND == "jax":
        import jax

        def pure(*args: Any, **kwargs: Any) -> Any:
            with keras.StatelessScope():
                return fn(*args, **kwargs)

        return jax.jit(pure)
    return fn
