"""`generate(jit_compile=...)`: XLA by default on TensorFlow and JAX,
recorded steps on PyTorch (tests/test_generate_torch_steps.py), a plain
loop when asked, a clear error where XLA cannot."""

from __future__ import annotations

import keras
import numpy as np
import pytest

from keras_selfattn import SelfAttention, generate
from tests import generation_reference as reference
from tests.test_generation import PROMPTS, STEPS, token_model


@pytest.fixture(scope="module")
def model():
    return token_model(seed=3)


@pytest.mark.parametrize("value", ["xla", 1, None])
def test_jit_compile_other_than_auto_or_a_boolean_is_named(model, value):
    with pytest.raises(ValueError, match=r"`jit_compile`.*Received: jit_compile="):
        generate(model, PROMPTS, 2, jit_compile=value)


@pytest.mark.slow_on(
    "tensorflow", "jax", "generate compiled twice, with XLA and without: PyTorch checks"
)
def test_with_and_without_xla_equal_the_uncached_forward(model):
    tokens, lengths = reference.uncached(model, PROMPTS, STEPS)
    for jit_compile in ("auto", True, False):
        result = generate(model, PROMPTS, STEPS, jit_compile=jit_compile)
        np.testing.assert_array_equal(result.tokens, tokens, err_msg=jit_compile)
        np.testing.assert_array_equal(result.lengths, lengths, err_msg=jit_compile)
    assert len({tuple(row) for row in tokens}) > 1  # rows differ: a real check


@pytest.mark.tensorflow_only("a layer calling tf.numpy_function, which XLA refuses")
def test_a_model_xla_cannot_compile_is_refused_naming_the_way_out():
    import tensorflow as tf

    class NumpyIdentity(keras.layers.Layer):
        def call(self, x):
            same = tf.numpy_function(lambda a: a, [x], x.dtype)
            return tf.ensure_shape(same, x.shape)

    keras.utils.set_random_seed(0)
    tokens = keras.Input((None,), dtype="int32")
    h = keras.layers.Embedding(11, 8)(tokens)
    h = NumpyIdentity()(SelfAttention(num_heads=2, causal=True)(h))
    model = keras.Model(tokens, keras.layers.Dense(11)(h))
    prompts = [[1, 2, 3], [4]]
    refused = r"XLA cannot compile.*PyFunc.*jit_compile=False"
    with pytest.raises(ValueError, match=refused):
        generate(model, prompts, 3)
    tokens, lengths = reference.uncached(model, prompts, 3)
    result = generate(model, prompts, 3, jit_compile=False)
    np.testing.assert_array_equal(result.tokens, tokens)
    np.testing.assert_array_equal(result.lengths, lengths)
