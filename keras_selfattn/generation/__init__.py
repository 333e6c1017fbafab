"""Generation from a model's key/value caches (`generate`)."""

from keras_selfattn.generation.generate import Generated, generate

__all__ = ["Generated", "generate"]
