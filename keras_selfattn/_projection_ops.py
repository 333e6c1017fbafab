"""SelfAttention's projections: built, quantized, LoRA-adapted, loaded.

`add_all` makes them at build (size and initializer checked);
`ProjectionMethods` holds the layer's methods on them (quantize, LoRA, the
weights by their names from before the projections were layers, loading
files saved then). `plain`, `heads`, `project` and `merge` compute them in
a call: in an eager call without Keras's per-layer machinery (`plain`), and
in a TensorFlow graph (`tf.function`: Keras's `fit` and `predict`, a
SavedModel, a decoding step or generator for TF Serving) as one einsum
each (a loop step's one position: one 2-D MatMul), into the heads' layout
(`_graph_heads`, `_graph_project`).
There Keras's own `Dense` call multiplies a 3-D input by `tensordot`: per
call a chain of Shape, GatherV2, Prod, ConcatV2, Pack and Reshape around a
2-D MatMul, and the split into heads is a Split and a Pack more.
"""

from __future__ import annotations

import functools
import math

import keras
from keras import initializers, ops

from keras_selfattn import _checks, _qk_norm, _score_weights, tracing
from keras_selfattn import projections as projections_lib
from keras_selfattn.attention import heads as heads_lib
from keras_selfattn.attention.cache import environment

_BACKEND = keras.backend.backend()
if _BACKEND == "tensorflow":
    import tensorflow as tf
elif _BACKEND == "jax":
    import jax
    import jax.numpy as jnp
elif _BACKEND == "torch":
    import torch


def add(layer, prefix: str, kernel_shape: tuple[int, int]) -> None:
    """Adds `layer.{prefix}_dense`, a projection with kernel `kernel_shape`."""
    size = math.prod(kernel_shape)
    if size > _checks.MAX_SIZE:
        raise ValueError(
            f"SelfAttention '{layer.name}': {prefix}_kernel would have shape "
            f"{kernel_shape}, {size} elements (at most 2**31 - 1). Received: "
            f"num_heads={layer.num_heads}, key_dim={layer.key_dim}, "
            f"value_dim={layer.value_dim}, output_dim={layer.output_dim}"
        )
    # Seeds offset by the weights made before, as when they were the
    # layer's own weights: seeded layers keep their initial values.
    offset = len(layer.weights)
    projection = projections_lib.Projection(
        kernel_shape[1],
        use_bias=layer.use_bias,
        kernel_initializer=projections_lib.fresh_initializer(
            layer.kernel_initializer, offset
        ),
        bias_initializer=projections_lib.fresh_initializer(
            layer.bias_initializer, offset + 1
        ),
        kernel_regularizer=layer.kernel_regularizer,
        bias_regularizer=layer.bias_regularizer,
        kernel_constraint=layer.kernel_constraint,
        bias_constraint=layer.bias_constraint,
        name=f"{prefix}_dense",
        **{
            "dtype": layer.dtype_policy,
            **projections_lib.quantization_kwargs(
                (layer.quantized_projections or {}).get(prefix)
            ),
        },
    )
    try:
        projection.build((None, None, kernel_shape[0]))
    except Exception as error:
        kind = "kernel" if getattr(projection, "_kernel", None) is None else "bias"
        shape = kernel_shape if kind == "kernel" else kernel_shape[1:]
        config = initializers.serialize(getattr(layer, f"{kind}_initializer"))
        raise ValueError(
            f"SelfAttention '{layer.name}': `{kind}_initializer` cannot create "
            f"{prefix}_dense/{kind} of shape {shape}: {error} "
            f"Received: {kind}_initializer={config}"
        ) from error
    setattr(layer, f"{prefix}_dense", projection)


def add_all(layer, dims) -> None:
    """Adds the projections of `layer` for its `_config.Dims`."""
    input_dim, heads, kv_heads = dims.input_dim, layer.num_heads, layer._kv_heads
    add(layer, "query", (input_dim, heads * dims.key_dim))
    add(layer, "key", (input_dim, kv_heads * dims.key_dim))
    add(layer, "value", (input_dim, kv_heads * dims.value_dim))
    if layer.use_gate:
        add(layer, "gate", (input_dim, heads * dims.value_dim))
    if layer.output_dim is not None:
        add(layer, "output", (heads * dims.value_dim, layer.output_dim))


