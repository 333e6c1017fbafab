"""`KerasHubAttentionAdapter`: a SelfAttention called the way keras-hub's own
attention layers are (`LlamaAttention`, `CachedMistralAttention`,
`CachedGemmaAttention`), so that keras-hub's decoder blocks keep calling
`self._self_attention_layer(hidden_states=x, attention_mask=...)` after
`convert` put it in their place (`hub_attention` maps the weights).
"""

from __future__ import annotations

import keras
from keras import ops

from keras_selfattn import decoding
from keras_selfattn.migration.adapter import AttentionAdapter


@keras.saving.register_keras_serializable(package="keras_selfattn")
class KerasHubAttentionAdapter(AttentionAdapter):
    """A SelfAttention behind the call signature of keras-hub's attention
    layers: `adapter(hidden_states, attention_mask=None, training=None)`.

    keras-hub's decoder blocks pass the causal mask (merged with the keys'
    padding, and Mistral's band) as `attention_mask`: it is passed on to the
    causal SelfAttention, which applies the same band; a decoding step
    (`keras_selfattn.generate`), whose cache applies them, drops it.
    keras-hub's own cache is not taken: decode the converted model with
    `keras_selfattn.generate`.

    Args:
        attention: The SelfAttention that computes the attention (causal).
        **kwargs: Base layer arguments (`name`, ...).

    Example:

    >>> import numpy as np, keras_selfattn
    >>> from keras_selfattn.migration.hub_adapter import KerasHubAttentionAdapter
    >>> sa = keras_selfattn.SelfAttention(num_heads=2, causal=True)
    >>> adapter = KerasHubAttentionAdapter(sa)
    >>> adapter(np.ones((1, 3, 4), "float32")).shape
    (1, 3, 4)
    """

    def __init__(self, attention, **kwargs):
        super().__init__(attention, **kwargs)
        if not attention.causal:
            raise ValueError(
                "KerasHubAttentionAdapter holds a causal SelfAttention (keras-hub's "
                "decoders are causal). Received: attention.causal=False"
            )

    def __call__(self, hidden_states, attention_mask=None, cache=None, **kwargs):
        # Before Keras rewrites errors raised in `call` into several lines.
        if cache is not None:
            raise ValueError(
                f"KerasHubAttentionAdapter '{self.name}' does not take keras-hub's "
                "cache: decode the converted model with keras_selfattn.generate. "
                f"Received: cache of shape {getattr(cache, 'shape', None)}"
            )
        kwargs.pop("cache_update_index", None)
        return super().__call__(hidden_states, attention_mask=attention_mask, **kwargs)

    def call(self, hidden_states, attention_mask=None, training=None):
        if attention_mask is not None and decoding.active() is None:
            attention_mask = ops.cast(attention_mask, "bool")
        else:
            attention_mask = None  # a decoding step: its cache applies it
        return self.attention(
            hidden_states, attention_mask=attention_mask, training=training
        )

    def compute_output_spec(self, hidden_states, **kwargs):
        return self.attention.compute_output_spec(hidden_states)
