"""The SelfAttention arguments of keras-hub's Bloom and Falcon attention
(ALiBi) and GPT-OSS attention (sinks, alternating sliding windows), and
Falcon's adapter: `hub_attention.CLASSES` holds their rows.

Bloom's `AlibiBias` adds `slope_h * (j - (keys - 1))` to the scaled scores
of key j: under the causal mask this is SelfAttention's `-slope_h * |i -
j|` plus a constant of each row i, which a softmax drops; its slopes are
SelfAttention's (`alibi_bias_max` read off the layer, any head count).
Falcon's decoder adds its ALiBi (the same slopes, times each real key's
position) before the `1 / sqrt(head_dim)` scale: SelfAttention's
`alibi_before_scale`. Its decoder passes the bias as the attention's
`alibi` argument, which `KerasHubFalconAttentionAdapter` drops (the
SelfAttention makes its own, in a decoding step too).

GPT-OSS's sinks are SelfAttention's (`use_sinks`); its sliding window lets
a query see `sliding_window` keys before itself (SelfAttention's
`sliding_window` counts the query too). Its rotary embedding is always
keras-hub's YaRN (`yarn`): its frequencies are `rope_frequency_scaling=
{"rope_type": "yarn", ...}` (positions not divided: `rope_scaling_factor`
1), and its temperature `t`, which multiplies the rotated queries and keys
(keras-hub's cosines and sines, not its sinks), is the scale `t ** 2 /
sqrt(head_dim)`.
"""

from __future__ import annotations

import math

import keras

from keras_selfattn._from_keras import refuse
from keras_selfattn._keras_private import hub_attribute
from keras_selfattn.attention import rope_frequencies
from keras_selfattn.migration.hub_adapter import KerasHubAttentionAdapter


def _no_output_dropout(layer, rate: float) -> None:
    if rate:
        refuse(
            layer,
            f"its dropout ({rate}) applies to the attention output, "
            "SelfAttention's to the attention weights",
        )


def bloom(layer, block) -> dict:
    """Bloom's: biases, ALiBi; dropout refused (it drops its output too)."""
    _no_output_dropout(layer, layer.dropout)
    alibi = hub_attribute(layer, "_alibi_layer")
    return {
        "use_bias": True,
        "position_bias": "alibi",
        "alibi_bias_max": float(alibi.alibi_bias_max),
    }


def falcon(layer, block) -> dict:
    """Falcon's: biases, ALiBi added before the scale, dropout on the
    attention weights (as SelfAttention's)."""
    return {
        "use_bias": True,
        "position_bias": "alibi",
        "alibi_before_scale": True,
        "dropout": float(layer.attention_dropout_rate),
    }


@keras.saving.register_keras_serializable(package="keras_selfattn")
class KerasHubFalconAttentionAdapter(KerasHubAttentionAdapter):
    """`KerasHubAttentionAdapter` called as Falcon's decoder calls its
    attention: `inputs=`, and its `alibi` bias, dropped (the SelfAttention
    adds the same bias itself).

    Args:
        attention: The SelfAttention that computes the attention (causal,
            `position_bias="alibi"`, `alibi_before_scale=True`).
        **kwargs: Base layer arguments (`name`, ...).

    Example:

    >>> import numpy as np, keras_selfattn
    >>> from keras_selfattn.migration.hub_alibi_sinks import (
    ...     KerasHubFalconAttentionAdapter)
    >>> sa = keras_selfattn.SelfAttention(num_heads=2, causal=True)
    >>> adapter = KerasHubFalconAttentionAdapter(sa)
    >>> tuple(adapter(inputs=np.ones((1, 3, 4), "float32"), alibi=None).shape)
    (1, 3, 4)
    """

    def __call__(self, inputs, alibi=None, attention_mask=None, **kwargs):
        return super().__call__(inputs, attention_mask=attention_mask, **kwargs)

    def compute_output_spec(self, inputs, **kwargs):
        return super().compute_output_spec(inputs)


def yarn(rope, head_dim: int) -> dict:
    """The SelfAttention arguments of a keras-hub `RotaryEmbedding` with
    `rope_type="yarn"` turning heads of `head_dim`: its frequencies and,
    as the scale, its temperature."""
    temperature = rope_frequencies.yarn_temperature(float(rope.scaling_factor))
    return {
        "rope_max_wavelength": float(rope.max_wavelength),
        "rope_frequency_scaling": {
            "rope_type": rope_frequencies.YARN,
            "factor": float(rope.scaling_factor),
            "beta_fast": float(rope.beta_fast),
            "beta_slow": float(rope.beta_slow),
            "original_max_position_embeddings": int(
                rope.original_max_position_embeddings
            ),
            "truncate": bool(rope.truncate),
        },
        "scale": temperature**2 / math.sqrt(head_dim),
    }


def gpt_oss(layer, block) -> dict:
    """GPT-OSS's: biases, sinks, its layer's sliding window (every other
    layer's); its YaRN rotary embedding is `yarn`'s."""
    _no_output_dropout(layer, layer.dropout)
    if hub_attribute(layer, "_head_dim") % 2:
        refuse(layer, "its rotary embedding leaves the last of its odd head_dim")
    window = layer.sliding_window
    return {
        "use_bias": True,
        "use_sinks": True,
        "sliding_window": window + 1 if window else None,
    }
