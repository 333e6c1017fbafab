"""`MultiHeadAttentionAdapter`: a SelfAttention called the way Keras's
MultiHeadAttention is, so that code the package does not own (a user's
subclassed block, keras-hub's layers) keeps calling `self.att(x, x, ...)`
after `convert` put it in place of a MultiHeadAttention.

The adapter only translates the call: the SelfAttention it holds owns the
weights, the masks' rules and decoding (a decoding scope finds it the way it
finds any SelfAttention).
"""

from __future__ import annotations

import inspect

import keras
from keras import ops

from keras_selfattn import decoding
from keras_selfattn.self_attention import SelfAttention

_SELF = "query"


class AttentionAdapter(keras.layers.Layer):
    """What every adapter shares: the SelfAttention it holds (its
    `attention` attribute, which owns the weights) and its saving.

    Args:
        attention: The SelfAttention that computes the attention.
        **kwargs: Base layer arguments (`name`, ...).
    """

    def __init__(self, attention: SelfAttention, **kwargs):
        super().__init__(**kwargs)
        if not isinstance(attention, SelfAttention):
            raise ValueError(
                f"{type(self).__name__} holds a SelfAttention. "
                f"Received: attention={type(attention).__name__}"
            )
        self.attention = attention
        self.supports_masking = True

    def build(self, input_shape):
        # One argument: Keras passes the first input's shape (the query's).
        if not self.attention.built:
            self.attention.build(input_shape)

    def get_config(self) -> dict:
        return {
            **super().get_config(),
            "attention": keras.saving.serialize_keras_object(self.attention),
        }

    @classmethod
    def from_config(cls, config: dict):
        config = dict(config)
        config["attention"] = keras.saving.deserialize_keras_object(config["attention"])
        return cls(**config)


