"""Learned absolute positions that decode: `PositionEmbedding` and
`TokenAndPositionEmbedding`.

GPT-2 and Keras's tutorials add a learned embedding of each position to the
tokens' embeddings. A position layer that computes its positions from the
input's length (keras.io's `ops.arange(0, maxlen)`) gives every decoded
token position 0, so its model cannot decode step by step. These layers
compute the same as keras-hub's layers of the same names, and inside a
decoding run (`keras_selfattn.decoding`) they take each new position's
index in its own row from the run, so `generate`, the exported decoding
steps and generators see the positions the full forward pass sees.
"""

from __future__ import annotations

import keras
from keras import ops

from keras_selfattn import _checks, decoding
from keras_selfattn.attention import masks

__all__ = ["PositionEmbedding", "TokenAndPositionEmbedding"]


@keras.saving.register_keras_serializable(package="keras_selfattn")
class PositionEmbedding(keras.layers.Layer):
    """A learned embedding of each position, that decodes.

    Returns the embeddings of the positions `start_index .. start_index +
    time - 1` (or of `positions`) broadcast to the input's shape, as
    keras-hub's `PositionEmbedding` does; add it to the input. Inside a
    decoding run it returns the embeddings of the positions being decoded.

    Args:
        sequence_length: The most positions: the embedding table's rows.
        initializer: The table's initializer. Defaults to "glorot_uniform".
        **kwargs: Base layer arguments (`name`, `dtype`, ...).

    Call arguments:
        inputs: Tensor `(batch, time, features)`: only its shape is read.
        start_index: The first position. Defaults to 0.
        positions: Optional int `(time,)` or `(batch, time)`: each
            position's index, in place of `start_index`.

    Example:

    >>> import numpy as np
    >>> from keras_selfattn import PositionEmbedding
    >>> x = np.zeros((2, 5, 8), "float32")
    >>> PositionEmbedding(sequence_length=16)(x).shape
    TensorShape([2, 5, 8])
    """

    def __init__(
        self, sequence_length: int, initializer="glorot_uniform", **kwargs
    ) -> None:
        super().__init__(**kwargs)
        self.sequence_length = _checks.positive_int("sequence_length", sequence_length)
        self.initializer = keras.initializers.get(initializer)

    def build(self, input_shape) -> None:
        self.position_embeddings = self.add_weight(
            name="embeddings",
            shape=(self.sequence_length, input_shape[-1]),
            initializer=self.initializer,
        )

    def call(self, inputs, start_index=0, positions=None):
        scope = decoding.active()
        if positions is None and scope is not None:
            positions = scope.positions
        if positions is None:
            time = ops.shape(inputs)[-2]
            positions = ops.add(masks.positions(time), start_index)
        table = ops.take(self.position_embeddings, ops.cast(positions, "int32"), 0)
        return ops.broadcast_to(ops.cast(table, inputs.dtype), ops.shape(inputs))

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self) -> dict:
        return {
            **super().get_config(),
            "sequence_length": self.sequence_length,
            "initializer": keras.initializers.serialize(self.initializer),
        }


@keras.saving.register_keras_serializable(package="keras_selfattn")
class TokenAndPositionEmbedding(keras.layers.Layer):
    """Token embeddings plus learned position embeddings, that decode.

    The layer of keras.io's miniature GPT and keras-hub's
    `TokenAndPositionEmbedding`: `Embedding(tokens) + PositionEmbedding`.
    Use it in place of a position layer that computes its positions with
    `ops.arange`, which cannot decode (`keras_selfattn.generate` refuses it
    naming the layer).

    Args:
        vocabulary_size: The token ids' range.
        sequence_length: The most positions.
        embedding_dim: The embeddings' width.
        mask_zero: Whether id 0 is padding (a Keras mask follows the output).
        embeddings_initializer: Initializer of both tables. Defaults to
            "uniform", as `keras.layers.Embedding`.
        **kwargs: Base layer arguments (`name`, `dtype`, ...).

    Call arguments:
        inputs: int `(batch, time)` token ids.
        start_index: The first position. Defaults to 0.
        positions: Optional int `(time,)` or `(batch, time)` positions.

    Example:

    >>> import numpy as np
    >>> from keras_selfattn import TokenAndPositionEmbedding
    >>> layer = TokenAndPositionEmbedding(100, 16, 8)
    >>> layer(np.array([[5, 8, 2]])).shape
    TensorShape([1, 3, 8])
    """

    def __init__(
        self,
        vocabulary_size: int,
        sequence_length: int,
        embedding_dim: int,
        mask_zero: bool = False,
        embeddings_initializer="uniform",
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        self.vocabulary_size = _checks.positive_int("vocabulary_size", vocabulary_size)
        self.sequence_length = _checks.positive_int("sequence_length", sequence_length)
        self.embedding_dim = _checks.positive_int("embedding_dim", embedding_dim)
        self.mask_zero = _checks.boolean("mask_zero", mask_zero)
        self.embeddings_initializer = keras.initializers.get(embeddings_initializer)
        self.token_embedding = keras.layers.Embedding(
            self.vocabulary_size,
            self.embedding_dim,
            embeddings_initializer=self.embeddings_initializer,
            mask_zero=self.mask_zero,
            dtype=self.dtype_policy,
            name="token_embedding",
        )
        self.position_embedding = PositionEmbedding(
            self.sequence_length,
            initializer=self.embeddings_initializer,
            dtype=self.dtype_policy,
            name="position_embedding",
        )
        self.supports_masking = self.mask_zero

    def build(self, input_shape) -> None:
        self.token_embedding.build(input_shape)
        self.position_embedding.build((*input_shape, self.embedding_dim))

    def call(self, inputs, start_index=0, positions=None):
        tokens = self.token_embedding(inputs)
        return ops.add(
            tokens,
            self.position_embedding(
                tokens, start_index=start_index, positions=positions
            ),
        )

    def compute_mask(self, inputs, mask=None):
        return self.token_embedding.compute_mask(inputs, mask)

    def compute_output_shape(self, input_shape):
        return (*input_shape, self.embedding_dim)

    def get_config(self) -> dict:
        return {
            **super().get_config(),
            "vocabulary_size": self.vocabulary_size,
            "sequence_length": self.sequence_length,
            "embedding_dim": self.embedding_dim,
            "mask_zero": self.mask_zero,
            "embeddings_initializer": keras.initializers.serialize(
                self.embeddings_initializer
            ),
        }
