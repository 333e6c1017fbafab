"""The `SelfAttention` layer."""

from __future__ import annotations

import math

import keras
from keras import constraints, initializers, ops, regularizers

from keras_selfattn import _checks
from keras_selfattn import attention_ops as aops
from keras_selfattn.chunked_attention import chunked_attention

# Name scope around the full attention core: (B, H, T, K) query and key,
# (B, H, T, V) value and the bool mask in, (B, H, T, V) heads out.
# `export_onnx(fuse_attention=True)` replaces the ops under it with ONNX's
# Attention operator; a name scope adds no computation.
FUSABLE_CORE_SCOPE = "fusable_attention_core"


def _fresh_initializer(initializer, offset: int):
    """A new initializer instance for each weight.

    Keras 3 initializers are stateless: one instance (seeded or not) gives the
    same values on every call, which would make the query, key and value
    kernels identical. An explicit integer seed is offset per weight, so
    seeded layers stay reproducible and their kernels still differ.
    """
    config = initializer.get_config()
    if isinstance(config.get("seed"), int):
        config["seed"] += offset
    return initializer.__class__.from_config(config)


@keras.saving.register_keras_serializable(package="keras_selfattn")
class SelfAttention(keras.layers.Layer):
    """Multi-head scaled dot-product self-attention over a sequence.

    For each head h, with X the input of shape `(batch, time, features)`:
    `Q = X Wq_h (+ bq_h)`, `K = X Wk_h (+ bk_h)`, `V = X Wv_h (+ bv_h)` and
    `head_h = softmax(Q K^T * scale) V`, with `scale = 1 / sqrt(key_dim)`
    unless given. The heads are concatenated, then optionally projected to
    `output_dim`. With `num_heads=1` and no output projection this is exactly
    `softmax(Q K^T / sqrt(d_k)) V`.

    Unlike `keras.layers.MultiHeadAttention` it takes a single input, so it
    fits in a `keras.Sequential` model, and it honours Keras masks: padded
    keys get exactly zero weight, padded query positions output exactly zero,
    and a query whose keys are all masked outputs zeros (never NaN). Softmax
    always runs in float32, so `mixed_float16` cannot overflow.

    Args:
        num_heads: Number of attention heads. Defaults to 1.
        key_dim: Size of each head for query and key. Defaults to
            `features // num_heads`, which must divide exactly.
        value_dim: Size of each head for value. Defaults to `key_dim`.
        output_dim: If None (default), the output is the concatenated heads
            (width `num_heads * value_dim`); an int adds a learned output
            projection to that width.
        use_bias: Whether the projections have biases. Defaults to False.
        scale: Multiplier of the raw scores `Q K^T`. None (default) means
            `1 / sqrt(key_dim)`; 1.0 gives unscaled attention.
        causal: If True, a position attends only to itself and earlier ones.
        sliding_window: If set, a position attends only to positions within
            `sliding_window - 1` of itself (combines with `causal`).
        chunk_size: If None (default), the full `(batch, heads, time, time)`
            attention weights are built at once. An int computes the same
            attention exactly, `chunk_size` queries at a time, each block
            taking its softmax over all the keys it may see: peak memory is
            `O(batch * heads * chunk_size * time)` instead of `O(time^2)`,
            and with `causal` or `sliding_window` the key blocks those masks
            rule out are skipped (with `sliding_window=w` the work is
            `O(time * (chunk_size + 2 * w))`). Training memory is linear in
            time too (the backward pass recomputes each block), except with
            `dropout`, whose blocks keep their weights for the backward pass.
            It cannot return the weights: `return_attention_scores=True`
            raises a ValueError.
        dropout: Dropout rate on the attention weights, in training only.
        seed: Seed of the dropout.
        kernel_initializer, bias_initializer: Initializers of the kernels and
            biases.
        kernel_regularizer, bias_regularizer, activity_regularizer:
            Regularizers.
        kernel_constraint, bias_constraint: Constraints.
        **kwargs: Base layer arguments (`name`, `dtype`, ...).

    Call arguments:
        inputs: Float tensor of shape `(batch, time, features)`.
        mask: Optional bool tensor `(batch, time)`, True for real tokens.
            Passed automatically by `Embedding(mask_zero=True)` or `Masking`.
        attention_mask: Optional bool tensor `(batch, time, time)`; True
            where a query position may attend a key position.
        training: Whether dropout is active.
        return_attention_scores: If True, also return the attention weights.

    Returns:
        The output `(batch, time, output_dim or num_heads * value_dim)`, and
        with `return_attention_scores=True` a tuple `(output, weights)`,
        weights of shape `(batch, num_heads, time, time)`.

    Example:

    >>> import numpy as np, keras
    >>> from keras_selfattn import SelfAttention
    >>> model = keras.Sequential([
    ...     keras.Input((None, 8)),
    ...     SelfAttention(num_heads=2),
    ...     keras.layers.GlobalAveragePooling1D(),
    ...     keras.layers.Dense(1),
    ... ])
    >>> model(np.ones((2, 5, 8), "float32")).shape
    TensorShape([2, 1])
    """

    def __init__(
        self,
        num_heads: int = 1,
        key_dim: int | None = None,
        value_dim: int | None = None,
        output_dim: int | None = None,
        use_bias: bool = False,
        scale: float | None = None,
        causal: bool = False,
        sliding_window: int | None = None,
        chunk_size: int | None = None,
        dropout: float = 0.0,
        seed: int | None = None,
        kernel_initializer="glorot_uniform",
        bias_initializer="zeros",
        kernel_regularizer=None,
        bias_regularizer=None,
        activity_regularizer=None,
        kernel_constraint=None,
        bias_constraint=None,
        **kwargs,
    ):
        if kwargs.get("dtype") is not None:
            kwargs["dtype"] = _checks.dtype_policy(kwargs["dtype"])
        super().__init__(activity_regularizer=activity_regularizer, **kwargs)
        _checks.float_policy(self.dtype_policy)
        _checks.finite_config("activity_regularizer", self.activity_regularizer)
        self.num_heads = _checks.positive_int("num_heads", num_heads)
        self.key_dim = _checks.positive_int("key_dim", key_dim, allow_none=True)
        self.value_dim = _checks.positive_int("value_dim", value_dim, allow_none=True)
        self.output_dim = _checks.positive_int(
            "output_dim", output_dim, allow_none=True
        )
        self.use_bias = _checks.boolean("use_bias", use_bias)
        self.scale = _checks.positive_float("scale", scale, allow_none=True)
        self.causal = _checks.boolean("causal", causal)
        self.sliding_window = _checks.positive_int(
            "sliding_window", sliding_window, allow_none=True
        )
        self.chunk_size = _checks.positive_int(
            "chunk_size", chunk_size, allow_none=True
        )
        # Causal blocks without a window read key ranges of growing length,
        # which XLA cannot compile: Keras then runs `fit` without jit_compile.
        self.supports_jit = not (
            self.chunk_size is not None and self.causal and self.sliding_window is None
        )
        self.dropout = _checks.rate("dropout", dropout)
        self.seed = _checks.optional_int("seed", seed)
        for name, value, module in (
            ("kernel_initializer", kernel_initializer, initializers),
            ("bias_initializer", bias_initializer, initializers),
            ("kernel_regularizer", kernel_regularizer, regularizers),
            ("bias_regularizer", bias_regularizer, regularizers),
            ("kernel_constraint", kernel_constraint, constraints),
            ("bias_constraint", bias_constraint, constraints),
        ):
            setattr(self, name, _checks.finite_config(name, module.get(value)))
        self.supports_masking = True
        self._dropout_layer = (
            keras.layers.Dropout(self.dropout, seed=self.seed, dtype=self.dtype_policy)
            if self.dropout
            else None
        )
        self._input_dim = None

    # ------------------------------------------------------------------ build
    def _resolve_dims(self, input_dim: int) -> tuple[int, int]:
        key_dim = self.key_dim
        if key_dim is None:
            if input_dim % self.num_heads:
                raise ValueError(
                    "`key_dim` is None, so it defaults to features // num_heads, "
                    f"but features={input_dim} is not divisible by "
                    f"num_heads={self.num_heads}. Pass key_dim explicitly. "
                    f"Received: key_dim=None, num_heads={self.num_heads}"
                )
            key_dim = input_dim // self.num_heads
        value_dim = self.value_dim if self.value_dim is not None else key_dim
        return key_dim, value_dim

    def _check_input_shape(self, input_shape) -> int:
        input_shape = tuple(input_shape)
        if len(input_shape) != 3:
            raise ValueError(
                f"SelfAttention '{self.name}' expects `inputs` of rank 3 "
                f"(batch, time, features). Received: inputs.shape={input_shape}"
            )
        if input_shape[-1] is None:
            raise ValueError(
                f"SelfAttention '{self.name}' needs a known last dimension "
                f"(features). Received: inputs.shape={input_shape}"
            )
        if self._input_dim is not None and input_shape[-1] != self._input_dim:
            raise ValueError(
                f"SelfAttention '{self.name}' was built for features="
                f"{self._input_dim}. Received: inputs.shape={input_shape}"
            )
        return int(input_shape[-1])

    def build(self, input_shape):
        input_dim = self._check_input_shape(input_shape)
        self._key_dim, self._value_dim = self._resolve_dims(input_dim)
        heads = self.num_heads
        self._add_projection("query", (input_dim, heads * self._key_dim))
        self._add_projection("key", (input_dim, heads * self._key_dim))
        self._add_projection("value", (input_dim, heads * self._value_dim))
        if self.output_dim is not None:
            self._add_projection("output", (heads * self._value_dim, self.output_dim))
        self._scale = (
            self.scale if self.scale is not None else 1.0 / math.sqrt(self._key_dim)
        )
        self._input_dim = input_dim

    def _add_projection(self, prefix: str, kernel_shape: tuple[int, int]) -> None:
        size = math.prod(kernel_shape)
        if size > _checks.MAX_SIZE:
            raise ValueError(
                f"SelfAttention '{self.name}': {prefix}_kernel would have shape "
                f"{kernel_shape}, {size} elements (at most 2**31 - 1). Received: "
                f"num_heads={self.num_heads}, key_dim={self.key_dim}, "
                f"value_dim={self.value_dim}, output_dim={self.output_dim}"
            )
        kernel = self._new_weight(f"{prefix}_kernel", kernel_shape, "kernel")
        setattr(self, f"{prefix}_kernel", kernel)
        bias = None
        if self.use_bias:
            bias = self._new_weight(f"{prefix}_bias", (kernel_shape[1],), "bias")
        setattr(self, f"{prefix}_bias", bias)

    def _new_weight(self, name: str, shape: tuple[int, ...], kind: str):
        """A weight from the `kind` ("kernel" or "bias") arguments."""
        initializer = getattr(self, f"{kind}_initializer")
        try:
            return self.add_weight(
                name=name,
                shape=shape,
                initializer=_fresh_initializer(initializer, len(self.weights)),
                regularizer=getattr(self, f"{kind}_regularizer"),
                constraint=getattr(self, f"{kind}_constraint"),
            )
        except Exception as error:
            config = initializers.serialize(initializer)
            raise ValueError(
                f"SelfAttention '{self.name}': `{kind}_initializer` cannot create "
                f"{name} of shape {shape}: {error} "
                f"Received: {kind}_initializer={config}"
            ) from error

    # ------------------------------------------------------------------- call
    def _project(self, x, prefix: str):
        y = ops.matmul(x, getattr(self, f"{prefix}_kernel"))
        bias = getattr(self, f"{prefix}_bias")
        return y if bias is None else ops.add(y, bias)

    def _check_masks(self, inputs_shape, mask, attention_mask) -> None:
        batch, time = tuple(inputs_shape)[:2]
        for name, value, rank in (
            ("mask", mask, 2),
            ("attention_mask", attention_mask, 3),
        ):
            if value is None:
                continue
            shape = tuple(value.shape)
            expected = (batch,) + (time,) * (rank - 1)
            compatible = len(shape) == rank and all(
                a is None or b is None or a == b
                for a, b in zip(shape, expected, strict=False)
            )
            if not compatible:
                wanted = "(batch, time)" if rank == 2 else "(batch, time, time)"
                raise ValueError(
                    f"SelfAttention '{self.name}': `{name}` must have shape "
                    f"{wanted} = {expected} to match inputs.shape="
                    f"{tuple(inputs_shape)}. Received: {name}.shape={shape}"
                )

    def _check_scores_request(self, return_attention_scores: bool) -> None:
        if return_attention_scores and self.chunk_size is not None:
            raise ValueError(
                f"SelfAttention '{self.name}' has chunk_size={self.chunk_size}, "
                "so it never builds the (batch, heads, time, time) attention "
                "weights and cannot return them. Use a layer with "
                "chunk_size=None (same weights, same outputs) to inspect them. "
                "Received: return_attention_scores=True"
            )

    def call(
        self,
        inputs,
        mask=None,
        attention_mask=None,
        training=None,
        return_attention_scores: bool = False,
    ):
        self._check_input_shape(inputs.shape)
        self._check_masks(inputs.shape, mask, attention_mask)
        self._check_scores_request(return_attention_scores)
        heads = self.num_heads
        query = aops.split_heads(self._project(inputs, "query"), heads)
        key = aops.split_heads(self._project(inputs, "key"), heads)
        value = aops.split_heads(self._project(inputs, "value"), heads)
        dropout = None
        if self._dropout_layer is not None:

            def dropout(w):
                return self._dropout_layer(w, training=training)

        if self.chunk_size is None:
            combined = aops.combine_masks(
                ops.shape(inputs)[1],
                padding_mask=mask,
                attention_mask=attention_mask,
                causal=self.causal,
                sliding_window=self.sliding_window,
            )
            with keras.name_scope(FUSABLE_CORE_SCOPE):
                # Without an attention_mask every real query may attend
                # itself, and padded queries are zeroed below.
                heads_out, weights = aops.scaled_dot_product_attention(
                    query,
                    key,
                    value,
                    self._scale,
                    combined,
                    dropout,
                    zero_empty_rows=attention_mask is not None,
                )
        else:
            heads_out = chunked_attention(
                query,
                key,
                value,
                self._scale,
                self.chunk_size,
                padding_mask=mask,
                attention_mask=attention_mask,
                causal=self.causal,
                sliding_window=self.sliding_window,
                dropout=dropout,
            )
        output = aops.merge_heads(heads_out, heads, self._value_dim)
        if self.output_dim is not None:
            output = self._project(output, "output")
        if mask is not None:
            query_mask = ops.cast(mask, output.dtype)
            output = ops.multiply(output, ops.expand_dims(query_mask, -1))
            if return_attention_scores:
                weights = ops.multiply(
                    weights, ops.cast(ops.expand_dims(mask, (1, 3)), weights.dtype)
                )
        if return_attention_scores:
            return output, weights
        return output

    def compute_mask(self, inputs, mask=None):
        return mask

    def _output_width(self) -> int:
        if self.output_dim is not None:
            return self.output_dim
        return self.num_heads * self._value_dim

    def compute_output_shape(self, input_shape):
        self._check_input_shape(input_shape)
        if self._input_dim is None:
            _, value_dim = self._resolve_dims(int(input_shape[-1]))
            width = self.output_dim or self.num_heads * value_dim
        else:
            width = self._output_width()
        return tuple(input_shape[:-1]) + (width,)

    def compute_output_spec(
        self,
        inputs,
        mask=None,
        attention_mask=None,
        training=None,
        return_attention_scores: bool = False,
    ):
        self._check_masks(inputs.shape, mask, attention_mask)
        self._check_scores_request(return_attention_scores)
        output = keras.KerasTensor(
            self.compute_output_shape(inputs.shape), dtype=self.compute_dtype
        )
        if not return_attention_scores:
            return output
        batch, time = inputs.shape[0], inputs.shape[1]
        weights = keras.KerasTensor(
            (batch, self.num_heads, time, time), dtype=self.compute_dtype
        )
        return output, weights

    # ----------------------------------------------------------------- config
    def get_config(self) -> dict:
        config = super().get_config()
        config.update(
            {
                "num_heads": self.num_heads,
                "key_dim": self.key_dim,
                "value_dim": self.value_dim,
                "output_dim": self.output_dim,
                "use_bias": self.use_bias,
                "scale": self.scale,
                "causal": self.causal,
                "sliding_window": self.sliding_window,
                "chunk_size": self.chunk_size,
                "dropout": self.dropout,
                "seed": self.seed,
                "kernel_initializer": initializers.serialize(self.kernel_initializer),
                "bias_initializer": initializers.serialize(self.bias_initializer),
                "kernel_regularizer": regularizers.serialize(self.kernel_regularizer),
                "bias_regularizer": regularizers.serialize(self.bias_regularizer),
                "activity_regularizer": regularizers.serialize(
                    self.activity_regularizer
                ),
                "kernel_constraint": constraints.serialize(self.kernel_constraint),
                "bias_constraint": constraints.serialize(self.bias_constraint),
            }
        )
        return config

    @classmethod
    def from_config(cls, config: dict) -> SelfAttention:
        # Keras's own from_config fails with an AttributeError on a `dtype`
        # config of an unknown class; check it first (ValueError).
        if isinstance(config, dict) and isinstance(config.get("dtype"), dict):
            config = {**config, "dtype": _checks.dtype_policy(config["dtype"])}
        return super().from_config(config)
