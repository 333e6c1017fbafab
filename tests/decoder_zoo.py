"""Decoder models as users write them (issue 44): keras.io's subclassed
transformer block holding SelfAttention, learned absolute positions
(keras-hub's and keras_selfattn's), nested Sequential blocks and a
subclassed `keras.Model`. Small random weights, logits spread wide enough
that greedy tokens vary.

The classes are registered, so the models save as .keras and load in the
TensorFlow process that writes generators off TensorFlow.
"""

from __future__ import annotations

import keras
import keras_hub
from keras import ops

import keras_selfattn
from keras_selfattn import SelfAttention

VOCABULARY = 29
WIDTH = 16
MAX_POSITIONS = 32
KINDS = (
    "hub_positions",  # (a) keras-hub TokenAndPositionEmbedding + 2 top-level layers
    "blocks",  # (b) two subclassed blocks, no positions
    "blocks_rope",  # (b) the same with rotary embeddings
    "hub_blocks",  # (c) keras-hub positions + subclassed blocks
    "sequential_blocks",  # (d) blocks in a nested Sequential
    "subclassed",  # (e) a subclassed keras.Model holding blocks
)


@keras.saving.register_keras_serializable(package="decoder_zoo")
class TransformerBlock(keras.layers.Layer):
    """keras.io's block, SelfAttention in place of MultiHeadAttention."""

    def __init__(self, embed_dim, num_heads, ff_dim, rope=None, **kwargs):
        super().__init__(**kwargs)
        self.embed_dim, self.num_heads, self.ff_dim, self.rope = (
            embed_dim,
            num_heads,
            ff_dim,
            rope,
        )
        self.att = SelfAttention(
            num_heads=num_heads, causal=True, rope_max_wavelength=rope
        )
        self.ffn = keras.Sequential(
            [
                keras.layers.Dense(ff_dim, activation="relu"),
                keras.layers.Dense(embed_dim),
            ]
        )
        self.layernorm1 = keras.layers.LayerNormalization(epsilon=1e-6)
        self.layernorm2 = keras.layers.LayerNormalization(epsilon=1e-6)

    def call(self, inputs):
        out1 = self.layernorm1(inputs + self.att(inputs))
        return self.layernorm2(out1 + self.ffn(out1))

    def get_config(self):
        return {
            **super().get_config(),
            "embed_dim": self.embed_dim,
            "num_heads": self.num_heads,
            "ff_dim": self.ff_dim,
            "rope": self.rope,
        }


@keras.saving.register_keras_serializable(package="decoder_zoo")
class ArangePositions(keras.layers.Layer):
    """keras.io's miniature-GPT embedding: positions from `ops.arange`,
    which cannot decode (the replacement is keras_selfattn's)."""

    def __init__(self, maxlen, vocab_size, embed_dim, **kwargs):
        super().__init__(**kwargs)
        self.maxlen, self.vocab_size, self.embed_dim = maxlen, vocab_size, embed_dim
        self.token_emb = keras.layers.Embedding(vocab_size, embed_dim)
        self.pos_emb = keras.layers.Embedding(maxlen, embed_dim)

    def call(self, x):
        positions = ops.arange(0, ops.shape(x)[-1], 1)
        return self.token_emb(x) + self.pos_emb(positions)

    def get_config(self):
        return {
            **super().get_config(),
            "maxlen": self.maxlen,
            "vocab_size": self.vocab_size,
            "embed_dim": self.embed_dim,
        }


@keras.saving.register_keras_serializable(package="decoder_zoo")
class MiniGPT(keras.Model):
    """A subclassed model: positions, blocks and a head as attributes."""

    def __init__(self, vocabulary, width, blocks, **kwargs):
        super().__init__(**kwargs)
        self.vocabulary, self.width, self.num_blocks = vocabulary, width, blocks
        self.embedding = keras_selfattn.TokenAndPositionEmbedding(
            vocabulary, MAX_POSITIONS, width, embeddings_initializer=_wide()
        )
        self.blocks = [TransformerBlock(width, 2, 2 * width) for _ in range(blocks)]
        self.head = keras.layers.Dense(vocabulary, kernel_initializer=_wide())

    def call(self, tokens):
        h = self.embedding(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(h)

    def get_config(self):
        return {
            **super().get_config(),
            "vocabulary": self.vocabulary,
            "width": self.width,
            "blocks": self.num_blocks,
        }


def _wide():
    return keras.initializers.RandomNormal(stddev=1.0)


def _embedding(kind: str, tokens):
    if kind.startswith("hub"):
        return keras_hub.layers.TokenAndPositionEmbedding(
            VOCABULARY, MAX_POSITIONS, WIDTH, embeddings_initializer=_wide()
        )(tokens)
    if kind == "arange":
        return ArangePositions(MAX_POSITIONS, VOCABULARY, WIDTH)(tokens)
    return keras.layers.Embedding(VOCABULARY, WIDTH, embeddings_initializer=_wide())(
        tokens
    )


def decoder(kind: str, seed: int = 0) -> keras.Model:
    """The model of `kind` (KINDS, or "arange": keras.io's position layer)."""
    keras.utils.set_random_seed(seed)
    if kind == "subclassed":
        model = MiniGPT(VOCABULARY, WIDTH, 2, name="mini_gpt")
        model(ops.zeros((1, 2), "int32"))
        return model
    tokens = keras.Input((None,), dtype="int32", name="tokens")
    h = _embedding(kind, tokens)
    if kind == "hub_positions":
        for _ in range(2):
            h = h + SelfAttention(num_heads=2, causal=True)(h)
    elif kind == "sequential_blocks":
        h = keras.Sequential(
            [
                keras.Input((None, WIDTH)),
                *(TransformerBlock(WIDTH, 2, 32) for _ in "ab"),
            ]
        )(h)
    else:
        rope = 100 if kind == "blocks_rope" else None
        for _ in range(2):
            h = TransformerBlock(WIDTH, 2, 32, rope=rope)(h)
    logits = keras.layers.Dense(VOCABULARY, kernel_initializer=_wide(), name="logits")
    return keras.Model(tokens, logits(h), name=kind)
