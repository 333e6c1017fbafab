"""The decode check of a model whose layers round their inputs to integers
(Keras's int8 `Dense`): a rounding step that float noise tips between the
cached and the full pass is accepted, and a layer that mixes positions is
still refused."""

from __future__ import annotations

import keras
import numpy as np
import pytest
from keras import ops

import keras_selfattn
from keras_selfattn.generation import decode_check
from tests import decoder_zoo

pytestmark = pytest.mark.slow_on(
    "jax", "tensorflow", "the decode check's loops (5-15 s): PyTorch's suite checks it"
)

WIDTH, VOCABULARY = 4, 8
# What LengthNoise adds: float noise's size, not a change the float rule sees.
NOISE = 2e-5


class LengthNoise(keras.layers.Layer):
    """Adds NOISE to feature 1 in calls of one position: the kind of
    last-bits difference real kernels make between a one-position call and
    a longer one (sums in another order)."""

    def call(self, x):
        single = ops.cast(ops.equal(ops.shape(x)[1], 1), x.dtype)
        return x + single * NOISE * ops.one_hot(1, WIDTH, dtype=x.dtype)


def _on_a_rounding_boundary() -> np.ndarray:
    """Embedding rows whose feature 1 lies 6e-4 of a step under an int8
    rounding boundary of Keras's per-token quantizer (the row's largest,
    feature 0, is 1): NOISE takes it over, to the next integer."""
    scale = np.float32(127) / (np.float32(1) + np.float32(keras.config.epsilon()))
    rows = np.zeros((VOCABULARY, WIDTH), np.float32)
    rows[:, 0] = 1
    rows[:, 1] = np.float32(64.5 - 6e-4) / scale
    rows[:, 2] = np.linspace(-0.9, 0.9, VOCABULARY)
    rows[:, 3] = np.linspace(0.8, -0.8, VOCABULARY) ** 2
    return rows


def _model(quantized: bool) -> keras.Model:
    tokens = keras.Input((None,), dtype="int32")
    embedding = keras.layers.Embedding(VOCABULARY, WIDTH)
    x = embedding(tokens)
    attention = keras_selfattn.SelfAttention(key_dim=WIDTH, causal=True)
    x = LengthNoise()(ops.add(x, attention(x)))
    head = keras.layers.Dense(VOCABULARY)
    model = keras.Model(tokens, head(x))
    embedding.set_weights([_on_a_rounding_boundary()])
    # Zero projections: attention adds exactly 0 in both passes.
    attention.set_weights([np.zeros_like(w) for w in attention.get_weights()])
    kernel = np.random.default_rng(0).normal(size=(WIDTH, VOCABULARY))
    kernel[2] *= 6  # the tokens' logits far apart
    head.set_weights([kernel.astype("float32"), np.zeros(VOCABULARY, "float32")])
    if quantized:
        head.quantize("int8")
    return model


def _greedy(model: keras.Model, prompt: list[int], steps: int) -> list[int]:
    """Greedy tokens from the full forward pass over the whole sequence each
    step: no cache."""
    sequence = list(prompt)
    for _ in range(steps):
        logits = ops.convert_to_numpy(model(np.asarray([sequence], "int32")))
        sequence.append(int(np.argmax(logits[0, -1])))
    return sequence[len(prompt) :]


@pytest.mark.parametrize("quantized", [False, True], ids=["float", "int8"])
def test_float_noise_that_tips_an_int8_rounding_is_accepted(quantized):
    model = _model(quantized)
    token = np.asarray([[5]], "int32")
    alone = ops.convert_to_numpy(model(token))[0, 0]
    in_a_row = ops.convert_to_numpy(model(np.full((1, 3), 5, "int32")))[0, -1]
    difference = float(np.max(np.abs(alone - in_a_row)))
    rule = decode_check.RTOL * float(np.max(np.abs(in_a_row))) + decode_check.ATOL
    # The premise: one position and three differ by float noise in the float
    # model, and by a whole int8 step, past the float rule, once quantized.
    assert (difference > rule) == quantized, (difference, rule)

    prompt = [3, 7, 1]
    out = keras_selfattn.generate(model, np.asarray([prompt], "int32"), 4)
    assert np.asarray(out.tokens)[0].tolist() == _greedy(model, prompt, 4)


def test_an_int8_model_that_mixes_positions_is_still_refused():
    tokens = keras.Input((None,), dtype="int32")
    x = decoder_zoo.ArangePositions(
        decoder_zoo.MAX_POSITIONS, decoder_zoo.VOCABULARY, decoder_zoo.WIDTH
    )(tokens)
    x = keras_selfattn.SelfAttention(num_heads=2, causal=True)(x)
    model = keras.Model(tokens, keras.layers.Dense(decoder_zoo.VOCABULARY)(x))
    model.quantize("int8")
    # ArangePositions builds its embeddings float, so the check's copy of the
    # model (`clone_model`) cannot take the int8 weights: the culprit is not
    # named, the model is refused all the same.
    with pytest.raises(ValueError, match=r"forward pass by [\d.]+: .* mixes positions"):
        keras_selfattn.generate(model, [[3, 7, 1]], 2)
