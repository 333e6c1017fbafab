"""A built `MultiHeadAttention` or `GroupedQueryAttention` as the arguments
and weights of a SelfAttention (`SelfAttention.from_multi_head_attention`;
`convert` builds on it), read through their public properties and
`get_config()`.

Keras's layers project with `EinsumDense` kernels `(features, heads,
head_dim)` and an output kernel `(heads, value_dim, output)`; SelfAttention's
projections are `Dense` kernels `(features, heads * head_dim)` and
`(heads * value_dim, output)`, heads outermost: the same numbers, reshaped.
"""

from __future__ import annotations

import keras
import numpy as np

from keras_selfattn._keras_private import attention_sublayer, flash_attention

MultiHeadAttention = keras.layers.MultiHeadAttention
GroupedQueryAttention = keras.layers.GroupQueryAttention
CONVERTIBLE = (MultiHeadAttention, GroupedQueryAttention)
# What computes the projections and the attention: a subclass overriding one
# may compute otherwise (keras-hub's CachedMultiHeadAttention overrides only
# `call`, to add its cache).
_COMPUTING = ("build", "_compute_attention", "_masked_softmax")
_PROJECTIONS = ("query", "key", "value", "gate", "output")
_OBJECTS = tuple(
    f"{kind}_{what}"
    for kind in ("kernel", "bias")
    for what in ("initializer", "regularizer", "constraint")
)


def refuse(layer, why: str) -> None:
    """Raises the one-line ValueError of an attention `layer` that does not
    convert to SelfAttention, and `why`."""
    raise ValueError(
        f"Cannot convert {type(layer).__name__} '{layer.name}' to SelfAttention: "
        f"{why}. Received: layer={layer.name!r}"
    )


def _check(layer, config: dict) -> None:
    """Raises ValueError for what SelfAttention does not compute alike."""
    base = next((base for base in CONVERTIBLE if isinstance(layer, base)), None)
    if base is None:
        refuse(layer, "it is not a MultiHeadAttention or GroupQueryAttention")
    for method in _COMPUTING:
        if getattr(type(layer), method) is not getattr(base, method):
            refuse(layer, f"its class overrides {method}: it may compute otherwise")
    if not layer.built:
        refuse(layer, "it is not built (call it once, or load its weights)")
    dense = {name: attention_sublayer(layer, name) for name in _PROJECTIONS}
    if base is MultiHeadAttention:
        axes = layer.attention_axes
        if dense["query"].equation != "abc,cde->abde" or axes != (1,):
            refuse(
                layer,
                "it attends over axes other than time of (batch, time, "
                f"features) inputs (attention_axes={axes})",
            )
        if len(dense["output"].kernel.shape) != 3:
            refuse(
                layer,
                f"its output_shape={config['output_shape']} has several axes; "
                "SelfAttention's output_dim is one width",
            )
    features = {dense[name].kernel.shape[0] for name in ("query", "key", "value")}
    if len(features) != 1:
        refuse(
            layer,
            f"its query, key and value were built for {sorted(features)} "
            "features (a cross-attention layer); self-attention has one input",
        )
    if any(getattr(d, "quantization_mode", None) for d in dense.values()):
        refuse(layer, "it is quantized: convert the float model, then quantize")
    if config.get("activity_regularizer") is not None:
        refuse(
            layer,
            "its activity_regularizer applies to every projection's output, "
            "SelfAttention's to the layer's output",
        )


def _arguments(layer, config: dict, causal: bool) -> dict:
    """SelfAttention's constructor arguments for `layer` (`config`: its
    `get_config()`)."""
    if isinstance(layer, MultiHeadAttention):
        heads, key_dim = config["num_heads"], config["key_dim"]
        value_dim = config["value_dim"] or key_dim
        kv_heads = None
    else:
        heads, kv_heads = config["num_query_heads"], config["num_key_value_heads"]
        key_dim = value_dim = config["head_dim"]
    return {
        "num_heads": heads,
        "key_dim": key_dim,
        "value_dim": value_dim,
        # Keras's layers always project the heads' concatenation.
        "output_dim": attention_sublayer(layer, "output").kernel.shape[-1],
        "use_bias": bool(config["use_bias"]),
        "causal": causal,
        "sliding_window": config.get("sliding_window"),
        "dropout": float(config["dropout"]),
        "seed": config.get("seed"),
        "flash_attention": flash_attention(layer),
        "num_key_value_heads": kv_heads,
        "use_gate": bool(config.get("use_gate")),
        **{name: config[name] for name in _OBJECTS},
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
    (the class passed in: this module does not import the layer's module).

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
    config = layer.get_config()
    _check(layer, config)
    sa = cls(**_arguments(layer, config, causal))
    sa.build((None, None, attention_sublayer(layer, "query").kernel.shape[0]))
    for name in _PROJECTIONS:
        source = attention_sublayer(layer, name)
        target = getattr(sa, f"{name}_dense")
        if target is None:
            continue
        rows = 2 if name == "output" else 1
        target.kernel.assign(_flat(source.kernel, rows))
        if target.bias is not None:
            target.bias.assign(_flat(source.bias, 0))
    return sa
