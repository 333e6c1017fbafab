"""keras-hub's GPT-NeoX attention (`GPTNeoXAttention`) as a SelfAttention,
and the adapter its decoder calls: `hub_attention.CLASSES` holds its row.

One `EinsumDense` projects the queries, keys and values: its kernel is
`(features, heads, 3 * head_dim)`, each head's query columns, then its
key's, then its value's, and so is its bias `(heads, 3 * head_dim)`; the
output projection's kernel is `(heads * head_dim, features)`, with a bias.
keras-hub's `RotaryEmbedding` turns the first `int(head_dim *
rotary_percentage)` features of each query and key head, in halves within
them (SelfAttention's `rope_partial_fraction`); its dropout is on the
attention weights, as SelfAttention's.

Its decoder unpacks `(output, cache)` from every attention call:
`KerasHubPairAttentionAdapter` returns `(output, None)`.

keras-hub 0.32's cached call rotates a decoding step's query as position 0
(its `RotaryEmbedding` is called without the step's `start_index`), so its
own `generate` differs from its forward pass from the first new token on;
the converted model decodes what the forward pass computes at every length.
"""

from __future__ import annotations

import keras
import numpy as np

from keras_selfattn._from_keras import refuse
from keras_selfattn._keras_private import hub_attribute
from keras_selfattn.migration.hub_adapter import KerasHubAttentionAdapter


def _numpy(weight) -> np.ndarray:
    return keras.ops.convert_to_numpy(weight)


def from_keras_hub(cls, layer, block):
    """A causal `cls` (SelfAttention) with the heads, partial rotary
    embedding, dropout and weights of the built `GPTNeoXAttention` `layer`
    (`block`, its decoder, adds nothing)."""
    fused = hub_attribute(layer, "_qkv_dense")
    output = hub_attribute(layer, "_output_dense")
    if fused.quantization_mode or output.quantization_mode:
        refuse(layer, "it is quantized: convert the float model, then quantize")
    kernel, bias = _numpy(fused.kernel), _numpy(fused.bias)
    features, heads, width = kernel.shape
    head_dim = width // 3
    sa = cls(
        num_heads=heads,
        key_dim=head_dim,
        value_dim=head_dim,
        output_dim=int(output.kernel.shape[-1]),
        use_bias=True,
        causal=True,
        dropout=float(layer.dropout),
        rope_max_wavelength=float(layer.rotary_max_wavelength),
        rope_partial_fraction=float(layer.rotary_percentage),
        dtype=layer.dtype_policy,
        name=layer.name,
    )
    sa.build((None, None, features))
    for index, name in enumerate(("query", "key", "value")):
        part = slice(index * head_dim, (index + 1) * head_dim)
        dense = getattr(sa, f"{name}_dense")
        dense.kernel.assign(kernel[:, :, part].reshape(features, -1))
        dense.bias.assign(bias[:, part].reshape(-1))
    sa.output_dense.kernel.assign(_numpy(output.kernel))
    sa.output_dense.bias.assign(_numpy(output.bias))
    return sa


@keras.saving.register_keras_serializable(package="keras_selfattn")
class KerasHubPairAttentionAdapter(KerasHubAttentionAdapter):
    """`KerasHubAttentionAdapter` returning `(output, None)`: the attention
    output and no keras-hub cache, as GPT-NeoX's decoder unpacks them.

    Args:
        attention: The SelfAttention that computes the attention (causal).
        **kwargs: Base layer arguments (`name`, ...).

    Example:

    >>> import numpy as np, keras_selfattn
    >>> from keras_selfattn.migration.hub_neox import KerasHubPairAttentionAdapter
    >>> sa = keras_selfattn.SelfAttention(num_heads=2, causal=True)
    >>> output, cache = KerasHubPairAttentionAdapter(sa)(np.ones((1, 3, 4), "float32"))
    >>> tuple(output.shape), cache
    ((1, 3, 4), None)
    """

    def call(self, hidden_states, attention_mask=None, training=None):
        return super().call(hidden_states, attention_mask, training), None

    def compute_output_spec(self, hidden_states, **kwargs):
        return super().compute_output_spec(hidden_states), None
