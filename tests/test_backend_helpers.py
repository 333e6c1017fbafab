"""tests/backend.py against analytic results, on the backend the suite runs on."""

from __future__ import annotations

import os

import keras
import numpy as np
import pytest

from tests.backend import BACKEND, compiled, to_numpy, value_and_grad


def test_backend_is_the_requested_one():
    assert BACKEND == os.environ["KERAS_BACKEND"] == keras.backend.backend()


def test_value_and_grad_of_a_variable_and_an_input():
    # loss = sum(x^2 * w): d/dx = 2 x w, d/dw = sum over rows of x^2.
    x = np.array([[1.0, -2.0, 0.5], [3.0, 0.25, -1.0]], "float32")
    w = keras.Variable(np.array([0.5, 2.0, -3.0], "float32"), name="w")

    def loss(x):
        return keras.ops.sum(keras.ops.square(x) * w)

    value, (grad_w, grad_x) = value_and_grad(loss, variables=[w], inputs=[x])
    assert isinstance(value, np.ndarray) and value.shape == ()
    np.testing.assert_allclose(value, np.sum(x**2 * w.numpy()), rtol=1e-6)
    np.testing.assert_allclose(grad_w, np.sum(x**2, axis=0), rtol=1e-6)
    np.testing.assert_allclose(grad_x, 2 * x * w.numpy(), rtol=1e-6)
    assert isinstance(grad_w, np.ndarray) and isinstance(grad_x, np.ndarray)


def test_value_and_grad_through_a_layer_leaves_its_weights_alone():
    # loss = sum(x @ kernel + bias): d/dkernel[i, j] = sum_b x[b, i],
    # d/dbias = batch size, d/dx[b, i] = sum_j kernel[i, j].
    layer = keras.layers.Dense(2)
    x = np.random.default_rng(0).normal(size=(4, 3)).astype("float32")
    layer.build(x.shape)
    before = [w.copy() for w in layer.get_weights()]
    value, grads = value_and_grad(
        lambda x: keras.ops.sum(layer(x)), layer.trainable_variables, [x]
    )
    kernel, bias = before
    # The sum of eight O(1) terms can cancel to near zero (0.0034 was seen,
    # 1.2e-7 away in float32): an absolute tolerance as well.
    np.testing.assert_allclose(value, np.sum(x @ kernel + bias), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(grads[0], np.repeat(x.sum(0)[:, None], 2, 1), 1e-5)
    np.testing.assert_allclose(grads[1], [4.0, 4.0])
    np.testing.assert_allclose(grads[2], np.repeat(kernel.sum(1)[None], 4, 0), 1e-6)
    for old, new in zip(before, layer.get_weights(), strict=True):
        np.testing.assert_array_equal(old, new)


def test_unused_target_has_no_gradient():
    used = keras.Variable(np.ones(2, "float32"))
    unused = keras.Variable(np.ones(2, "float32"))
    _, (grad_used, grad_unused) = value_and_grad(
        lambda: keras.ops.sum(used * 3.0), [used, unused]
    )
    np.testing.assert_allclose(grad_used, [3.0, 3.0])
    if BACKEND == "jax":
        np.testing.assert_array_equal(grad_unused, [0.0, 0.0])
    else:
        assert grad_unused is None


def test_to_numpy_of_tensors_that_require_grad_and_of_variables():
    variable = keras.Variable(np.arange(3, dtype="float32"))
    result = to_numpy(variable * 2.0)  # on torch a tensor that requires grad
    assert isinstance(result, np.ndarray)
    np.testing.assert_array_equal(result, [0.0, 2.0, 4.0])
    np.testing.assert_array_equal(to_numpy(variable), [0.0, 1.0, 2.0])
    half = to_numpy(keras.ops.cast(variable, "bfloat16"))
    assert half.dtype.name == "bfloat16"
    np.testing.assert_array_equal(half.astype("float32"), [0.0, 1.0, 2.0])


@pytest.mark.parametrize("training", [False, True])
def test_compiled_layer_call_equals_eager(training):
    layer = keras.layers.Dense(3)
    x = np.random.default_rng(1).normal(size=(2, 5, 4)).astype("float32")
    eager = to_numpy(layer(x, training=training))
    run = compiled(lambda x: layer(x, training=training))
    np.testing.assert_allclose(to_numpy(run(x)), eager, rtol=1e-6)
    # Another shape through the same compiled function.
    y = x[:1, :2]
    np.testing.assert_allclose(to_numpy(run(y)), to_numpy(layer(y)), rtol=1e-6)


def test_compiled_drops_variable_updates_on_jax_only():
    counter = keras.Variable(0.0)

    def step(x):
        counter.assign_add(1.0)
        return x * 2.0

    np.testing.assert_allclose(to_numpy(compiled(step)(np.ones(2, "float32"))), 2.0)
    assert float(to_numpy(counter)) == (0.0 if BACKEND == "jax" else 1.0)
