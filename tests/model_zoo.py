"""Small models containing `SelfAttention`, shared by the export tests.

Every model has named inputs and deterministic weights drawn from `seed`, so
two builds with the same seed compute the same function and builds with
different seeds compute different ones. The builder names are a stable
interface: examples, reliability and fused-ONNX tests import them.
"""

from __future__ import annotations

import keras
import numpy as np

from keras_selfattn import SelfAttention

FEATURES = 8
VOCAB = 50


def _seed_weights(model: keras.Model, seed: int) -> keras.Model:
    """Overwrites every weight with seeded normal values of scale 0.3."""
    rng = np.random.default_rng(seed)
    for weight in model.weights:
        shape = tuple(weight.shape)
        name = weight.path.rsplit("/", 1)[-1]
        if name == "gamma":  # LayerNormalization scale stays near 1
            value = 1.0 + 0.1 * rng.standard_normal(shape)
        else:
            value = 0.3 * rng.standard_normal(shape)
        weight.assign(value.astype(weight.dtype))
    return model


def attention_only(seed: int = 0) -> keras.Model:
    """SelfAttention alone on a float input named "features"."""
    inputs = keras.Input((None, FEATURES), name="features")
    outputs = SelfAttention(name="attention")(inputs)
    return _seed_weights(keras.Model(inputs, outputs, name="attention_only"), seed)


def masked_classifier(seed: int = 0) -> keras.Model:
    """Embedding(mask_zero) -> SelfAttention -> masked mean -> Dense.

    Integer token input "tokens" of shape (batch, time); id 0 is padding.
    Output "probabilities" (batch, 3).
    """
    tokens = keras.Input((None,), dtype="int32", name="tokens")
    x = keras.layers.Embedding(VOCAB, FEATURES, mask_zero=True, name="embed")(tokens)
    x = SelfAttention(num_heads=2, name="attention")(x)
    x = keras.layers.GlobalAveragePooling1D(name="pool")(x)
    outputs = keras.layers.Dense(3, activation="softmax", name="probabilities")(x)
    return _seed_weights(keras.Model(tokens, outputs, name="masked_classifier"), seed)


def causal_multihead(seed: int = 0) -> keras.Model:
    """Causal 4-head SelfAttention with biases and output_dim=6."""
    inputs = keras.Input((None, FEATURES), name="sequence")
    outputs = SelfAttention(
        num_heads=4,
        key_dim=3,
        value_dim=5,
        output_dim=6,
        use_bias=True,
        causal=True,
        name="causal_attention",
    )(inputs)
    return _seed_weights(keras.Model(inputs, outputs, name="causal_multihead"), seed)


def transformer_encoder(seed: int = 0) -> keras.Model:
    """Two SelfAttention blocks with residuals, LayerNorm and a feed-forward."""
    inputs = keras.Input((None, FEATURES), name="embeddings")
    x = inputs
    for i in range(2):
        attended = SelfAttention(
            num_heads=2, output_dim=FEATURES, use_bias=True, name=f"attention_{i}"
        )(x)
        x = keras.layers.LayerNormalization(name=f"norm_{i}a")(
            keras.layers.Add(name=f"residual_{i}a")([x, attended])
        )
        hidden = keras.layers.Dense(16, activation="relu", name=f"ffn_{i}_in")(x)
        hidden = keras.layers.Dense(FEATURES, name=f"ffn_{i}_out")(hidden)
        x = keras.layers.LayerNormalization(name=f"norm_{i}b")(
            keras.layers.Add(name=f"residual_{i}b")([x, hidden])
        )
    return _seed_weights(keras.Model(inputs, x, name="transformer_encoder"), seed)


def attention_with_mask_input(seed: int = 0) -> keras.Model:
    """SelfAttention fed an explicit boolean mask input.

    Inputs "features" (float, (batch, time, 8)) and "mask" (bool,
    (batch, time), True for real steps); output "attention" (batch, time, 8).
    """
    features = keras.Input((None, FEATURES), name="features")
    mask = keras.Input((None,), dtype="bool", name="mask")
    outputs = SelfAttention(num_heads=2, use_bias=True, name="attention")(
        features, mask=mask
    )
    return _seed_weights(
        keras.Model([features, mask], outputs, name="attention_with_mask_input"), seed
    )


def decoder_language_model(vocab: int = VOCAB, normalized: bool = True) -> keras.Model:
    """Two causal SelfAttention layers a decoding step can cache: rotary
    positions and grouped key/value heads, then a gated layer; residual Adds
    and (`normalized`) a LayerNormalization between them (Keras's
    LayerNormalization does not convert to ONNX on torch).

    Input "tokens" (int32, (batch, time)); output "logits" (batch, time,
    vocab).
    """
    keras.utils.set_random_seed(3)
    tokens = keras.Input((None,), dtype="int32", name="tokens")
    x = keras.layers.Embedding(vocab, 16)(tokens)
    h = SelfAttention(
        num_heads=4,
        key_dim=4,
        num_key_value_heads=2,
        causal=True,
        rope_max_wavelength=100.0,
        name="attn1",
    )(x)
    x = keras.layers.Add()([x, h])
    if normalized:
        x = keras.layers.LayerNormalization()(x)
    h = SelfAttention(
        num_heads=2, key_dim=8, causal=True, output_dim=16, use_gate=True, name="attn2"
    )(x)
    x = keras.layers.Add()([x, h])
    logits = keras.layers.Dense(vocab, name="logits")(x)
    return keras.Model(tokens, logits)


ALL = {
    "attention_only": attention_only,
    "masked_classifier": masked_classifier,
    "causal_multihead": causal_multihead,
    "transformer_encoder": transformer_encoder,
}


def sample_inputs(
    model: keras.Model, batch: int, time: int, seed: int = 0
) -> dict[str, np.ndarray]:
    """Random inputs for `model`, keyed by input name.

    Float inputs get standard normal data. Integer token inputs get ids in
    [1, VOCAB) and boolean inputs True, both followed by padding (0 / False):
    row 0 is full length, the other rows have random lengths in [1, time].
    """
    rng = np.random.default_rng(seed)
    lengths = np.concatenate([[time], rng.integers(1, time + 1, batch - 1)])
    padding = np.arange(time)[None, :] >= lengths[:, None]
    result = {}
    for tensor in model.inputs:
        shape = (batch, time) + tuple(tensor.shape[2:])
        if tensor.dtype == "bool":
            values = ~padding
        elif "int" in str(tensor.dtype):
            values = np.where(padding, 0, rng.integers(1, VOCAB, size=shape))
        else:
            values = rng.standard_normal(shape)
        result[tensor.name] = values.astype(tensor.dtype)
    return result
