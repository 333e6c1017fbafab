"""Masks: Keras padding masks, attention_mask, causal and sliding window."""

import keras
import numpy as np
import pytest

from keras_selfattn import SelfAttention
from tests.backend import to_numpy, value_and_grad
from tests.reference import layer_weights, self_attention

# The whole module runs once per attention path (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("every_path")

TOKENS = np.array([[5, 3, 8, 2, 0, 0], [7, 1, 0, 0, 0, 0], [4, 4, 4, 4, 4, 9]])


def _embedding_model(sequential: bool):
    keras.utils.set_random_seed(0)
    embedding = keras.layers.Embedding(12, 6, mask_zero=True, name="embed")
    attention = SelfAttention(num_heads=2, output_dim=4, use_bias=True, name="attn")
    if sequential:
        return keras.Sequential(
            [keras.Input((None,), dtype="int32", name="tokens"), embedding, attention]
        )
    tokens = keras.Input((None,), dtype="int32", name="tokens")
    return keras.Model(tokens, attention(embedding(tokens)))


@pytest.mark.parametrize("sequential", [True, False], ids=["sequential", "functional"])
def test_embedding_padding_mask_matches_reference(sequential):
    model = _embedding_model(sequential)
    attention = model.get_layer("attn")
    embedded = to_numpy(model.get_layer("embed")(TOKENS))
    padding = TOKENS != 0
    expected_out, expected_weights = self_attention(
        embedded,
        layer_weights(attention),
        num_heads=2,
        key_dim=3,
        value_dim=3,
        padding_mask=padding,
    )
    out = model.predict(TOKENS, verbose=0)
    np.testing.assert_allclose(out, expected_out, atol=1e-5)
    # Padded query positions are exactly zero, even with an output bias.
    assert np.all(out[~padding] == 0.0)

    _, weights = attention(embedded, mask=padding, return_attention_scores=True)
    weights = to_numpy(weights)
    np.testing.assert_allclose(weights, expected_weights, atol=1e-6)
    # Padded keys get exactly zero weight (no leak), padded queries too.
    assert np.all(weights.transpose(0, 3, 1, 2)[~padding] == 0.0)
    assert np.all(weights.transpose(0, 2, 1, 3)[~padding] == 0.0)


def test_padding_does_not_change_real_positions():
    """A sequence gives the same outputs with or without trailing padding."""
    model = _embedding_model(sequential=True)
    short = model.predict(np.array([[5, 3, 8]]), verbose=0)
    padded = model.predict(np.array([[5, 3, 8, 0, 0, 0, 0]]), verbose=0)
    np.testing.assert_allclose(padded[:, :3], short, atol=1e-6)
    assert np.all(padded[:, 3:] == 0.0)


def test_mask_is_passed_on_to_the_next_layer():
    model = keras.Sequential(
        [
            keras.Input((None,), dtype="int32", name="tokens"),
            keras.layers.Embedding(12, 6, mask_zero=True),
            SelfAttention(num_heads=2),
            keras.layers.GlobalAveragePooling1D(),
        ]
    )
    sub = keras.Model(model.inputs, model.layers[1].output)
    sequences = sub.predict(TOKENS, verbose=0)
    pooled = model.predict(TOKENS, verbose=0)
    valid = (TOKENS != 0)[..., None]
    # Masked mean: only real positions count, so the mask reached the pooling.
    expected = (sequences * valid).sum(axis=1) / valid.sum(axis=1)
    np.testing.assert_allclose(pooled, expected, atol=1e-5)
    layer = model.layers[1]
    mask = np.array([[True, False]])
    assert np.array_equal(to_numpy(layer.compute_mask(None, mask)), mask)


def test_masking_layer_on_float_inputs():
    x = np.random.default_rng(0).normal(size=(2, 5, 4)).astype("float32")
    x[0, 3:] = 0.0
    model = keras.Sequential(
        [keras.Input((None, 4), name="x"), keras.layers.Masking(0.0), SelfAttention()]
    )
    layer = model.layers[-1]
    expected, _ = self_attention(
        x, layer_weights(layer), 1, 4, 4, padding_mask=np.any(x != 0, axis=-1)
    )
    np.testing.assert_allclose(model.predict(x, verbose=0), expected, atol=1e-5)


