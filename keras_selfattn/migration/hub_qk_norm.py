"""The query and key RMS norms of keras-hub's Qwen 3, Qwen 3 MoE and Gemma 3
attention classes, as SelfAttention's `use_query_key_norm` (arguments and
weights for `hub_attention`'s rows).

Both normalize each head over its `head_dim` features in float32 before the
rotary embedding. Qwen 3's norms multiply by `scale`, Gemma 3's by `1 +
scale`: the weight SelfAttention gets is that factor, so the layer has one
formula.

keras-hub's Qwen 3 applies its `sliding_window_size` (every layer; 32768 by
default) on its unfused path only (TensorFlow's; JAX and PyTorch take the
fused one, without it): the SelfAttention applies it, which equals both
wherever the sequence fits in the window.
"""

from __future__ import annotations

import keras
import numpy as np

from keras_selfattn._from_keras import refuse
from keras_selfattn._keras_private import hub_attribute

# The class's query and key norm attributes, and whether its factor is
# `1 + scale` (Gemma's) rather than `scale`.
_NORMS = {
    "Qwen3Attention": (("_query_dense_layer_norm", "_key_dense_layer_norm"), False),
    "Qwen3MoeAttention": (
        ("_query_dense_layer_norm", "_key_dense_layer_norm"),
        False,
    ),
    "CachedGemma3Attention": (("query_norm", "key_norm"), True),
}


def _norm_layers(layer) -> list:
    attributes, _ = _NORMS[type(layer).__name__]
    return [hub_attribute(layer, attribute) for attribute in attributes]


def _arguments(layer) -> dict:
    """SelfAttention's norm arguments, from the layer's built norms."""
    epsilons = {float(norm.epsilon) for norm in _norm_layers(layer)}
    if len(epsilons) != 1:
        refuse(layer, f"its query and key norms' epsilons differ ({sorted(epsilons)})")
    return {"use_query_key_norm": True, "query_key_norm_epsilon": epsilons.pop()}


def qwen3(layer) -> dict:
    """Qwen 3's (and Qwen 3 MoE's) arguments beyond Llama's: the norms and
    the sliding window."""
    return {**_arguments(layer), "sliding_window": layer.sliding_window_size or None}


def gemma3(layer) -> dict:
    """Gemma 3's arguments beyond Gemma's: the norms where it has them."""
    if layer.use_bidirectional_attention:
        refuse(layer, "its attention is bidirectional (EmbeddingGemma), not causal")
    return _arguments(layer) if layer.use_query_key_norm else {}


def scales(layer) -> tuple[np.ndarray, np.ndarray] | None:
    """The query and key norms' factors (`query_norm_scale`,
    `key_norm_scale`), or None where the layer has no norms."""
    if not getattr(layer, "use_query_key_norm", True):
        return None
    _, one_plus = _NORMS[type(layer).__name__]
    factors = []
    for norm in _norm_layers(layer):
        scale = keras.ops.convert_to_numpy(norm.scale).astype("float32")
        factors.append(1 + scale if one_plus else scale)
    return tuple(factors)