def quantization_states(layer) -> dict:
    """Each quantized projection's name -> its state (for `get_config`)."""
    return {
        name: state
        for name, projection in of(layer).items()
        if (state := projections_lib.quantization_state(projection)) is not None
    }


def of(layer) -> dict[str, projections_lib.Projection]:
    """The built projections by name, in weight order."""
    found = {
        name: getattr(layer, f"{name}_dense", None) for name in projections_lib.NAMES
    }
    return {name: p for name, p in found.items() if p is not None}


class ProjectionMethods:
    """SelfAttention's methods on its projections (a base class of it, before
    `keras.layers.Layer`)."""

    # The projections' weights under their names from before the projections
    # were layers (`layer.query_kernel` is `layer.query_dense.kernel`).
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

    def _projections(self) -> dict[str, projections_lib.Projection]:
        """The built projections by name, in weight order."""
        return of(self)

    def load_own_variables(self, store) -> None:
        """Loads a file saved before the projections were layers, whose
        weights were this layer's own (`get_weights()` order); files of this
        version keep them in the projections' entries."""
        if not len(store.keys()) or _own_weights(self):
            # This version's file (a layer with own weights is of it).
            return super().load_own_variables(store)
        projections = list(of(self).values())
        targets = [weight for p in projections for weight in p.weights]
        if len(store.keys()) != len(targets):
            raise ValueError(
                f"SelfAttention '{self.name}' has {len(targets)} weights, but the "
                f"file holds {len(store.keys())} for it. Received: a store with "
                f"keys {sorted(store.keys())}"
            )
        for index, weight in enumerate(targets):
            weight.assign(store[str(index)])
        for projection in projections:
            projection.filled_by_owner = True

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
        for projection in of(self).values():
            projection.quantize(mode, type_check=type_check, config=config)

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
        available = of(self)
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
        for name, projection in available.items():
            if name not in projections:
                projection.trainable = False
                continue
            projection.enable_lora(rank, lora_alpha=lora_alpha)
            if projection.bias is not None:
                projection.bias.trainable = False
        for name in _own_weights(self):
            getattr(self, name).trainable = False


def _own_weights(layer) -> tuple[str, ...]:
    """The names of the layer's own weights (not its projections')."""
    return _score_weights.names(layer) + _qk_norm.names(layer)


def _eager(x) -> bool:
    """Whether `x` is a value, not traced (tf.function, jax.jit, torch.export)."""
    if _BACKEND == "tensorflow":
        return tf.executing_eagerly()
    if _BACKEND == "jax":
        return not isinstance(x, jax.core.Tracer)
    if _BACKEND == "torch":
        return not tracing.torch_traced()
    return False


def _own_ops(projection, dtype: str) -> bool:
    """Whether `projection`'s call is its kernel and bias alone, in `dtype`:
    float (not quantized), without LoRA, rematerialization or (PyTorch)
    hooks, computing in `dtype`."""
    return not (
        projection.quantization_mode is not None
        or projection.lora_enabled
        or projection._remat_mode
        or (_BACKEND == "torch" and projection._forward_hooks)
        or (_BACKEND == "torch" and projection._forward_pre_hooks)
        or projection.compute_dtype != dtype
    )


def plain(layer, x) -> bool:
    """Whether this call computes the projections with the ops their `call`
    runs, without Keras's layer call around each (`Layer.__call__`: argument
    binding, name and autocast scopes, masks: in an eager call nothing but
    Python per call).

    True for an eager call of `x` in the projections' compute dtype, no
    `keras.distribution` set, each projection float, without LoRA,
    rematerialization or (PyTorch) hooks. Traced calls keep the layer calls
    (or, on TensorFlow, one op per projection: `_graph_ops`), so exported
    graphs keep their names.
    """
    if not _eager(x) or keras.distribution.distribution() is not None:
        return False
    dtype = layer.compute_dtype
    if not all(_own_ops(p, dtype) for p in of(layer).values()):
        return False
    return keras.backend.standardize_dtype(x.dtype) == dtype