def test_attention_mask_and_fully_masked_rows_give_zeros_not_nan():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(2, 5, 4)).astype("float32")
    attention_mask = rng.random((2, 5, 5)) > 0.4
    attention_mask[0, 2] = False  # query 2 of example 0 may attend nothing
    layer = SelfAttention(num_heads=2, use_bias=True)
    out, weights = layer(x, attention_mask=attention_mask, return_attention_scores=True)
    out, weights = to_numpy(out), to_numpy(weights)
    expected_out, expected_weights = self_attention(
        x, layer_weights(layer), 2, 2, 2, attention_mask=attention_mask
    )
    np.testing.assert_allclose(out, expected_out, atol=1e-5)
    np.testing.assert_allclose(weights, expected_weights, atol=1e-6)
    assert np.all(out[0, 2] == 0.0)
    assert np.all(weights[0, :, 2] == 0.0)

    # Gradients through a fully masked row stay finite.
    _, grads = value_and_grad(
        lambda x: keras.ops.sum(layer(x, attention_mask=attention_mask)),
        layer.trainable_variables,
        [x],
    )
    assert len(grads) == len(layer.trainable_variables) + 1
    assert all(g is not None and np.all(np.isfinite(g)) for g in grads)


def test_fully_padded_sequence_gives_zeros():
    layer = SelfAttention(num_heads=2, output_dim=3, use_bias=True)
    x = np.ones((2, 4, 4), "float32")
    mask = np.array([[False] * 4, [True, True, False, False]])
    out, weights = layer(x, mask=mask, return_attention_scores=True)
    out, weights = to_numpy(out), to_numpy(weights)
    assert np.all(out[0] == 0.0)
    assert np.all(weights[0] == 0.0)
    assert np.all(np.isfinite(out)) and np.all(np.isfinite(weights))


@pytest.mark.parametrize("window", [None, 1, 2, 4])
@pytest.mark.parametrize("causal", [False, True])
def test_causal_and_sliding_window(causal, window):
    x = np.random.default_rng(2).normal(size=(2, 7, 6)).astype("float32")
    layer = SelfAttention(num_heads=3, causal=causal, sliding_window=window)
    out, weights = layer(x, return_attention_scores=True)
    out, weights = to_numpy(out), to_numpy(weights)
    expected_out, expected_weights = self_attention(
        x, layer_weights(layer), 3, 2, 2, causal=causal, sliding_window=window
    )
    np.testing.assert_allclose(out, expected_out, atol=1e-5)
    np.testing.assert_allclose(weights, expected_weights, atol=1e-6)
    i, j = np.indices((7, 7))
    if causal:
        assert np.all(weights[..., j > i] == 0.0)
    if window is not None:
        assert np.all(weights[..., np.abs(i - j) >= window] == 0.0)


def test_causal_outputs_ignore_the_future():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(1, 6, 4)).astype("float32")
    changed = x.copy()
    changed[:, 4:] = rng.normal(size=(1, 2, 4))
    layer = SelfAttention(num_heads=2, causal=True)
    out, out_changed = to_numpy(layer(x)), to_numpy(layer(changed))
    np.testing.assert_allclose(out[:, :4], out_changed[:, :4], atol=1e-6)
    assert not np.allclose(out[:, 4:], out_changed[:, 4:])


@pytest.mark.parametrize(
    "name, kwargs",
    [
        ("mask", {"mask": np.ones((2, 4), bool)}),
        ("mask", {"mask": np.ones((2, 5, 5), bool)}),
        ("attention_mask", {"attention_mask": np.ones((2, 5), bool)}),
        ("attention_mask", {"attention_mask": np.ones((2, 5, 4), bool)}),
    ],
)
def test_wrong_mask_shapes_are_rejected(name, kwargs):
    layer = SelfAttention()
    x = np.ones((2, 5, 4), "float32")
    with pytest.raises(ValueError, match=rf"`{name}`.*Received: {name}.shape="):
        layer(x, **kwargs)
