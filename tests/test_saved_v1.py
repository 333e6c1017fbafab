"""A `.keras` file saved before the projections became Keras layers still loads.

tests/fixtures/self_attention_v1.keras was saved (JAX backend) by the layer of
commit e2f9e99, whose projections were the layer's own weights. It holds a
model with two SelfAttention layers: "options" (num_heads=2, key_dim=4,
num_key_value_heads=1, use_bias, use_gate, output_dim=5, rope_max_wavelength,
causal, dropout=0.1 with a seed) and "plain" (defaults).
self_attention_v1.npz holds the input `x`, the outputs that version computed
and each layer's `get_weights()` then.
"""

import pathlib

import keras
import numpy as np
import pytest

from keras_selfattn import SelfAttention
from tests import reference
from tests.backend import to_numpy

FIXTURES = pathlib.Path(__file__).parent / "fixtures"


@pytest.fixture(scope="module")
def saved():
    model = keras.models.load_model(FIXTURES / "self_attention_v1.keras")
    with np.load(FIXTURES / "self_attention_v1.npz") as arrays:
        return model, dict(arrays)


def test_old_file_computes_the_same_outputs(saved):
    model, arrays = saved
    outputs = model(arrays["x"])
    for name in ("options", "plain"):
        np.testing.assert_allclose(
            to_numpy(outputs[name]), arrays[name], rtol=1e-5, atol=1e-6
        )


@pytest.mark.parametrize("name, count", [("options", 10), ("plain", 3)])
def test_old_file_weights_keep_order_and_values(saved, name, count):
    model, arrays = saved
    layer = model.get_layer(name)
    assert isinstance(layer, SelfAttention)
    weights = layer.get_weights()
    assert len(weights) == count
    for i, value in enumerate(weights):
        np.testing.assert_array_equal(value, arrays[f"{name}_weight_{i}"])


# tests/fixtures/self_attention_dropout_v1.keras was saved (JAX backend) by the
# layer of commit 5977c29, which drew its dropout seeds from a
# `keras.layers.Dropout` sublayer, with this script:
#
#     keras.utils.set_random_seed(0)
#     layer = SelfAttention(
#         num_heads=2, key_dim=2, use_bias=True, causal=True, dropout=0.25,
#         seed=7, rope_max_wavelength=100.0, name="attention",
#     )
#     model = keras.Sequential([keras.Input((3, 4)), layer])
#     x = np.random.default_rng(0).normal(size=(1, 3, 4)).astype("float32")
#     model(x, training=True)
#     model.save("tests/fixtures/self_attention_dropout_v1.keras")


def test_file_with_dropout_sublayer_loads_and_computes_the_reference():
    model = keras.models.load_model(FIXTURES / "self_attention_dropout_v1.keras")
    layer = model.get_layer("attention")
    assert (layer.dropout, layer.seed) == (0.25, 7)
    x = np.random.default_rng(1).normal(size=(2, 3, 4)).astype("float32")
    expected, _ = reference.for_layer(layer, x)
    np.testing.assert_allclose(
        to_numpy(model(x, training=False)), expected, rtol=1e-5, atol=1e-6
    )
