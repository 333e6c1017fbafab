"""One built `MultiHeadAttention` or `GroupedQueryAttention` as a SelfAttention
with the same configuration and weights.

Keras's layers project with `EinsumDense` kernels `(features, heads,
head_dim)` and an output kernel `(heads, value_dim, output)`; SelfAttention's
projections are `Dense` kernels `(features, heads * head_dim)` and
`(heads * value_dim, output)`, heads outermost: the same numbers, reshaped.
"""

from __future__ import annotations

import keras
import numpy as np

MultiHeadAttention = keras.layers.MultiHeadAttention
GroupedQueryAttention = keras.layers.GroupQueryAttention
CONVERTIBLE = (MultiHeadAttention, GroupedQueryAttention)
# What computes the projections and the attention: a subclass overriding one
# may compute otherwise (keras-hub's CachedMultiHeadAttention overrides only
# `call`, to add its cache).
_COMPUTING = ("build", "_compute_attention", "_masked_softmax")

# Keras's sublayer attribute of each SelfAttention projection.
_SUBLAYERS = {
    "query": "_query_dense",
    "key": "_key_dense",
    "value": "_value_dense",
    "gate": "_gate_dense",
    "output": "_output_dense",
}


def _refuse(layer, why: str) -> None:
    raise ValueError(
        f"Cannot convert {type(layer).__name__} '{layer.name}' to SelfAttention: "
        f"{why}. Received: layer={layer.name!r}"
    )


def _check(layer) -> None:
    """Raises ValueError for what SelfAttention does not compute alike."""
    base = next((base for base in CONVERTIBLE if isinstance(layer, base)), None)
    if base is None:
        _refuse(layer, "it is not a MultiHeadAttention or GroupQueryAttention")
    for method in _COMPUTING:
        if getattr(type(layer), method) is not getattr(base, method):
            _refuse(layer, f"its class overrides {method}: it may compute otherwise")
    if not layer.built:
        _refuse(layer, "it is not built (call it once, or load its weights)")
    if base is MultiHeadAttention:
        if layer._query_dense.equation != "abc,cde->abde" or layer._attention_axes != (
            1,
        ):
            _refuse(
                layer,
                "it attends over axes other than time of (batch, time, "
                f"features) inputs (attention_axes={layer._attention_axes})",
            )
        if len(layer._output_dense.kernel.shape) != 3:
            _refuse(
                layer,
                f"its output_shape={layer._output_shape} has several axes; "
                "SelfAttention's output_dim is one width",
            )
    features = {
        layer._query_dense.kernel.shape[0],
        layer._key_dense.kernel.shape[0],
        layer._value_dense.kernel.shape[0],
    }
    if len(features) != 1:
        _refuse(
            layer,
            f"its query, key and value were built for {sorted(features)} "
            "features (a cross-attention layer); self-attention has one input",
        )
    if any(
        getattr(getattr(layer, attribute, None), "quantization_mode", None)
        for attribute in _SUBLAYERS.values()
    ):
        _refuse(layer, "it is quantized: convert the float model, then quantize")
    regularizer = getattr(layer, "_activity_regularizer", None) or getattr(
        layer, "activity_regularizer", None
    )
    if regularizer is not None:
        _refuse(
            layer,
            "its activity_regularizer applies to every projection's output, "
            "SelfAttention's to the layer's output",
        )


def _arguments(layer, causal: bool) -> dict:
    """SelfAttention's constructor arguments for `layer`."""
    if isinstance(layer, MultiHeadAttention):
        heads, key_dim, value_dim = layer.num_heads, layer.key_dim, layer.value_dim
        kv_heads, private = None, "_"
    else:
        heads, kv_heads = layer.num_query_heads, layer.num_key_value_heads
        key_dim = value_dim = layer.head_dim
        private = ""
    objects = {
        f"{kind}_{what}": getattr(layer, f"{private}{kind}_{what}")
        for kind in ("kernel", "bias")
        for what in ("initializer", "regularizer", "constraint")
    }
    return {
        "num_heads": heads,
        "key_dim": key_dim,
        "value_dim": value_dim,
        # Keras's layers always project the heads' concatenation.
        "output_dim": layer._output_dense.kernel.shape[-1],
        "use_bias": bool(layer.use_bias),
        "causal": causal,
        "sliding_window": (
            layer._sliding_window
            if isinstance(layer, MultiHeadAttention)
            else layer.sliding_window
        ),
        "dropout": float(layer.dropout),
        "seed": layer.seed,
        "flash_attention": layer._flash_attention,
        "num_key_value_heads": kv_heads,
        "use_gate": bool(getattr(layer, "_use_gate", getattr(layer, "use_gate", 0))),
        **objects,
        "dtype": layer.dtype_policy,
        "name": layer.name,
    }


def _flat(variable, rows: int) -> np.ndarray:
    """A kernel or bias of Keras's einsum layout in SelfAttention's: every
    axis but the last `rows`-th one flattened into the heads' columns."""
    value = keras.ops.convert_to_numpy(variable)
    if rows == 0:  # a bias: (heads, head_dim) -> (heads * head_dim,)
        return value.reshape(-1)
    if rows == 1:  # (features, heads, head_dim) -> (features, heads * head_dim)
        return value.reshape(value.shape[0], -1)
    return value.reshape(-1, value.shape[-1])  # (heads, value_dim, out)


def from_multi_head_attention(cls, layer: keras.layers.Layer, causal: bool = False):
    """A `cls` (SelfAttention) with the configuration and weights of `layer`:
    `SelfAttention.from_multi_head_attention(layer, causal)`, its one home
    (the class passed in: this module does not import the layer's).

    `layer` is a built `keras.layers.MultiHeadAttention` or
    `keras.layers.GroupedQueryAttention` on `(batch, time, features)` inputs.
    The result's `sa(x)` returns what `layer(x, x)` returns (and
    `sa(x, attention_mask=m)` what `layer(x, x, attention_mask=m)` does);
    with a Keras padding mask its real positions do too, while its padded
    positions output zeros (Keras's layers average every value there).
    Dropout is kept (rate and seed; the random draws differ).

    Args:
        cls: `SelfAttention`.
        layer: The built Keras attention layer.
        causal: The `use_causal_mask` of the layer's calls: Keras takes it
            per call, SelfAttention at construction.

    Returns:
        A built SelfAttention of the same name, dtype policy and weights.

    Raises:
        ValueError: one line naming what SelfAttention does not compute
            alike (a subclass overriding `build`, `_compute_attention` or
            `_masked_softmax`, other attention axes, a multi-axis
            `output_shape`, a cross-attention build, quantized kernels, an
            `activity_regularizer`), or if `layer` is not built.

    Example:

    >>> import keras, numpy as np
    >>> from keras_selfattn import SelfAttention
    >>> mha = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)
    >>> x = np.random.rand(1, 5, 8).astype("float32")
    >>> _ = mha(x, x)
    >>> sa = SelfAttention.from_multi_head_attention(mha)
    >>> bool(np.allclose(sa(x), mha(x, x), atol=1e-5))
    True
    """
    _check(layer)
    sa = cls(**_arguments(layer, causal))
    sa.build((None, None, layer._query_dense.kernel.shape[0]))
    for name, attribute in _SUBLAYERS.items():
        source = getattr(layer, attribute, None)
        target = getattr(sa, f"{name}_dense")
        if target is None:
            continue
        rows = 2 if name == "output" else 1
        target.kernel.assign(_flat(source.kernel, rows))
        if target.bias is not None:
            target.bias.assign(_flat(source.bias, 0))
    return sa
