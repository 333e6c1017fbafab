"""`convert(model)` holds the weights of the layers it does not convert
once: the new model holds the original's own variables, attention layers
aside; `share_weights=False` copies them."""

from __future__ import annotations

import keras
import numpy as np
import pytest
from keras import layers

import keras_selfattn
from tests import user_blocks

pytestmark = pytest.mark.slow_on(
    "jax", "JAX compiles every eager op of a new model; the other suites check it"
)

TOKENS = np.array([[3, 4, 5, 6, 9, 2], [7, 8, 9, 1, 2, 3]], "int32")


def _model() -> keras.Model:
    """A top-level MultiHeadAttention, one inside a user's block, and
    layers without attention around them."""
    tokens = keras.Input((None,), dtype="int32")
    x = layers.Embedding(user_blocks.VOCABULARY, user_blocks.D)(tokens)
    x = layers.MultiHeadAttention(2, 8)(x, x, use_causal_mask=True)
    x = user_blocks.TransformerBlock(user_blocks.D, 2, 32, causal=True)(x)
    x = layers.Dense(user_blocks.VOCABULARY)(x)
    return user_blocks.randomized(keras.Model(tokens, x), scale=1.0)


def _attention_variables(model: keras.Model) -> set:
    """The ids of the variables of every Keras attention layer in `model`."""
    return {
        id(variable)
        for layer in model._flatten_layers()
        if isinstance(layer, layers.MultiHeadAttention)
        for variable in layer.weights
    }


def _ids(model: keras.Model) -> set:
    return {id(variable) for variable in model.weights}


def test_the_new_model_holds_the_original_s_variables_attention_aside():
    model = _model()
    attention = _attention_variables(model)
    others = _ids(model) - attention
    assert attention and len(others) >= 8  # embedding, block's FFN/norms, head
    new = keras_selfattn.convert(model)
    assert others <= _ids(new)
    assert not attention & _ids(new)
    # One copy: the new model's own variables are its SelfAttentions' alone.
    own = [v for v in new.weights if id(v) not in others]
    expected = sum(int(np.prod(v.shape)) for v in model.weights if id(v) in attention)
    assert sum(int(np.prod(v.shape)) for v in own) == expected
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(new(TOKENS)),
        keras.ops.convert_to_numpy(model(TOKENS)),
        atol=2e-5,
    )


def test_shared_weights_are_one_state_and_copies_are_not():
    model = _model()
    shared = keras_selfattn.convert(model)
    copied = keras_selfattn.convert(model, share_weights=False)
    assert not _ids(copied) & _ids(model)
    before = keras.ops.convert_to_numpy(copied(TOKENS))
    head = model.layers[-1]
    head.kernel.assign(np.zeros(head.kernel.shape, "float32"))
    head.bias.assign(np.ones(head.bias.shape, "float32"))
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(shared(TOKENS)), 1.0)
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(copied(TOKENS)), before)


def test_a_saved_model_with_shared_weights_loads_as_its_own(tmp_path):
    model = _model()
    new = keras_selfattn.convert(model)
    path = str(tmp_path / "converted.keras")
    new.save(path)
    loaded = keras.saving.load_model(path)
    assert not _ids(loaded) & _ids(model)
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(loaded(TOKENS)),
        keras.ops.convert_to_numpy(model(TOKENS)),
        atol=2e-5,
    )


@pytest.mark.parametrize("value", [1, "yes", None])
def test_share_weights_is_a_bool(value):
    with pytest.raises(ValueError, match=f"share_weights={value!r}") as error:
        keras_selfattn.convert(_model(), share_weights=value)
    assert "\n" not in str(error.value)


def test_a_keras_hub_causal_lm_s_weights_are_held_once():
    keras_hub = pytest.importorskip("keras_hub")
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=50,
        num_layers=2,
        num_query_heads=4,
        num_key_value_heads=2,
        hidden_dim=16,
        intermediate_dim=32,
    )
    lm = keras_hub.models.LlamaCausalLM(backbone, preprocessor=None)
    tokens_model = keras_selfattn.convert_causal_lm(lm)
    attention = {
        id(variable)
        for layer in lm._flatten_layers()
        if type(layer).__name__ == "LlamaAttention"
        for variable in layer.weights
    }
    assert attention
    assert _ids(lm) - attention <= _ids(tokens_model)
    original = sum(int(np.prod(v.shape)) for v in lm.weights)
    held = {id(v): int(np.prod(v.shape)) for m in (lm, tokens_model) for v in m.weights}
    # The two models hold the weights once, the attention's twice (its
    # SelfAttentions' are the new model's own).
    in_attention = sum(int(np.prod(v.shape)) for v in lm.weights if id(v) in attention)
    assert sum(held.values()) == original + in_attention
