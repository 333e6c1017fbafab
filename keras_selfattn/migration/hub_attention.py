"""keras-hub's own attention classes (Llama's, Mistral's, Mixtral's,
Gemma's, Qwen 2's, Qwen MoE's, Phi-3's and SmolLM3's) as a SelfAttention
with the same configuration and weights (Qwen's query, key and value biases
included; Qwen 3's, Qwen 3 MoE's and Gemma 3's query and key norms from
`hub_qk_norm`).

Each class is a row of `CLASSES`: where its settings are (heads, rotary
embedding, scale, soft-cap, sliding window) and where its `EinsumDense`
kernels are. keras-hub's decoder blocks give these layers the causal mask
(with the keys' padding, and Mistral's band) as an `attention_mask`, which
the adapter passes on; the SelfAttention is causal with the same band, so a
decoding step, which drops that mask, computes the same.

Gemma's rotary embedding interleaves the two halves it rotates, in the
queries and the keys alike: a permutation of both that leaves every score
`q . k` as the halves' rotation (SelfAttention's) gives it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import keras
import numpy as np

from keras_selfattn._from_keras import refuse
from keras_selfattn._keras_private import hub_attribute
from keras_selfattn.attention import rope_frequencies
from keras_selfattn.migration import hub_alibi_sinks, hub_neox, hub_qk_norm


@dataclasses.dataclass(frozen=True)
class HubAttention:
    """One keras-hub attention class.

    Attributes:
        projections: SelfAttention's projection -> the keras-hub layer's
            `EinsumDense` attribute.
        heads_first: Whether the query, key and value kernels are
            `(heads, features, head_dim)` (Gemma's) rather than `(features,
            heads, head_dim)`.
        rotary: The attribute of its keras-hub `RotaryEmbedding`; None where
            `arguments` gives the rotary settings (SmolLM3's own embedding).
        arguments: `(layer, block) -> dict` of SelfAttention's arguments
            other than the sizes, read off the layer and the block holding
            it (Mistral's block holds its sliding window).
        band_in_mask: Whether the block puts the sliding window in the
            `attention_mask` it passes (Mistral's) rather than the layer
            applying it (Gemma's).
        convert: `(cls, layer, block) -> SelfAttention` where the class's
            own module maps it (GPT-NeoX's fused projection), else None.
        adapter: The adapter class its block calls, where not
            `KerasHubAttentionAdapter`.
    """

    projections: dict
    heads_first: bool
    rotary: str | None
    arguments: Callable | None
    band_in_mask: bool = False
    convert: Callable | None = None
    adapter: type | None = None


def _no_output_dropout(layer, rate: float) -> None:
    """Llama's and Mistral's dropout is on the attention output."""
    if rate:
        refuse(
            layer,
            "its dropout applies to the attention output, SelfAttention's to "
            "the attention weights",
        )


def _llama(layer, block) -> dict:
    _no_output_dropout(layer, layer.dropout)
    return {}


def _mistral(layer, block) -> dict:
    _no_output_dropout(layer, layer.get_config()["dropout"])
    return {"sliding_window": getattr(block, "sliding_window", None)}


def _qwen(layer, block) -> dict:
    """Qwen 2's (and Qwen MoE's): Llama's, with query, key and value biases
    (the output projection's, absent, is zero)."""
    _no_output_dropout(layer, layer.dropout)
    if layer.use_sliding_window_attention:
        refuse(
            layer,
            "keras-hub applies its sliding window on its unfused path only "
            "(its fused attention drops it: Qwen 2's on JAX and PyTorch, Qwen "
            "MoE's on GPUs)",
        )
    return {"use_bias": True}


def _phi3(layer, block) -> dict:
    """Phi-3's: Llama's; with `rope_scaling_type="su"` (Phi-3 128k), its
    short and long factors as a longrope scaling, and the multiplier of its
    cosines and sines (squared: each score's) in the scale."""
    _no_output_dropout(layer, layer.dropout)
    if layer.rope_scaling_type is None:
        return {}
    original = int(layer.pretraining_sequence_length)
    multiplier = rope_frequencies.longrope_multiplier(
        layer.max_sequence_length, original
    )
    head_dim = int(layer.query_dense.kernel.shape[-1])
    return {
        "rope_frequency_scaling": {
            "rope_type": rope_frequencies.LONGROPE,
            "short_factor": [float(f) for f in layer.rope_scaling_short_factor],
            "long_factor": [float(f) for f in layer.rope_scaling_long_factor],
            "original_max_position_embeddings": original,
        },
        "scale": multiplier**2 / math.sqrt(head_dim),
    }


def _smollm3(layer, block) -> dict:
    """SmolLM3's: Llama's with its own rotary embedding (the same rotation),
    none on the layers `rope_layer_enabled_list` leaves out."""
    rope = hub_attribute(layer, "rotary_embedding")
    if rope.partial_rotary_factor != 1 or rope.attention_scaling != 1:
        refuse(
            layer,
            "its rotary embedding turns part of each head (partial_rotary_factor="
            f"{rope.partial_rotary_factor}); SelfAttention's turns whole heads",
        )
    depth = rope.inv_freq.shape[0] * 2
    expected = rope.rope_theta ** -(np.arange(0, depth, 2) / depth)
    if not np.allclose(keras.ops.convert_to_numpy(rope.inv_freq), expected):
        refuse(layer, "its rotary embedding's inv_freq weights are not rope_theta's")
    return {
        "use_bias": bool(layer.attention_bias),
        "rope_max_wavelength": float(rope.rope_theta) if layer.use_rope else None,
    }


def _gemma(layer, block) -> dict:
    head_dim = layer.head_dim
    if not layer.query_head_dim_normalize:
        head_dim = layer.hidden_dim // layer.num_query_heads
    return {
        "scale": 1.0 / math.sqrt(head_dim),
        "logit_soft_cap": layer.logit_soft_cap,
        "sliding_window": (
            layer.sliding_window_size if layer.use_sliding_window_attention else None
        ),
        "dropout": float(layer.dropout),
    }


def _qwen3(layer, block) -> dict:
    """Qwen 3's (and Qwen 3 MoE's): Llama's, with query and key norms."""
    _no_output_dropout(layer, layer.dropout)
    return hub_qk_norm.qwen3(layer)


def _gemma3(layer, block) -> dict:
    """Gemma 3's: Gemma's, with query and key norms."""
    return {**_gemma(layer, block), **hub_qk_norm.gemma3(layer)}


_UNDERSCORED = {
    "query": "_query_dense",
    "key": "_key_dense",
    "value": "_value_dense",
    "output": "_output_dense",
}
_PUBLIC = {name: attribute[1:] for name, attribute in _UNDERSCORED.items()}
CLASSES = {
    "LlamaAttention": HubAttention(
        _UNDERSCORED, False, "rotary_embedding_layer", _llama
    ),
    "CachedMistralAttention": HubAttention(
        _UNDERSCORED, False, "rotary_embedding_layer", _mistral, band_in_mask=True
    ),
    "CachedGemmaAttention": HubAttention(
        _PUBLIC,
        True,
        "rope_layer",
        _gemma,
    ),
    "QwenAttention": HubAttention(_UNDERSCORED, False, "rotary_embedding_layer", _qwen),
    "QwenMoeAttention": HubAttention(
        {**_PUBLIC, "output": "_output_dense"}, False, "rotary_embedding_layer", _qwen
    ),
    "CachedMixtralAttention": HubAttention(
        _PUBLIC, False, "rotary_embedding_layer", _mistral, band_in_mask=True
    ),
    "Phi3Attention": HubAttention(_PUBLIC, False, "rotary_embedding_layer", _phi3),
    "Qwen3Attention": HubAttention(
        _UNDERSCORED, False, "rotary_embedding_layer", _qwen3
    ),
    "Qwen3MoeAttention": HubAttention(
        _UNDERSCORED, False, "rotary_embedding_layer", _qwen3
    ),
    "CachedGemma3Attention": HubAttention(_PUBLIC, True, "rope_layer", _gemma3),
    "SmolLM3Attention": HubAttention(
        {"query": "q_proj", "key": "k_proj", "value": "v_proj", "output": "o_proj"},
        False,
        None,
        _smollm3,
    ),
    "BloomAttention": HubAttention(_UNDERSCORED, False, None, hub_alibi_sinks.bloom),
    "FalconAttention": HubAttention(
        _PUBLIC,
        False,
        None,
        hub_alibi_sinks.falcon,
        adapter=hub_alibi_sinks.KerasHubFalconAttentionAdapter,
    ),
    "GptOssAttention": HubAttention(
        _PUBLIC, False, "rotary_embedding_layer", hub_alibi_sinks.gpt_oss
    ),
    "GPTNeoXAttention": HubAttention(
        {},
        False,
        None,
        None,
        convert=hub_neox.from_keras_hub,
        adapter=hub_neox.KerasHubPairAttentionAdapter,
    ),
}


def row(layer) -> HubAttention | None:
    """The row of `layer`'s class (keras-hub's own, not a subclass), or None."""
    cls = type(layer)
    if not cls.__module__.startswith("keras_hub."):
        return None
    return CLASSES.get(cls.__name__)


def _kernels(layer, spec: HubAttention) -> dict:
    """The kernels in SelfAttention's layout: `(features, heads * head_dim)`
    and `(heads * head_dim, output)`."""
    kernels = {}
    for name, attribute in spec.projections.items():
        value = keras.ops.convert_to_numpy(hub_attribute(layer, attribute).kernel)
        if name == "output":
            kernels[name] = value.reshape(-1, value.shape[-1])
            continue
        if spec.heads_first:
            value = np.transpose(value, (1, 0, 2))
        kernels[name] = value.reshape(value.shape[0], -1)
    return kernels


def _rotary(layer, spec: HubAttention, head_dim: int) -> dict:
    if spec.rotary is None:
        return {}  # `spec.arguments` gives it
    rope = hub_attribute(layer, spec.rotary)
    if (rope.sequence_axis, rope.feature_axis) not in ((1, -1), (1, 3)):
        refuse(layer, "its rotary embedding rotates other axes than time and depth")
    rope_type = getattr(rope, "rope_type", "linear")
    if rope_type == "yarn":
        return hub_alibi_sinks.yarn(rope, head_dim)
    if rope_type != "linear" and rope.scaling_factor != 1:
        refuse(
            layer,
            f"its rotary embedding is {rope_type!r}-scaled (scaling_factor="
            f"{rope.scaling_factor}); SelfAttention's scales positions, "
            "Llama 3.1's or YaRN's frequencies",
        )
    # keras-hub 0.32's `LlamaRotaryEmbedding` computes its frequencies
    # without its `position_scaling_factor` (its own `_get_inverse_freq`), so
    # Llama's and Llama 3's rotation is the unscaled one.
    unscaled = type(rope).__name__ == "LlamaRotaryEmbedding"
    arguments = {
        "rope_max_wavelength": float(rope.max_wavelength),
        "rope_scaling_factor": 1.0 if unscaled else float(rope.scaling_factor),
    }
    if getattr(rope, "frequency_adjustment_factor", None) is not None:
        arguments["rope_frequency_scaling"] = {  # Llama 3.1's
            "rope_type": "llama3",
            "factor": rope.frequency_adjustment_factor,
            "low_freq_factor": rope.low_freq_factor,
            "high_freq_factor": rope.high_freq_factor,
            "original_max_position_embeddings": rope.pretraining_sequence_length,
        }
    return arguments


def from_keras_hub(cls, layer, block):
    """A `cls` (SelfAttention) computing what the built keras-hub attention
    `layer` computes when `block` (the layer holding it) calls it with its
    causal mask: causal, the same heads, rotary embedding, scale, soft-cap,
    sliding window and weights.

    Raises:
        ValueError: one line, for a class without a row, an unbuilt or
            quantized layer, or Llama's and Mistral's dropout (on the
            attention output; SelfAttention's is on the weights).
    """
    spec = row(layer)
    if spec is None:
        refuse(layer, "it is not one of keras-hub's " + ", ".join(sorted(CLASSES)))
    if not layer.built:
        refuse(layer, "it is not built")
    if spec.convert is not None:
        return spec.convert(cls, layer, block)
    if any(
        getattr(hub_attribute(layer, attribute), "quantization_mode", None)
        for attribute in spec.projections.values()
    ):
        refuse(layer, "it is quantized: convert the float model, then quantize")
    kernels = _kernels(layer, spec)
    features, heads_width = kernels["query"].shape
    # Every output kernel is `(heads, head_dim, output)` but Bloom's (a Dense's:
    # its query kernel is `(features, heads, head_dim)`).
    output = hub_attribute(layer, spec.projections["output"]).kernel
    if len(output.shape) == 3:
        head_dim = int(output.shape[-2])
    else:
        head_dim = int(hub_attribute(layer, spec.projections["query"]).kernel.shape[-1])
    heads = heads_width // head_dim
    key_value_heads = kernels["key"].shape[1] // head_dim
    arguments = spec.arguments(layer, block)
    sa = cls(
        num_heads=heads,
        num_key_value_heads=key_value_heads,
        key_dim=head_dim,
        value_dim=head_dim,
        output_dim=int(kernels["output"].shape[-1]),
        causal=True,
        **_rotary(layer, spec, head_dim),
        **arguments,
        dtype=layer.dtype_policy,
        name=layer.name,
    )
    sa.build((None, None, features))
    for name, kernel in kernels.items():
        getattr(sa, f"{name}_dense").kernel.assign(kernel)
    if sa.use_sinks:  # GPT-OSS's
        sa.sinks.assign(keras.ops.convert_to_numpy(layer.sinks))
    if sa.use_query_key_norm:  # Qwen 3's, Gemma 3's
        query_scale, key_scale = hub_qk_norm.scales(layer)
        sa.query_norm_scale.assign(query_scale)
        sa.key_norm_scale.assign(key_scale)
    if sa.use_bias:
        for name, attribute in spec.projections.items():
            bias = hub_attribute(layer, attribute).bias
            if bias is not None:
                getattr(sa, f"{name}_dense").bias.assign(
                    np.reshape(keras.ops.convert_to_numpy(bias), (-1,))
                )
    return sa
