"""The `SelfAttention` layer."""

from __future__ import annotations

import math

import keras
from keras import constraints, initializers, ops, regularizers

from keras_selfattn import _checks
from keras_selfattn import projections as projections_lib
from keras_selfattn.attention import (
    Masks,
    SeededDropout,
    choose,
    nan_safe,
    rotary,
)
from keras_selfattn.attention import cache as cache_lib
from keras_selfattn.attention import heads as heads_lib
from keras_selfattn.attention import masks as masks_lib
from keras_selfattn.attention.fused import on_gpu

__all__ = ["SelfAttention"]


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
    keys get exactly zero weight, and a query with nothing to attend (a
    padded position, or a row of `attention_mask` that allows no key after
    the other masks) outputs exactly zero, after the output projection and
    its bias too; never NaN, and its gradients are finite. Softmax always
    runs in float32, and float16 scores are formed in float32, so
    `mixed_float16` cannot overflow.

    Each call takes one of three implementations, chosen from the call's
    static facts: the fused path (the backend's attention kernel:
    `jax.nn.dot_product_attention`, cuDNN flash attention on a GPU, or
    PyTorch's `scaled_dot_product_attention`) when nothing needs the weights
    (no returned scores, no dropout in training, no `attention_mask`; and on
    PyTorch no `sliding_window`); else the chunked path with `chunk_size`;
    else the explicit path, which builds the weights. All give the same
    numbers up to float rounding. TensorFlow has no fused kernel.

    The projections are `keras.layers.Dense` layers, `query_dense`,
    `key_dense`, `value_dense` and, when used, `gate_dense` and
    `output_dense`, with kernels `(features, heads * head_dim)` (head `h` is
    columns `h*key_dim:(h+1)*key_dim`): `model.quantize(mode)` quantizes
    them ("int8", "int4", "float8", and "gptq"/"awq" with their
    calibration config), and `enable_lora(rank)` fine-tunes the query and
    value projections only, as keras-hub's `backbone.enable_lora` does.

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
            time too: the backward pass recomputes each block, on every
            backend.
            It cannot return the weights: `return_attention_scores=True`
            raises a ValueError. Where the fused path applies it is taken
            on a GPU (it bounds memory there too), the chunked path on a CPU.
        dropout: Dropout rate on the attention weights, in training only.
        seed: Seed of the dropout.
        flash_attention: As in `keras.layers.MultiHeadAttention`. None
            (default): use the fused kernel whenever the call allows it,
            unless `keras.config.disable_flash_attention()` was called
            (`keras.config.enable_flash_attention()` restores automatic);
            True: require it, and raise a ValueError saying why when a call
            cannot use it (TensorFlow, returned scores, dropout in training,
            `attention_mask`, on JAX a `value_dim` other than `key_dim`);
            False: never use it.
        num_key_value_heads: Number of key and value heads (grouped-query
            attention). None (default) means `num_heads`; it must divide
            `num_heads`. Query head h uses key and value head
            `h // (num_heads // num_key_value_heads)`, as in
            `keras.layers.GroupQueryAttention`; the key and value kernels
            are `(features, num_key_value_heads * key_dim)` and
            `(features, num_key_value_heads * value_dim)`.
        use_gate: If True, the concatenated heads are multiplied by
            `sigmoid(X Wg (+ bg))` (weights `gate_kernel`, `gate_bias`, of
            width `num_heads * value_dim`) before the output projection, as
            in `keras.layers.MultiHeadAttention(use_gate=True)`. Defaults
            to False.
        rope_max_wavelength: If set (a number > 0), rotary position
            embedding is applied to each head of the projected queries and
            keys, the rotation of keras-hub's `RotaryEmbedding` (in halves,
            inverse frequencies `1 / rope_max_wavelength ** (2i / key_dim)`),
            with positions 0 .. time-1; `key_dim` must then be even. None
            (default): no rotary embedding.
        rope_scaling_factor: Positions are divided by this number > 0 before
            the rotation. Defaults to 1.0.
        quantized_projections: Written by `get_config` once projections are
            quantized (`model.quantize(mode)`), so that loading rebuilds them
            quantized: projection name -> its serialized dtype policy and
            quantization config. Defaults to None (float projections).
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

    # The projections' weights under their names from before the projections
    # were layers (`query_kernel` is `query_dense.kernel`).
    query_kernel = projections_lib.weight_property("query", "kernel")
    query_bias = projections_lib.weight_property("query", "bias")
    key_kernel = projections_lib.weight_property("key", "kernel")
    key_bias = projections_lib.weight_property("key", "bias")
    value_kernel = projections_lib.weight_property("value", "kernel")
    value_bias = projections_lib.weight_property("value", "bias")
    gate_kernel = projections_lib.weight_property("gate", "kernel")
    gate_bias = projections_lib.weight_property("gate", "bias")
    output_kernel = projections_lib.weight_property("output", "kernel")
    output_bias = projections_lib.weight_property("output", "bias")

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
        # On TensorFlow, causal blocks without a window read key ranges of
        # growing length, which XLA cannot compile: Keras then runs `fit`
        # without jit_compile.
        self.supports_jit = not (
            keras.backend.backend() == "tensorflow"
            and self.chunk_size is not None
            and self.causal
            and self.sliding_window is None
        )
        self.dropout = _checks.rate("dropout", dropout)
        self.seed = _checks.optional_int("seed", seed)
        if flash_attention is not None:
            _checks.boolean("flash_attention", flash_attention)
        self.flash_attention = flash_attention
        self.num_key_value_heads = _checks.positive_int(
            "num_key_value_heads", num_key_value_heads, allow_none=True
        )
        if (
            self.num_key_value_heads is not None
            and self.num_heads % self.num_key_value_heads
        ):
            raise ValueError(
                "`num_key_value_heads` must divide `num_heads` (each key and "
                "value head serves a group of query heads). Received: "
                f"num_key_value_heads={self.num_key_value_heads}, "
                f"num_heads={self.num_heads}"
            )
        self.use_gate = _checks.boolean("use_gate", use_gate)
        self.rope_max_wavelength = _checks.positive_float(
            "rope_max_wavelength", rope_max_wavelength, allow_none=True
        )
        self.rope_scaling_factor = _checks.positive_float(
            "rope_scaling_factor", rope_scaling_factor
        )
        if self.key_dim is not None:
            self._check_rope_key_dim(self.key_dim)
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
        self.quantized_projections = projections_lib.check_quantization_states(
            quantized_projections
        )
        for name in projections_lib.NAMES:
            setattr(self, f"{name}_dense", None)

    # ------------------------------------------------------------------ build
    def _check_rope_key_dim(self, key_dim: int) -> None:
        if self.rope_max_wavelength is not None and key_dim % 2:
            raise ValueError(
                "Rotary position embedding (rope_max_wavelength="
                f"{self.rope_max_wavelength}) rotates pairs of query and key "
                f"features, so `key_dim` must be even. Received: key_dim={key_dim}"
            )

    @property
    def _kv_heads(self) -> int:
        if self.num_key_value_heads is None:
            return self.num_heads
        return self.num_key_value_heads

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
        self._check_rope_key_dim(key_dim)
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
        heads, kv_heads = self.num_heads, self._kv_heads
        self._add_projection("query", (input_dim, heads * self._key_dim))
        self._add_projection("key", (input_dim, kv_heads * self._key_dim))
        self._add_projection("value", (input_dim, kv_heads * self._value_dim))
        if self.use_gate:
            self._add_projection("gate", (input_dim, heads * self._value_dim))
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
        # Seeds offset by the weights made before, as when they were the
        # layer's own weights: seeded layers keep their initial values.
        offset = len(self.weights)
        projection = projections_lib.Projection(
            kernel_shape[1],
            use_bias=self.use_bias,
            kernel_initializer=projections_lib.fresh_initializer(
                self.kernel_initializer, offset
            ),
            bias_initializer=projections_lib.fresh_initializer(
                self.bias_initializer, offset + 1
            ),
            kernel_regularizer=self.kernel_regularizer,
            bias_regularizer=self.bias_regularizer,
            kernel_constraint=self.kernel_constraint,
            bias_constraint=self.bias_constraint,
            name=f"{prefix}_dense",
            **{
                "dtype": self.dtype_policy,
                **projections_lib.quantization_kwargs(
                    (self.quantized_projections or {}).get(prefix)
                ),
            },
        )
        try:
            projection.build((None, None, kernel_shape[0]))
        except Exception as error:
            kind = "kernel" if getattr(projection, "_kernel", None) is None else "bias"
            shape = kernel_shape if kind == "kernel" else kernel_shape[1:]
            config = initializers.serialize(getattr(self, f"{kind}_initializer"))
            raise ValueError(
                f"SelfAttention '{self.name}': `{kind}_initializer` cannot create "
                f"{prefix}_dense/{kind} of shape {shape}: {error} "
                f"Received: {kind}_initializer={config}"
            ) from error
        setattr(self, f"{prefix}_dense", projection)

    def _projections(self) -> dict[str, projections_lib.Projection]:
        """The built projections by name, in weight order."""
        found = {
            name: getattr(self, f"{name}_dense", None) for name in projections_lib.NAMES
        }
        return {name: layer for name, layer in found.items() if layer is not None}

    def load_own_variables(self, store) -> None:
        """Loads a file saved before the projections were layers, whose
        weights were this layer's own (`get_weights()` order); files of this
        version keep them in the projections' entries."""
        if not len(store.keys()):
            return super().load_own_variables(store)
        projections = list(self._projections().values())
        targets = [weight for layer in projections for weight in layer.weights]
        if len(store.keys()) != len(targets):
            raise ValueError(
                f"SelfAttention '{self.name}' has {len(targets)} weights, but the "
                f"file holds {len(store.keys())} for it. Received: a store with "
                f"keys {sorted(store.keys())}"
            )
        for index, weight in enumerate(targets):
            weight.assign(store[str(index)])
        for layer in projections:
            layer.filled_by_owner = True

    def quantize(self, mode=None, type_check=True, config=None) -> None:
        """Quantizes the projections, as `keras.layers.Dense.quantize` does.

        `model.quantize(mode)` reaches the projections by itself; this is for
        a layer used on its own. "gptq" and "awq" calibrate on data through
        the model: use `model.quantize(mode, config=...)`.

        Args:
            mode: "int8", "int4" or "float8".
            type_check: As in `keras.layers.Dense.quantize`.
            config: Optional `keras.quantizers.QuantizationConfig`.
        """
        if mode in ("gptq", "awq"):
            raise ValueError(
                f"SelfAttention '{self.name}': mode={mode!r} calibrates on data, "
                "which a single layer does not have: call "
                f"`model.quantize({mode!r}, config=...)` on the model holding it. "
                f"Received: mode={mode!r}"
            )
        for layer in self._projections().values():
            layer.quantize(mode, type_check=type_check, config=config)

    def enable_lora(
        self,
        rank: int,
        lora_alpha: float | None = None,
        projections: tuple[str, ...] = ("query", "value"),
    ) -> None:
        """Enables LoRA on some projections and freezes every other weight.

        The chosen projections' kernels become `kernel + (lora_alpha / rank) *
        lora_kernel_a @ lora_kernel_b`, with `lora_kernel_b` starting at zero
        (`keras.layers.Dense.enable_lora`); only the LoRA weights stay
        trainable. Saving writes the merged kernels (a loaded layer has no
        LoRA weights).

        Args:
            rank: The rank of the LoRA update (an int > 0).
            lora_alpha: Scale numerator; defaults to `rank`.
            projections: Names among "query", "key", "value", "gate" and
                "output". Defaults to ("query", "value"), keras-hub's choice.
        """
        rank = _checks.positive_int("rank", rank)
        if not self.built:
            raise ValueError(
                f"SelfAttention '{self.name}' is not built: build it (or call it "
                f"once) before enable_lora(). Received: rank={rank}"
            )
        available = self._projections()
        if (
            isinstance(projections, str)
            or not projections
            or any(name not in available for name in projections)
        ):
            raise ValueError(
                f"SelfAttention '{self.name}': `projections` must name some of "
                f"its projections {tuple(available)}. Received: "
                f"projections={projections!r}"
            )
        for name, layer in available.items():
            if name not in projections:
                layer.trainable = False
                continue
            layer.enable_lora(rank, lora_alpha=lora_alpha)
            if layer.bias is not None:
                layer.bias.trainable = False

    # ------------------------------------------------------------------- call
    def _project(self, x, prefix: str):
        return getattr(self, f"{prefix}_dense")(x)

    def _check_inputs(self, inputs) -> None:
        """The ValueErrors of a bad `inputs`, the same built or not, symbolic
        or eager."""
        if isinstance(inputs, (list, tuple, dict)) or not hasattr(inputs, "shape"):
            received = (
                f"a {type(inputs).__name__} of {len(inputs)} items"
                if isinstance(inputs, (list, tuple, dict))
                else repr(inputs)
            )
            raise ValueError(
                f"SelfAttention '{self.name}' expects `inputs` to be one float "
                f"tensor of rank 3 (batch, time, features). Received: "
                f"inputs={received}"
            )
        self._check_input_shape(inputs.shape)
        dtype = keras.backend.standardize_dtype(inputs.dtype)
        if not keras.backend.is_float_dtype(dtype):
            raise ValueError(
                f"SelfAttention '{self.name}' expects float `inputs` (embed "
                f"token ids first, e.g. with keras.layers.Embedding). Received: "
                f"inputs.dtype={dtype}"
            )

    def __call__(self, *args, **kwargs):
        self._check_inputs(args[0] if args else kwargs.get("inputs"))
        cache = kwargs.get("cache", args[5] if len(args) > 5 else None)
        if cache is not None:
            # Before Keras casts float arguments to the compute dtype.
            cache_lib.check_dtype(cache, self.compute_dtype, self.name)
        return super().__call__(*args, **kwargs)

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
            # Only known sizes are compared: a dynamic size may be None or a
            # symbol of its own (jax2tf gives the mask's time axis one).
            compatible = len(shape) == rank and all(
                not (isinstance(a, int) and isinstance(b, int)) or a == b
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

    @property
    def effective_scale(self) -> float:
        """The multiplier of the raw scores: `scale`, or 1 / sqrt(key_dim)."""
        if not self.built:
            raise ValueError(
                f"SelfAttention '{self.name}' is not built, so its key_dim (and "
                "default scale) is not known yet. Call it on an input first."
            )
        return self._scale

    def _masks(self, mask, attention_mask, query_offset=None) -> Masks:
        return Masks(
            key_padding=mask,
            attention=attention_mask,
            causal=self.causal,
            sliding_window=self.sliding_window,
            query_offset=query_offset,
        )

    def implementation(
        self,
        inputs,
        mask=None,
        attention_mask=None,
        training=None,
        return_attention_scores: bool = False,
    ) -> str:
        """The name of the implementation a call with these arguments takes:
        "fused", "chunked" or "explicit" (see the class docstring).

        Raises the ValueError the call would raise if `flash_attention=True`
        and the call cannot use the fused kernel.
        """
        return self._choose(
            ops.convert_to_tensor(inputs),
            self._masks(mask, attention_mask),
            training,
            return_attention_scores,
        ).name

    def _choose(self, inputs, masks: Masks, training, return_attention_scores: bool):
        return choose(
            masks,
            query_on_gpu=on_gpu(inputs),
            same_head_dims=len(set(self._resolve_dims(int(inputs.shape[-1])))) == 1,
            dtype=self.compute_dtype,
            flash_attention=self.flash_attention,
            chunk_size=self.chunk_size,
            dropout=self._dropout_layer is not None and bool(training),
            return_weights=return_attention_scores,
            layer_name=self.name,
        )

    def call(
        self,
        inputs,
        mask=None,
        attention_mask=None,
        training=None,
        return_attention_scores: bool = False,
        cache=None,
        cache_update_index=None,
    ):
        decoding = self._check_call(
            inputs,
            mask,
            attention_mask,
            return_attention_scores,
            cache,
            cache_update_index,
        )
        offset = guard = None
        if decoding:
            offset = cache_lib.index_of(cache_update_index, self.name)
            guard = cache_lib.Guard.of(inputs, cache, offset, self.name)
            inputs, cache = guard.inputs, guard.cache
        elif mask is not None:
            # Padded positions are keys no query attends: zeroed, their
            # values (NaN, inf) change no output.
            keep_input = ops.expand_dims(ops.cast(mask, "bool"), -1)
            inputs = nan_safe.zero_unless(keep_input, inputs)
        masks = self._masks(mask, attention_mask, offset)
        implementation = self._choose(inputs, masks, training, return_attention_scores)
        layout = implementation.layout
        # The cache holds keys and values time-first.
        kv_layout = heads_lib.TIME_FIRST if decoding else layout
        query = heads_lib.split(self._project(inputs, "query"), self.num_heads, layout)
        key, value = (
            heads_lib.split(self._project(inputs, name), self._kv_heads, kv_layout)
            for name in ("key", "value")
        )
        if self.rope_max_wavelength is not None:
            rope = (
                self.rope_max_wavelength,
                self.rope_scaling_factor,
                0 if offset is None else offset,
            )
            query = rotary.rotate(query, layout, *rope)
            key = rotary.rotate(key, kv_layout, *rope)
        if decoding:
            cache, key, value = cache_lib.update(
                cache, key, value, offset, guard.valid, mask
            )
            if layout != kv_layout:
                key, value = (heads_lib.transpose(x) for x in (key, value))
        if not implementation.grouped_key_value:
            repeats = self.num_heads // self._kv_heads
            key, value = (heads_lib.repeat(x, repeats, layout) for x in (key, value))
        dropout = None
        if self._dropout_layer is not None and training:
            dropout = SeededDropout(
                self.dropout, self._dropout_layer.seed_generator.next()
            )
        heads_out, weights = implementation.fn(
            query,
            key,
            value,
            masks,
            scale=self._scale,
            dropout=dropout,
            return_weights=return_attention_scores,
        )
        output = heads_lib.merge(heads_out, layout)
        if self.use_gate:
            gate = ops.sigmoid(self._project(inputs, "gate"))
            output = ops.multiply(output, ops.cast(gate, output.dtype))
        if self.output_dim is not None:
            output = self._project(output, "output")
        # Queries with nothing to attend output exactly zero, also after the
        # output projection's bias: padded positions, and attention_mask rows
        # that allow no key.
        keep = self._queries_to_keep(inputs, masks)
        if keep is not None:
            output = ops.where(
                ops.expand_dims(keep, -1), output, ops.zeros_like(output)
            )
            if return_attention_scores:
                weights = ops.where(
                    ops.expand_dims(keep, (1, 3)), weights, ops.zeros_like(weights)
                )
        if decoding:
            return guard.output(output), cache
        if return_attention_scores:
            return output, weights
        return output

    def _queries_to_keep(self, inputs, masks: Masks):
        """Bool (B, Tq): queries with something to attend, or None (all)."""
        time = ops.shape(inputs)[1]
        query_padding = masks.key_padding
        if query_padding is not None:
            query_padding = ops.cast(query_padding, "bool")
            if masks.decoding:  # the new positions' own mask
                batch = ops.shape(query_padding)[0]
                start = ops.cast(masks.query_offset, "int32")
                query_padding = ops.slice(query_padding, (0, start), (batch, time))
        rows = (
            None
            if masks.attention is None
            else masks_lib.rows_with_keys(masks, time, time)
        )
        return masks_lib.all_of([m for m in (query_padding, rows) if m is not None])

    def _check_call(
        self, inputs, mask, attention_mask, return_attention_scores, cache, index
    ) -> bool:
        """Raises the call's ValueErrors; returns whether it decodes."""
        if cache is None:
            if index is not None:
                raise ValueError(
                    f"SelfAttention '{self.name}': `cache_update_index` goes with "
                    f"`cache`. Received: cache=None, cache_update_index={index!r}"
                )
            self._check_masks(inputs.shape, mask, attention_mask)
            self._check_scores_request(return_attention_scores)
            return False
        problems = {
            "causal": not self.causal,
            "attention_mask": attention_mask is not None,
            "return_attention_scores": return_attention_scores,
            "cache_update_index": index is None,
        }
        if any(problems.values()):
            raise ValueError(
                f"SelfAttention '{self.name}': a key/value cache is for causal "
                "decoding: the layer needs causal=True, and the call "
                "`cache_update_index` and no attention_mask or "
                "return_attention_scores. Received: causal="
                f"{self.causal}, attention_mask="
                f"{'given' if attention_mask is not None else None}, "
                f"return_attention_scores={return_attention_scores}, "
                f"cache_update_index={index!r}"
            )
        if self._key_dim != self._value_dim:
            raise ValueError(
                f"SelfAttention '{self.name}': the cache stores keys and values "
                "in one tensor, so value_dim must equal key_dim. Received: "
                f"key_dim={self._key_dim}, value_dim={self._value_dim}"
            )
        cache_lib.check(
            cache, self._kv_heads, self._key_dim, self.compute_dtype, self.name
        )
        cache_lib.check_batch(inputs, cache, self.name)
        max_length = tuple(cache.shape)[2]
        index = cache_lib.index_of(index, self.name)
        if isinstance(index, int):
            cache_lib.check_fit(index, tuple(inputs.shape)[1], max_length, self.name)
        if mask is not None:
            batch = tuple(inputs.shape)[0]
            self._check_masks((batch, max_length), mask, None)
        return True

    def empty_cache(self, batch_size: int, max_length: int):
        """A key/value cache of zeros for `layer(x, cache=..., cache_update_index=...)`.

        Args:
            batch_size: The batch size of the decoded sequences.
            max_length: How many positions the cache holds.

        Returns:
            Zeros of shape `(batch_size, 2, max_length, num_key_value_heads,
            key_dim)` in the layer's compute dtype.
        """
        if not self.built:
            raise ValueError(
                f"SelfAttention '{self.name}' is not built, so its key_dim is not "
                "known yet. Build it (or call it once) before empty_cache()."
            )
        batch_size = _checks.positive_int("batch_size", batch_size)
        max_length = _checks.positive_int("max_length", max_length)
        shape = cache_lib.shape(batch_size, max_length, self._kv_heads, self._key_dim)
        return ops.zeros(shape, self.compute_dtype)

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
        cache=None,
        cache_update_index=None,
    ):
        self._check_inputs(inputs)
        decoding = self._check_call(
            inputs,
            mask,
            attention_mask,
            return_attention_scores,
            cache,
            cache_update_index,
        )
        output = keras.KerasTensor(
            self.compute_output_shape(inputs.shape), dtype=self.compute_dtype
        )
        if decoding:
            return output, keras.KerasTensor(cache.shape, dtype=cache.dtype)
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
                "flash_attention": self.flash_attention,
                "num_key_value_heads": self.num_key_value_heads,
                "use_gate": self.use_gate,
                "rope_max_wavelength": self.rope_max_wavelength,
                "rope_scaling_factor": self.rope_scaling_factor,
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
        quantized = self.quantized_projections or {}
        if self.built:
            quantized = {
                name: state
                for name, layer in self._projections().items()
                if (state := projections_lib.quantization_state(layer)) is not None
            }
        if quantized:
            config["quantized_projections"] = quantized
        return config

    @classmethod
    def from_config(cls, config: dict) -> SelfAttention:
        # Keras's own from_config fails with an AttributeError on a `dtype`
        # config of an unknown class; check it first (ValueError).
        if isinstance(config, dict) and isinstance(config.get("dtype"), dict):
            config = {**config, "dtype": _checks.dtype_policy(config["dtype"])}
        return super().from_config(config)