def _graph_ops(projection, x) -> bool:
    """Whether this call computes `projection` of `x` as one op in a
    TensorFlow graph (`_graph_heads`, `_graph_project`).

    True on TensorFlow while a graph is traced (not for a converter:
    `tracing.FOR_CONVERTER`, whose tf2onnx and LiteRT passes find Keras's
    own MatMul of each kernel, quantized ones included), no
    `keras.distribution` set, for a projection whose call is its kernel
    and bias alone (`_own_ops`) in `x`'s dtype. A quantized or LoRA
    projection keeps its layer call (Keras's quantized call, an export's
    traced form of it, the LoRA update).
    """
    return (
        _BACKEND == "tensorflow"
        and not tf.executing_eagerly()
        and not tracing.active(tracing.FOR_CONVERTER)
        and keras.distribution.distribution() is None
        and _own_ops(projection, keras.backend.standardize_dtype(x.dtype))
    )


@functools.lru_cache(maxsize=64)
def _tf_constant(values: tuple[int, ...]):
    """An eager int32 tensor of `values`: TensorFlow's eager Reshape and
    Transpose take a tensor on their fast path, and convert a tuple on a slow
    one (about 15 us more per op)."""
    return tf.constant(values, tf.int32)


def _swap_time_heads(x):
    """(B, T, H, D) <-> (B, H, T, D) in one backend op (`heads_lib.transpose`)."""
    if _BACKEND == "tensorflow":
        return tf.transpose(x, _tf_constant((0, 2, 1, 3)))
    if _BACKEND == "torch":
        return torch.permute(x, (0, 2, 1, 3))
    if _BACKEND == "jax":
        return jnp.transpose(x, (0, 2, 1, 3))
    return ops.transpose(x, (0, 2, 1, 3))


def _reshape(x, shape: tuple[int, ...]):
    """`ops.reshape` in one backend op."""
    if _BACKEND == "tensorflow":
        return tf.reshape(x, _tf_constant(shape))
    if _BACKEND == "torch":
        return torch.reshape(x, shape)
    if _BACKEND == "jax":
        return jnp.reshape(x, shape)
    return ops.reshape(x, shape)


def _apply(projection, x, shape: tuple[int, ...]):
    """`projection.call(x)` for a plain call (`plain`), reshaped to `shape`
    ((B, T, N) or (B, T, H, N // H)): the backend ops Keras's would run
    (TensorFlow's `tensordot`: a 2-D MatMul, then the bias), without the
    Python around them."""
    if _BACKEND == "tensorflow":
        batch, time, features = x.shape
        y = tf.matmul(_reshape(x, (batch * time, features)), projection.kernel.value)
        if projection.bias is not None:
            y = tf.nn.bias_add(y, projection.bias.value)
        return _reshape(y, shape)
    kernel = projection.kernel.value
    if _BACKEND == "torch" and x.dtype == kernel.dtype != torch.float16:
        # (Keras multiplies float16 on a CPU, and float64, in float32.)
        y = torch.matmul(x, kernel)
        if projection.bias is not None:
            y = torch.add(y, projection.bias.value)
        return y if len(shape) == 3 else torch.reshape(y, shape)
    if _BACKEND == "jax":
        y = jnp.matmul(x, kernel)
        if projection.bias is not None:
            y = jnp.add(y, projection.bias.value)
        return y if len(shape) == 3 else jnp.reshape(y, shape)
    y = projection.call(x)
    return y if len(shape) == 3 else _reshape(y, shape)


def _graph_weights(projection):
    """The kernel and bias (None without) as tensors in the projection's
    compute dtype, as its layer call reads them (autocast)."""
    dtype = projection.compute_dtype
    kernel = tf.cast(projection.kernel.value, dtype)
    bias = None if projection.bias is None else tf.cast(projection.bias.value, dtype)
    return kernel, bias


