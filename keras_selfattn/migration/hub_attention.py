"""keras-hub's own attention classes (Llama's, Mistral's, Gemma's) as a
SelfAttention with the same configuration and weights.

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


@dataclasses.dataclass(frozen=True)
class HubAttention:
    """One keras-hub attention class.

    Attributes:
        projections: SelfAttention's projection -> the keras-hub layer's
            `EinsumDense` attribute.
        heads_first: Whether the query, key and value kernels are
            `(heads, features, head_dim)` (Gemma's) rather than `(features,
            heads, head_dim)`.
        rotary: The attribute of its rotary embedding layer.
        arguments: `(layer, block) -> dict` of SelfAttention's arguments
            other than the sizes, read off the layer and the block holding
            it (Mistral's block holds its sliding window).
        band_in_mask: Whether the block puts the sliding window in the
            `attention_mask` it passes (Mistral's) rather than the layer
            applying it (Gemma's).
    """

    projections: dict
    heads_first: bool
    rotary: str
    arguments: Callable
    band_in_mask: bool = False


def _no_output_dropout(layer, rate: float) -> None:
    """Llama's and Mistral's dropout is on the attention output."""
    if rate:
        _refuse(
            layer,
            "its dropout applies to the attention output, SelfAttention's to "
            "the attention weights",
        )


def _llama(layer, block) -> dict:
    _no_output_dropout(layer, layer.dropout)
    return {}


def _mistral(layer, block) -> dict:
    _no_output_dropout(layer, layer._dropout)
    return {"sliding_window": getattr(block, "sliding_window", None)}


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


_UNDERSCORED = {
    "query": "_query_dense",
    "key": "_key_dense",
    "value": "_value_dense",
    "output": "_output_dense",
}
CLASSES = {
    "LlamaAttention": HubAttention(
        _UNDERSCORED, False, "rotary_embedding_layer", _llama
    ),
    "CachedMistralAttention": HubAttention(
        _UNDERSCORED, False, "rotary_embedding_layer", _mistral, band_in_mask=True
    ),
    "CachedGemmaAttention": HubAttention(
        {
            "query": "query_dense",
            "key": "key_dense",
            "value": "value_dense",
            "output": "output_dense",
        },
        True,
        "rope_layer",
        _gemma,
    ),
}


def row(layer) -> HubAttention | None:
    """The row of `layer`'s class (keras-hub's own, not a subclass), or None."""
    cls = type(layer)
    if not cls.__module__.startswith("keras_hub."):
        return None
    return CLASSES.get(cls.__name__)


def _refuse(layer, why: str) -> None:
    raise ValueError(
        f"Cannot convert {type(layer).__name__} '{layer.name}' to SelfAttention: "
        f"{why}. Received: layer={layer.name!r}"
    )


def _kernels(layer, spec: HubAttention) -> dict:
    """The kernels in SelfAttention's layout: `(features, heads * head_dim)`
    and `(heads * head_dim, output)`."""
    kernels = {}
    for name, attribute in spec.projections.items():
        value = keras.ops.convert_to_numpy(getattr(layer, attribute).kernel)
        if name == "output":
            kernels[name] = value.reshape(-1, value.shape[-1])
            continue
        if spec.heads_first:
            value = np.transpose(value, (1, 0, 2))
        kernels[name] = value.reshape(value.shape[0], -1)
    return kernels


def _rotary(layer, spec: HubAttention) -> dict:
    rope = getattr(layer, spec.rotary)
    for name in ("frequency_adjustment_factor", "low_freq_factor"):
        if getattr(rope, name, None) is not None:
            _refuse(
                layer,
                f"its rotary embedding adjusts frequencies (Llama 3.1's {name}="
                f"{getattr(rope, name)}); SelfAttention's scales positions only",
            )
    if (rope.sequence_axis, rope.feature_axis) not in ((1, -1), (1, 3)):
        _refuse(layer, "its rotary embedding rotates other axes than time and depth")
    return {
        "rope_max_wavelength": float(rope.max_wavelength),
        "rope_scaling_factor": float(rope.scaling_factor),
    }


def from_keras_hub(cls, layer, block):
    """A `cls` (SelfAttention) computing what the built keras-hub attention
    `layer` computes when `block` (the layer holding it) calls it with its
    causal mask: causal, the same heads, rotary embedding, scale, soft-cap,
    sliding window and weights.

    Raises:
        ValueError: one line, for a class without a row, an unbuilt or
            quantized layer, Llama 3.1's frequency adjustment, or Llama's and Mistral's
            dropout (on the attention output; SelfAttention's is on the
            weights).
    """
    spec = row(layer)
    if spec is None:
        _refuse(layer, "it is not one of keras-hub's " + ", ".join(sorted(CLASSES)))
    if not layer.built:
        _refuse(layer, "it is not built")
    if any(
        getattr(getattr(layer, attribute), "quantization_mode", None)
        for attribute in spec.projections.values()
    ):
        _refuse(layer, "it is quantized: convert the float model, then quantize")
    kernels = _kernels(layer, spec)
    features, heads_width = kernels["query"].shape
    query = getattr(layer, spec.projections["query"]).kernel
    head_dim = int(query.shape[-1])
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
        **_rotary(layer, spec),
        **arguments,
        dtype=layer.dtype_policy,
        name=layer.name,
    )
    sa.build((None, None, features))
    for name, kernel in kernels.items():
        getattr(sa, f"{name}_dense").kernel.assign(kernel)
    return sa


def mask_is_causal(calls: list[dict], layer, window: int | None) -> bool:
    """Whether every recorded call of `layer` was given the causal mask as
    its `attention_mask` (within `window` where its block puts the band
    there): the example run pads nothing."""
    if not row(layer).band_in_mask:
        window = None
    for call in calls:
        mask = call.get("attention_mask")
        if mask is None or len(mask.shape) != 3:
            return False
        mask = keras.ops.convert_to_numpy(mask).astype(bool)
        queries, keys = mask.shape[-2:]
        i, j = np.arange(queries)[:, None], np.arange(keys)[None, :]
        expected = (j <= i) & ((i - j) < (window or keys + 1))
        if queries != keys or not (mask == expected).all():
            return False
    return True
