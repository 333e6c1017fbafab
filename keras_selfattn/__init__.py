"""keras_selfattn: a serializable Keras 3 self-attention layer.

Importing the package registers `keras_selfattn>SelfAttention` with Keras, so
`keras.models.load_model` finds it without `custom_objects`.
"""

from keras_selfattn.generation import Generated, generate
from keras_selfattn.migration import ConversionReport, convert, convert_causal_lm
from keras_selfattn.position_embedding import (
    PositionEmbedding,
    TokenAndPositionEmbedding,
)
from keras_selfattn.self_attention import SelfAttention

__all__ = [
    "ConversionReport",
    "Generated",
    "PositionEmbedding",
    "SelfAttention",
    "TokenAndPositionEmbedding",
    "convert",
    "convert_causal_lm",
    "generate",
]
__version__ = "0.2.0"