def _step_matmul(x, kernel, shape: tuple[int, ...]):
    """x (B, 1, C) times the kernel (C, N) as one 2-D MatMul, reshaped to
    `shape` (batch -1, no shape read), for one new position of a generation
    loop's step with time-major caches (`environment.time_major_step`);
    else None. oneDNN's Einsum of one row per batch streamed the kernel at
    about 0.7x MatMul's speed on a CPU (docs/performance.md)."""
    if x.shape[1] != 1 or not environment.time_major_step():
        return None
    return tf.reshape(tf.matmul(tf.reshape(x, (-1, kernel.shape[0])), kernel), shape)


def _graph_project(projection, x):
    """`projection.call(x)` for x (B, T, C) in a TensorFlow graph
    (`_graph_ops`): the einsum `btc,cn->btn`, one matmul of (B * T, C) rows
    that reads no shape (a loop step's: `_step_matmul`), then the bias."""
    with tf.name_scope(projection.name):
        kernel, bias = _graph_weights(projection)
        y = _step_matmul(x, kernel, (-1, 1, kernel.shape[1]))
        if y is None:
            y = tf.einsum("btc,cn->btn", x, kernel)
        return y if bias is None else tf.nn.bias_add(y, bias)


def _graph_heads(projection, x, num_heads: int, layout: str):
    """`projection.call(x)` for x (B, T, C) in a TensorFlow graph
    (`_graph_ops`), split into `num_heads` heads in `layout`: the einsum
    `btc,chd->bthd` with the kernel as (C, H, D) (one matmul; no shape is
    read, the einsum sizes its output itself; a loop step's:
    `_step_matmul`), the bias per head, then, heads-first, one transpose
    (the copy the split made).

    Not the einsum straight to `bhtd`: as fast forward, but its gradient
    transposes twice (once per einsum of its backward pass), which made a
    training step 8 to 16 % slower than the layer calls'. Not a batched
    matmul of x (B, 1, T, C) with the kernel as (H, C, D), which writes
    heads-first without a transpose: oneDNN's kernel for two broadcast
    batch dimensions returns wrong values (one head, batch 2 by 33
    positions: errors of 11; TensorFlow 2.21).
    """
    features, units = projection.kernel.shape
    depth = units // num_heads
    with tf.name_scope(projection.name):
        kernel, bias = _graph_weights(projection)
        y = _step_matmul(x, kernel, (-1, 1, num_heads, depth))
        if y is None:
            kernel = tf.reshape(kernel, (features, num_heads, depth))
            y = tf.einsum("btc,chd->bthd", x, kernel)
        if bias is not None:
            y = y + tf.reshape(bias, (num_heads, depth))
        if layout == heads_lib.HEADS_FIRST:
            y = tf.transpose(y, (0, 2, 1, 3))
        return y


def project(layer, x, prefix: str, plain_call: bool):
    """The `prefix` projection of `x` (B, T, C)."""
    projection = getattr(layer, f"{prefix}_dense")
    if _graph_ops(projection, x):
        return _graph_project(projection, x)
    if not plain_call:
        return projection(x)
    return _apply(projection, x, (*x.shape[:2], projection.units))


def heads(layer, x, prefix: str, num_heads: int, layout: str, plain_call: bool):
    """The `prefix` projection of `x` (B, T, C), split into `num_heads` heads
    in `layout` (`heads_lib.split`)."""
    projection = getattr(layer, f"{prefix}_dense")
    if _graph_ops(projection, x):
        return _graph_heads(projection, x, num_heads, layout)
    if not plain_call:
        return heads_lib.split(projection(x), num_heads, layout)
    batch, time = x.shape[:2]
    shape = (batch, time, num_heads, projection.units // num_heads)
    y = _apply(projection, x, shape)
    return _swap_time_heads(y) if layout == heads_lib.HEADS_FIRST else y


def merge(x, layout: str, plain_call: bool):
    """`heads_lib.merge`, with the sizes an eager call knows."""
    if not plain_call:
        return heads_lib.merge(x, layout)
    if layout == heads_lib.HEADS_FIRST:
        x = _swap_time_heads(x)
    batch, time, num_heads, depth = x.shape
    return _reshape(x, (batch, time, num_heads * depth))