@keras.saving.register_keras_serializable(package="keras_selfattn")
class MultiHeadAttentionAdapter(AttentionAdapter):
    """A SelfAttention behind MultiHeadAttention's call signature.

    `adapter(query, value, key=None, ...)` computes what the SelfAttention
    it holds computes on `query`, for self-attention calls only: `value`
    (and `key`, when given) must be `query` itself. The Keras masks of the
    query (Keras passes them as `query_mask`, `value_mask`) are the padding;
    `attention_mask` is passed on; `use_causal_mask` must agree with the
    SelfAttention's `causal` (None: as the layer is). A `cache` and
    `cache_update_index` (keras-hub's `CachedMultiHeadAttention` call) are
    passed on, in the same cache layout.

    Args:
        attention: The SelfAttention that computes the attention.
        causal_attention_mask: Whether the caller's `attention_mask` is the
            causal mask merged with the keys' padding (keras-hub's
            `TransformerDecoder` computes its own): with a causal
            `attention`, a decoding step (which applies both from its
            cache) drops it. Defaults to False.
        **kwargs: Base layer arguments (`name`, ...).

    Example:

    >>> import keras, numpy as np
    >>> from keras_selfattn.migration.adapter import MultiHeadAttentionAdapter
    >>> mha = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)
    >>> x = np.random.rand(1, 5, 8).astype("float32")
    >>> _ = mha(x, x)
    >>> adapter = MultiHeadAttentionAdapter.from_multi_head_attention(mha)
    >>> bool(np.allclose(adapter(x, x), mha(x, x), atol=1e-5))
    True
    """

    def __init__(
        self, attention: SelfAttention, causal_attention_mask: bool = False, **kwargs
    ):
        super().__init__(attention, **kwargs)
        if causal_attention_mask and not attention.causal:
            raise ValueError(
                "MultiHeadAttentionAdapter: causal_attention_mask=True needs a "
                f"causal SelfAttention. Received: attention.causal={attention.causal}"
            )
        self.causal_attention_mask = bool(causal_attention_mask)

    @classmethod
    def from_multi_head_attention(
        cls, layer, causal: bool = False, causal_attention_mask: bool = False
    ):
        """The adapter of a built MultiHeadAttention or GroupQueryAttention:
        its SelfAttention from `SelfAttention.from_multi_head_attention`
        (same weights), its name the layer's."""
        attention = SelfAttention.from_multi_head_attention(layer, causal=causal)
        adapter = cls(
            attention,
            causal_attention_mask=causal_attention_mask,
            name=layer.name,
            dtype=layer.dtype_policy,
        )
        adapter.built = True
        return adapter

    def __call__(self, *args, **kwargs):
        # Before Keras casts the inputs (two casts are two tensors) and
        # rewrites errors raised in `call` into several lines.
        bound = _SIGNATURE.bind(None, *args, **kwargs).arguments
        query = bound.get(_SELF)
        for name in ("value", "key"):
            other = bound.get(name)
            if other is not None and other is not query:
                raise ValueError(
                    f"MultiHeadAttentionAdapter '{self.name}' computes "
                    f"self-attention: its {name} must be its query (a "
                    "cross-attention call needs Keras's MultiHeadAttention). "
                    f"Received: {name} of shape {getattr(other, 'shape', None)}"
                )
        causal = bound.get("use_causal_mask")
        if causal is not None and bool(causal) != self.attention.causal:
            raise ValueError(
                f"MultiHeadAttentionAdapter '{self.name}' was converted with "
                f"causal={self.attention.causal}: a call with a different "
                "use_causal_mask needs its own layer. "
                f"Received: use_causal_mask={causal}"
            )
        return super().__call__(*args, **kwargs)

    def call(
        self,
        query,
        value=None,
        key=None,
        query_mask=None,
        value_mask=None,
        key_mask=None,
        attention_mask=None,
        return_attention_scores: bool = False,
        training=None,
        use_causal_mask: bool | None = None,
        cache=None,
        cache_update_index=None,
    ):
        if self.causal_attention_mask and decoding.active() is not None:
            attention_mask = None  # the step's cache applies both
        padding = next(
            (m for m in (key_mask, value_mask, query_mask) if m is not None), None
        )
        if query_mask is not None and padding is not query_mask:
            attention_mask = _with_query_rows(attention_mask, query_mask)
        padding, attention_mask = _as_padding(query, padding, attention_mask)
        arguments = {
            "mask": padding,
            "attention_mask": attention_mask,
            "training": training,
            "return_attention_scores": return_attention_scores,
        }
        if cache is not None:
            arguments.update(cache=cache, cache_update_index=cache_update_index)
        return self.attention(query, **arguments)

    def compute_output_spec(self, query, value=None, key=None, **kwargs):
        arguments = {
            name: kwargs[name]
            for name in ("return_attention_scores", "cache", "cache_update_index")
            if kwargs.get(name) is not None
        }
        return self.attention.compute_output_spec(query, **arguments)

    def get_config(self) -> dict:
        return {
            **super().get_config(),
            "causal_attention_mask": self.causal_attention_mask,
        }


_SIGNATURE = inspect.signature(MultiHeadAttentionAdapter.call)


def _as_padding(query, padding, attention_mask):
    """An `attention_mask` of one row for every query (`(batch, 1, keys)`,
    keras-hub's padding) as SelfAttention's `mask`, the fast and decodable
    path; any other broadcast to `(batch, queries, keys)`."""
    if attention_mask is None:
        return padding, None
    batch, time = ops.shape(query)[0], ops.shape(query)[1]
    if len(attention_mask.shape) == 3 and attention_mask.shape[1] == 1:
        keys = ops.cast(attention_mask[:, 0, :], "bool")
        if padding is not None:
            keys = ops.logical_and(ops.cast(padding, "bool"), keys)
        return ops.broadcast_to(keys, (batch, time)), None
    return padding, ops.broadcast_to(attention_mask, (batch, time, time))


def _with_query_rows(attention_mask, query_mask):
    """`attention_mask` with the rows of the queries `query_mask` pads
    removed (a query mask other than the keys' padding, as
    MultiHeadAttention applies it), `(batch, queries, keys)`."""
    rows = ops.expand_dims(ops.cast(query_mask, "bool"), -1)
    if attention_mask is None:
        attention_mask = ops.expand_dims(ops.ones_like(query_mask, "bool"), 1)
    return ops.logical_and(ops.cast(attention_mask, "bool"), rows)
