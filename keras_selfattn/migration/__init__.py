"""From Keras's attention layers to SelfAttention: one layer
(`SelfAttention.from_multi_head_attention`, in `keras_selfattn._from_keras`),
a whole model (`convert`, in `model`), attention inside layers the package does not own
(`blocks`, behind `adapter.MultiHeadAttentionAdapter`, or for keras-hub's own
attention classes `hub_adapter.KerasHubAttentionAdapter` of
`hub_attention`'s mapping), keras-hub's causal
LMs as token models (`convert_causal_lm`, in `causal_lm`)."""

from keras_selfattn.migration.adapter import MultiHeadAttentionAdapter
from keras_selfattn.migration.causal_lm import convert_causal_lm
from keras_selfattn.migration.hub_adapter import KerasHubAttentionAdapter
from keras_selfattn.migration.model import ConversionReport, convert

__all__ = [
    "ConversionReport",
    "KerasHubAttentionAdapter",
    "MultiHeadAttentionAdapter",
    "convert",
    "convert_causal_lm",
]
