"""The `SelfAttention` layer."""

from __future__ import annotations

import dataclasses

import keras
from keras import ops

from keras_selfattn import (
    _call_plan,
    _checks,
    _config,
    _inputs,
    _outputs,
    _projection_ops,
    _qk_norm,
    _score_weights,
    decoding,
)
from keras_selfattn import projections as projections_lib
from keras_selfattn._keras_private import get_keras_mask
from keras_selfattn.attention import (
    SeededDropout,
    rope_frequencies,
    rotary,
)
from keras_selfattn.attention import cache as cache_lib
from keras_selfattn.attention import heads as heads_lib

__all__ = ["SelfAttention"]


@keras.saving.register_keras_serializable(package="keras_selfattn")
class SelfAttention(
    _projection_ops.ProjectionMethods, _call_plan.CallPlan, keras.layers.Layer
):
    """Multi-head scaled dot-product self-attention over a sequence.

    Head h computes `softmax(Q_h K_h^T * scale) V_h` from projections of the
    input; the heads are concatenated, then optionally projected. A single
    input (it fits in `keras.Sequential`), Keras masks honoured (a query with
    nothing to attend outputs exactly zero). docs/layer.md details every
    argument, the implementations and the projections.

    Args:
        num_heads: Number of attention heads. Defaults to 1.
        key_dim: Size of each head for query and key. Defaults to
            `features // num_heads`, which must divide exactly.
        value_dim: Size of each head for value. Defaults to `key_dim`.
        output_dim: If set, a learned output projection to this width.
        use_bias: Whether the projections have biases. Defaults to False.
        scale: Multiplier of `Q K^T`. None (default): `1 / sqrt(key_dim)`.
        causal: If True, a position attends only to itself and earlier ones.
        sliding_window: If set, a position attends only to positions within
            `sliding_window - 1` of itself (combines with `causal`).
        chunk_size: If set, attention is computed exactly, `chunk_size`
            queries at a time (memory linear in time); no returned weights.
        dropout: Dropout rate on the attention weights, in training only.
        seed: Seed of the dropout.
        flash_attention: As in `keras.layers.MultiHeadAttention`: None
            (default) uses the fused kernel when a call allows it, True
            requires it (ValueError saying why not), False never uses it.
        num_key_value_heads: Key and value heads (grouped-query attention),
            dividing `num_heads`. None (default) means `num_heads`.
        use_gate: If True, the concatenated heads are multiplied by
            `sigmoid(X Wg (+ bg))` before the output projection.
        rope_max_wavelength: If set (> 0), rotary position embedding of the
            queries and keys (keras-hub's rotation); `key_dim` must be even.
        rope_scaling_factor: Positions are divided by it before the
            rotation. Defaults to 1.0.
        rope_partial_fraction: Only the first `int(key_dim * fraction)`
            features of each query and key head rotate (GPT-NeoX's
            `rotary_percentage`); the rest pass. Defaults to 1.0.
        rope_frequency_scaling: None, or Llama 3.1's per-frequency
            adjustment: `{"rope_type": "llama3", "factor",
            "low_freq_factor", "high_freq_factor",
            "original_max_position_embeddings"}`, or YaRN's frequencies:
            `{"rope_type": "yarn", "factor",
            "original_max_position_embeddings"}` and optional "beta_fast",
            "beta_slow", "truncate"; its temperature `t` is `scale`
            (`t ** 2 / sqrt(key_dim)`); or LongRoPE's tables (Phi-3's
            "su"): `{"rope_type": "longrope", "short_factor",
            "long_factor", "original_max_position_embeddings"}`, the long
            one in a call ending past the last (docs/layer.md).
        position_bias: None, "alibi" (head h adds `-slope_h * |i - j|` to
            the scores, keras-hub's `AlibiBias` slopes) or "relative" (T5's
            learned bias of the bucket of `j - i`, weight
            `relative_attention_bias` of shape `(buckets, num_heads)`).
        alibi_bias_max: ALiBi's slopes are a geometric sequence from
            `2 ** (-alibi_bias_max / num_heads)`. Defaults to 8.
        alibi_before_scale: Whether the ALiBi bias is added to the scores
            before they are scaled (Falcon's): each slope is multiplied by
            the scale. Defaults to False (added after, Bloom's and
            keras-hub's `AlibiBias`).
        relative_attention_num_buckets: T5's buckets. Defaults to 32.
        relative_attention_max_distance: T5's longest bucketed distance.
            Defaults to 128.
        use_sinks: If True, a learned logit per head (weight `sinks`) joins
            each softmax's denominator and adds no value (gpt-oss).
        logit_soft_cap: If set (> 0), scores become `cap * tanh(scores /
            cap)` (Gemma 2), before the biases.
        use_query_key_norm: If True, each query and key head is RMS
            normalized before the rotary embedding, `x / sqrt(mean(x ** 2) +
            query_key_norm_epsilon) * scale`, in float32, with learned
            `query_norm_scale` and `key_norm_scale` of shape `(key_dim,)`
            (Qwen 3, Gemma 3).
        query_key_norm_epsilon: The norms' epsilon (> 0). Defaults to 1e-6.
        quantized_projections: Written by `get_config` for quantized
            projections, so that loading rebuilds them quantized.
        kernel_initializer, bias_initializer: Initializers.
        kernel_regularizer, bias_regularizer, activity_regularizer: Regularizers.
        kernel_constraint, bias_constraint: Constraints.
        **kwargs: Base layer arguments (`name`, `dtype`, ...).

    Call arguments:
        inputs: Float tensor of shape `(batch, time, features)`.
        mask: Optional bool `(batch, time)`, True for real tokens.
        attention_mask: Optional bool `(batch, time, time)`, query by key.
        training: Whether dropout is active.
        return_attention_scores: If True, also return the attention weights.
        cache: Optional key/value cache (`empty_cache`); causal layers only.
        cache_update_index: The position of the first new token in `cache`.
        attention_bias: Optional float, broadcastable to `(batch,
            num_heads, time, time)`: added to the scores after the position
            bias, before the masks (a bias never unmasks a key).
        segment_ids: Optional int `(batch, time)`: packed sequences; a
            position attends only positions of its own id.

    Returns:
        The output `(batch, time, output_dim or num_heads * value_dim)`; with
        `return_attention_scores=True` a tuple `(output, weights)`, weights
        `(batch, num_heads, time, time)`; with a `cache`, `(output, cache)`.

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
        flash_attention: bool | None = None,
        num_key_value_heads: int | None = None,
        use_gate: bool = False,
        rope_max_wavelength: float | None = None,
        rope_scaling_factor: float = 1.0,
        rope_partial_fraction: float = 1.0,
        rope_frequency_scaling: dict | None = None,
        position_bias: str | None = None,
        alibi_bias_max: float = 8.0,
        alibi_before_scale: bool = False,
        relative_attention_num_buckets: int = 32,
        relative_attention_max_distance: int = 128,
        use_sinks: bool = False,
        logit_soft_cap: float | None = None,
        use_query_key_norm: bool = False,
        query_key_norm_epsilon: float = 1e-6,
        quantized_projections: dict | None = None,
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
        arguments = _config.arguments(
            num_heads=num_heads,
            key_dim=key_dim,
            value_dim=value_dim,
            output_dim=output_dim,
            use_bias=use_bias,
            scale=scale,
            causal=causal,
            sliding_window=sliding_window,
            chunk_size=chunk_size,
            dropout=dropout,
            seed=seed,
            flash_attention=flash_attention,
            num_key_value_heads=num_key_value_heads,
            use_gate=use_gate,
            rope_max_wavelength=rope_max_wavelength,
            rope_scaling_factor=rope_scaling_factor,
            rope_partial_fraction=rope_partial_fraction,
            rope_frequency_scaling=rope_frequency_scaling,
            position_bias=position_bias,
            alibi_bias_max=alibi_bias_max,
            alibi_before_scale=alibi_before_scale,
            relative_attention_num_buckets=relative_attention_num_buckets,
            relative_attention_max_distance=relative_attention_max_distance,
            use_sinks=use_sinks,
            logit_soft_cap=logit_soft_cap,
            use_query_key_norm=use_query_key_norm,
            query_key_norm_epsilon=query_key_norm_epsilon,
            quantized_projections=quantized_projections,
            kernel_initializer=kernel_initializer,
            bias_initializer=bias_initializer,
            kernel_regularizer=kernel_regularizer,
            bias_regularizer=bias_regularizer,
            kernel_constraint=kernel_constraint,
            bias_constraint=bias_constraint,
        )
        for name, value in arguments.items():
            setattr(self, name, value)
        self._kv_heads = self.num_key_value_heads or self.num_heads
        self.supports_jit = _config.supports_jit(self)
        self.supports_masking = True
        self.seed_generator = (
            keras.random.SeedGenerator(self.seed) if self.dropout else None
        )
        self._dims = None  # _config.Dims, set by build
        self.relative_attention_bias = self.sinks = None  # set by build if used
        self.query_norm_scale = self.key_norm_scale = None  # likewise
        for name in projections_lib.NAMES:
            setattr(self, f"{name}_dense", None)

    def build(self, input_shape):
        input_dim = _inputs.check_shape(self.name, input_shape, None)
        dims = _config.dims(self, input_dim)
        _projection_ops.add_all(self, dims)
        _score_weights.add(self)
        _qk_norm.add(self, dims.key_dim)
        self._dims = dims

    def __call__(self, *args, **kwargs):
        # Kept because Keras needs the checks before its own steps: `inputs`
        # before Keras builds the layer from its shape (a list or an int
        # tensor would fail there with a less clear error), and the cache's
        # dtype before Keras casts float arguments to the compute dtype.
        input_dim = None if self._dims is None else self._dims.input_dim
        arguments = decoding.call_arguments(self, args, kwargs)
        _inputs.check(self.name, arguments.get("inputs"), input_dim)
        cache = arguments.get("cache")
        if cache is None and decoding.active() is not None:
            # A decoding run: the cache is the scope's (keras_selfattn.decoding).
            return decoding.attend(self, self.__call__, args, kwargs)
        if cache is not None:
            cache_lib.check_dtype(cache, self.compute_dtype, self.name)
        elif len(args) < 2 and kwargs.get("mask") is None:
            # Keras fills `mask` from the input's Keras mask only when the
            # call has one tensor argument: with an `attention_mask`,
            # `attention_bias` or `segment_ids` the padding would be lost.
            mask = get_keras_mask(arguments.get("inputs"))
            if mask is not None:
                kwargs["mask"] = mask
        return super().__call__(*args, **kwargs)

    @property
    def effective_scale(self) -> float:
        """The multiplier of the raw scores: `scale`, or 1 / sqrt(key_dim)."""
        if not self.built:
            raise ValueError(
                f"SelfAttention '{self.name}' is not built, so its key_dim (and "
                "default scale) is not known yet. Call it on an input first."
            )
        return self._dims.scale

    def call(
        self,
        inputs,
        mask=None,
        attention_mask=None,
        training=None,
        return_attention_scores: bool = False,
        cache=None,
        cache_update_index=None,
        attention_bias=None,
        segment_ids=None,
    ):
        given_object = isinstance(cache, cache_lib.Cache)
        if cache is not None:
            cache = cache_lib.wrapped(cache)
        offset = self._decoding(
            inputs,
            mask,
            attention_mask,
            return_attention_scores,
            cache,
            cache_update_index,
            attention_bias,
            segment_ids,
        )
        cached, guard = cache is not None, None
        plain = _projection_ops.plain(self, inputs)
        if cached:
            guard = cache.guard(inputs, offset, self.name)
            inputs, cache = guard.inputs, cache.replaced(guard.cache)
        elif mask is not None:
            # Padded positions are keys no query attends: zeroed, their
            # values (NaN, inf) change no output.
            keep_input = ops.expand_dims(ops.cast(mask, "bool"), -1)
            inputs = _outputs.zero_unless(keep_input, inputs, plain)
        masks = self._masks(mask, attention_mask, offset, segment_ids)
        mods = _score_weights.for_call(self, attention_bias)
        implementation = self._choose(
            inputs,
            masks,
            training,
            return_attention_scores,
            mods.names if mods else (),
            time_major_cache=cached and cache.time_major,
        )
        layout = implementation.layout
        # The cache holds keys and values time-first.
        kv_layout = heads_lib.TIME_FIRST if cached else layout
        query = _projection_ops.heads(
            self, inputs, "query", self.num_heads, layout, plain
        )
        key, value = (
            _projection_ops.heads(self, inputs, name, self._kv_heads, kv_layout, plain)
            for name in ("key", "value")
        )
        query = _qk_norm.normalize(self, query, "query")
        key = _qk_norm.normalize(self, key, "key")
        if self.rope_max_wavelength is not None:
            turned = rope_frequencies.rotary_dim(
                self._dims.key_dim, self.rope_partial_fraction
            )
            scope = decoding.active()
            table = rotary.table(
                ops.shape(inputs)[1],
                self._dims.key_dim,
                self.rope_max_wavelength,
                self.rope_scaling_factor,
                0 if offset is None else offset,
                turned,
                self.rope_frequency_scaling,
                # A generation's rows, each at its own positions (longrope).
                scope.positions
                if scope is not None and rotary.per_row(self.rope_frequency_scaling)
                else None,
            )
            query = rotary.rotate(query, layout, table, turned)
            key = rotary.rotate(key, kv_layout, table, turned)
        if cached:
            length = cache.attended_length(key, offset)
            masks = dataclasses.replace(masks, key_length=length)
            cache, key, value = cache.update(key, value, offset, guard.valid, mask)
            if layout != kv_layout:
                key, value = (heads_lib.transpose(x) for x in (key, value))
        if not implementation.grouped_key_value:
            repeats = self.num_heads // self._kv_heads
            key, value = (heads_lib.repeat(x, repeats, layout) for x in (key, value))
        dropout = None
        if self.seed_generator is not None and training:
            dropout = SeededDropout(self.dropout, self.seed_generator.next())
        heads_out, weights = implementation.fn(
            query,
            key,
            value,
            masks,
            scale=self._dims.scale,
            dropout=dropout,
            return_weights=return_attention_scores,
            mods=mods,
        )
        output = _projection_ops.merge(heads_out, layout, plain)
        if self.use_gate:
            gate = _projection_ops.project(self, inputs, "gate", plain)
            output = ops.multiply(output, ops.cast(ops.sigmoid(gate), output.dtype))
        if self.output_dim is not None:
            output = _projection_ops.project(self, output, "output", plain)
        if not (cached and cache.checked):
            output, weights = _outputs.zero_unattending(inputs, masks, output, weights)
        if cached:
            return guard.output(output), cache if given_object else cache.tensor
        if return_attention_scores:
            return output, weights
        return output

    def empty_cache(self, batch_size: int, max_length: int):
        """A key/value cache of zeros for `layer(x, cache=..., cache_update_index=...)`.

        Args:
            batch_size: The batch size of the decoded sequences.
            max_length: How many positions the cache holds.

        Returns:
            Zeros of shape `(batch_size, 2, max_length, num_key_value_heads,
            key_dim)` in the layer's compute dtype.
        """
        key_dim = None if self._dims is None else self._dims.key_dim
        return cache_lib.empty(
            self.name,
            batch_size,
            max_length,
            self._kv_heads,
            key_dim,
            self.compute_dtype,
        )

    def compute_mask(self, inputs, mask=None):
        return mask

    def compute_output_shape(self, input_shape):
        input_dim = None if self._dims is None else self._dims.input_dim
        features = _inputs.check_shape(self.name, input_shape, input_dim)
        dims = self._dims or _config.dims(self, features)
        return tuple(input_shape[:-1]) + (dims.output_width,)

    def get_config(self) -> dict:
        config = {**super().get_config(), **_config.serialize(self)}
        quantized = self.quantized_projections or {}
        if self.built:
            quantized = _projection_ops.quantization_states(self)
        if quantized:
            config["quantized_projections"] = quantized
        return config

    @classmethod
    def from_config(cls, config: dict) -> SelfAttention:
        return super().from_config(_checks.config_dtype(config))

    @classmethod
    def from_multi_head_attention(cls, layer, causal: bool = False) -> SelfAttention:
        """A SelfAttention with the configuration and weights of a built
        MultiHeadAttention or GroupQueryAttention (keras_selfattn._from_keras)."""
        from keras_selfattn._from_keras import from_multi_head_attention

        return from_multi_head_attention(cls, layer, causal)
