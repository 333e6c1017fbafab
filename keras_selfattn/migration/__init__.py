"""From Keras's attention layers to SelfAttention: one layer
(`SelfAttention.from_multi_head_attention`, in `layer`) or a whole model
(`convert`, in `model`)."""

from keras_selfattn.migration.model import ConversionReport, convert

__all__ = ["ConversionReport", "convert"]
