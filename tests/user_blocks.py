"""Transformer blocks written the way keras.io writes them: a subclassed
layer holding Keras's `MultiHeadAttention` as an attribute, registered by its
user. The models `convert` brings across without editing this code."""

from __future__ import annotations

import keras
import numpy as np
from keras import layers

import keras_selfattn

D = 16
VOCABULARY = 40


@keras.saving.register_keras_serializable(package="user_blocks")
class TransformerBlock(layers.Layer):
    """keras.io's text-classification block (`self.att(inputs, inputs)`),
    with `use_causal_mask` for its language-model use."""

    def __init__(self, embed_dim, num_heads, ff_dim, causal=False, **kwargs):
        super().__init__(**kwargs)
        self.embed_dim, self.num_heads, self.ff_dim = embed_dim, num_heads, ff_dim
        self.causal = causal
        self.att = layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.ffn = keras.Sequential(
            [layers.Dense(ff_dim, activation="relu"), layers.Dense(embed_dim)]
        )
        self.layernorm1 = layers.LayerNormalization(epsilon=1e-6)
        self.layernorm2 = layers.LayerNormalization(epsilon=1e-6)

    def call(self, inputs):
        attention = self.att(inputs, inputs, use_causal_mask=self.causal)
        out1 = self.layernorm1(inputs + attention)
        return self.layernorm2(out1 + self.ffn(out1))

    def get_config(self):
        return {
            **super().get_config(),
            "embed_dim": self.embed_dim,
            "num_heads": self.num_heads,
            "ff_dim": self.ff_dim,
            "causal": self.causal,
        }


@keras.saving.register_keras_serializable(package="user_blocks")
class DecoderBlock(layers.Layer):
    """Self-attention then cross-attention on an encoder's output, keyword
    calls (`query=`, `value=`, `key=`) and a nested holder."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.inner = Residual()
        self.cross = layers.MultiHeadAttention(num_heads=2, key_dim=8)

    def call(self, inputs):
        x, memory = inputs
        x = self.inner(x)
        return x + self.cross(x, memory)


@keras.saving.register_keras_serializable(package="user_blocks")
class Residual(layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.attention = layers.GroupQueryAttention(
            head_dim=4, num_query_heads=4, num_key_value_heads=2
        )

    def call(self, x):
        return x + self.attention(query=x, value=x, key=x, use_causal_mask=True)


def randomized(model: keras.Model, seed: int = 0, scale: float = 0.3) -> keras.Model:
    """`model` with random weights: kernels and embeddings drawn anew, the
    vectors (biases, normalization scales) moved off their initial values
    (zero biases would hide their mapping; random scales flatten the
    logits, and with them the generated tokens)."""
    rng = np.random.default_rng(seed)
    model.set_weights(
        [
            (
                rng.normal(0, scale, w.shape)
                if w.ndim > 1
                else w + rng.normal(0, 0.1, w.shape)
            ).astype(w.dtype)
            for w in model.get_weights()
        ]
    )
    return model


def classifier() -> keras.Model:
    """keras.io's text classifier: one block, average pooling."""
    tokens = keras.Input((None,), dtype="int32")
    x = layers.Embedding(VOCABULARY, D)(tokens)
    x = TransformerBlock(D, 2, 32)(x)
    x = layers.GlobalAveragePooling1D()(x)
    return randomized(keras.Model(tokens, layers.Dense(2)(x)))


def tagger() -> keras.Model:
    """One label per token on padded ids (`mask_zero`): Keras hands the
    mask to the attention inside the block."""
    tokens = keras.Input((None,), dtype="int32")
    x = layers.Embedding(VOCABULARY, D, mask_zero=True)(tokens)
    x = TransformerBlock(D, 2, 32)(x)
    return randomized(keras.Model(tokens, layers.Dense(3)(x)))


def language_model() -> keras.Model:
    """Two causal blocks on learned absolute positions."""
    tokens = keras.Input((None,), dtype="int32")
    x = layers.Embedding(VOCABULARY, D)(tokens)
    x = keras_selfattn.PositionEmbedding(32)(x) + x
    x = TransformerBlock(D, 2, 32, causal=True)(x)
    x = TransformerBlock(D, 2, 32, causal=True)(x)
    return randomized(keras.Model(tokens, layers.Dense(VOCABULARY)(x)), scale=1.0)


def encoder_decoder() -> keras.Model:
    x = keras.Input((None, D))
    memory = keras.Input((None, 8))
    return randomized(keras.Model([x, memory], DecoderBlock()([x, memory])))
