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
