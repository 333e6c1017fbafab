"""`SelfAttention.enable_lora(rank)`: LoRA on the query and value projections.

After it only the LoRA weights train, `fit` lowers the loss and every other
weight keeps its value; saving writes the merged kernels; keras-hub's
`backbone.enable_lora` finds the projections by name.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

from keras_selfattn import SelfAttention
from tests.backend import to_numpy

FEATURES, TIME = 8, 5
RNG = np.random.default_rng(3)
X = RNG.normal(size=(16, TIME, FEATURES)).astype("float32")
Y = RNG.normal(size=(16, TIME, 4)).astype("float32")


def _model(**kwargs) -> keras.Model:
    keras.utils.set_random_seed(0)
    inputs = keras.Input((TIME, FEATURES))
    attention = SelfAttention(
        num_heads=2, output_dim=4, use_bias=True, name="attention", **kwargs
    )
    return keras.Model(inputs, attention(inputs))


@pytest.fixture(scope="module")
def trained():
    model = _model(use_gate=True)
    before = {w.path: to_numpy(w) for w in model.weights}
    model.get_layer("attention").enable_lora(2)
    model.compile(keras.optimizers.Adam(0.05), "mse")
    loss = model.fit(X, Y, epochs=15, batch_size=16, verbose=0).history["loss"]
    return model, before, loss


def test_only_lora_weights_train(trained):
    model, _, _ = trained
    paths = sorted(w.path for w in model.trainable_weights)
    assert paths == sorted(
        f"attention/{name}_dense/lora_kernel_{part}"
        for name in ("query", "value")
        for part in "ab"
    )


def test_fit_lowers_the_loss_and_keeps_the_base_weights(trained):
    model, before, loss = trained
    assert loss[-1] < 0.9 * loss[0], loss
    for weight in model.weights:
        if "lora" not in weight.path:
            np.testing.assert_array_equal(to_numpy(weight), before[weight.path])


@pytest.mark.filterwarnings("ignore:Skipping variable loading for optimizer")
def test_saving_merges_lora_into_the_kernels(trained, tmp_path):
    model, before, _ = trained
    expected = to_numpy(model(X))
    model.save(tmp_path / "lora.keras")
    loaded = keras.models.load_model(tmp_path / "lora.keras")
    assert not any("lora" in w.path for w in loaded.weights)
    query = loaded.get_layer("attention").query_kernel
    assert not np.array_equal(to_numpy(query), before["attention/query_dense/kernel"])
    np.testing.assert_allclose(to_numpy(loaded(X)), expected, rtol=1e-5, atol=1e-6)


def test_keras_hub_style_lookup_finds_query_and_value():
    """keras-hub's `Backbone.enable_lora` enables LoRA on the layers named
    "query_dense", "value_dense", "query" or "value" that have weights."""
    model = _model()
    found = [
        layer.name
        for layer in model._flatten_layers(include_self=False)
        if layer.weights
        and layer.name in ("query_dense", "value_dense", "query", "value")
        and hasattr(layer, "enable_lora")
    ]
    assert sorted(found) == ["query_dense", "value_dense"]


def test_other_projections_and_errors():
    model = _model()
    layer = model.get_layer("attention")
    layer.enable_lora(3, projections=("key", "output"))
    assert {w.path.split("/")[1] for w in layer.trainable_weights} == {
        "key_dense",
        "output_dense",
    }
    for bad in ("query", ("gate",), ()):
        with pytest.raises(ValueError, match="projections="):
            _model().get_layer("attention").enable_lora(2, projections=bad)
    with pytest.raises(ValueError, match="rank"):
        _model().get_layer("attention").enable_lora(0)
    with pytest.raises(ValueError, match="not built"):
        SelfAttention().enable_lora(2)


@pytest.mark.tensorflow_only("SavedModel export")
@pytest.mark.slow  # four checked exports: 9 s
def test_lora_model_exports_and_verifies(trained, tmp_path):
    from keras_selfattn.export import export_saved_model

    model, _, _ = trained
    inputs = keras.Input((None, FEATURES), name="x")
    named = keras.Model(inputs, model.get_layer("attention")(inputs))
    # export_saved_model verifies the SavedModel against Keras by default.
    export_saved_model(named, tmp_path, "lora")
