"""The checks of a cached call: ValueErrors where the values are known when
it is traced, and `Guard`, the run-time checks of the others.

A call's `cache_update_index` and shapes are checked where their values are
known: eagerly, a ValueError. Where they are not (a traced index or dynamic
batch), `Guard` checks them when the step runs: in TensorFlow graphs (and the
SavedModels made from them) a failed check raises InvalidArgument; where the
runtime has no errors (XLA under `jax.jit`, torch.compile, ONNX) the step
returns NaN outputs and leaves the cache as it was.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import keras
import numpy as np
from keras import ops

from keras_selfattn import tracing


def check(cache, num_heads: int, head_dim: int, dtype: str, layer_name: str) -> None:
    """Raises ValueError unless the `layouts.Cache` `cache` has its layout's
    shape (where known) and the layer's compute dtype `dtype`."""
    cache_shape = cache.shape
    expected = cache.expected_shape(num_heads, head_dim)
    if len(cache_shape) != 5 or any(
        want is not None and isinstance(have, int) and have != want
        for have, want in zip(cache_shape, expected, strict=False)
    ):
        raise ValueError(
            f"SelfAttention '{layer_name}': `cache` must have shape (batch, 2, "
            f"max_length, num_key_value_heads={num_heads}, key_dim={head_dim}); "
            f"build one with layer.empty_cache(batch_size, max_length). "
            f"Received: cache.shape={cache_shape}"
        )
    check_dtype(cache, dtype, layer_name)


def check_dtype(cache, dtype: str, layer_name: str) -> None:
    """Raises ValueError unless `cache` has the compute dtype `dtype`."""
    cache_dtype = getattr(cache, "dtype", None)
    if cache_dtype is not None:
        cache_dtype = keras.backend.standardize_dtype(cache_dtype)
    if cache_dtype != dtype:
        raise ValueError(
            f"SelfAttention '{layer_name}': `cache` must have the layer's "
            f"compute dtype {dtype} (keys and values of another dtype would be "
            "rounded or truncated); build one with layer.empty_cache(batch_size, "
            f"max_length). Received: cache.dtype={cache_dtype}"
        )


def _known_value(index) -> int | None:
    """The value of a scalar integer tensor if it is known now, else None."""
    if isinstance(index, keras.KerasTensor):
        return None
    if isinstance(index, (np.ndarray, np.generic)):
        return int(index)
    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        value = tf.get_static_value(index)
        return None if value is None else int(value)
    if backend == "jax":
        import jax

        return None if isinstance(index, jax.core.Tracer) else int(index)
    if backend == "torch":
        import torch

        # Under torch.jit.trace (Keras's ONNX and OpenVINO exports) or a
        # recording (`generate`'s steps) the value would be baked into the
        # trace as a constant.
        if (
            torch.compiler.is_compiling()
            or torch.jit.is_tracing()
            or tracing.torch_recorded()
            or index.device.type == "meta"
        ):
            return None
        return int(index.item())
    return None


def index_of(index, layer_name: str):
    """`cache_update_index` as a Python int when its value is known now (an
    int, a numpy integer, an eager tensor), else as an int32 scalar tensor.

    Raises:
        ValueError: a float, bool, non-scalar or non-numeric index.
    """
    if isinstance(index, (int, np.integer)) and not isinstance(index, bool):
        return int(index)
    dtype = getattr(index, "dtype", None)
    index_shape = getattr(index, "shape", None)
    dtype = None if dtype is None else keras.backend.standardize_dtype(dtype)
    if (
        dtype is None
        or "int" not in dtype
        or index_shape is None
        or len(tuple(index_shape)) != 0
    ):
        raise ValueError(
            f"SelfAttention '{layer_name}': `cache_update_index` must be an "
            "integer or a scalar integer tensor (the position of the first new "
            f"token). Received: cache_update_index={index!r} (dtype {dtype}, "
            f"shape {None if index_shape is None else tuple(index_shape)})"
        )
    value = _known_value(index)
    return ops.cast(index, "int32") if value is None else value


def check_fit(index: int, new, max_length, layer_name: str) -> None:
    """Raises ValueError unless the `new` positions from the known `index`
    fit the cache (sizes that are not known yet are checked by `Guard`)."""
    too_far = (
        isinstance(new, int)
        and isinstance(max_length, int)
        and index + new > max_length
    )
    if index < 0 or too_far:
        raise ValueError(
            f"SelfAttention '{layer_name}': {new} new positions from "
            f"cache_update_index={index} do not fit a cache of "
            f"max_length={max_length} (0 <= cache_update_index and "
            "cache_update_index + new positions <= max_length). Received: "
            f"cache_update_index={index}"
        )


def check_batch(inputs, cache, layer_name: str) -> None:
    """Raises ValueError if `inputs` and the `layouts.Cache` `cache` have
    known, different batches."""
    batch, cache_batch = tuple(inputs.shape)[0], cache.batch_size
    if isinstance(batch, int) and isinstance(cache_batch, int) and batch != cache_batch:
        raise ValueError(
            f"SelfAttention '{layer_name}': `cache` must have the batch size of "
            f"the inputs ({batch}). Received: cache.shape={tuple(cache.shape)}, "
            f"inputs.shape={tuple(inputs.shape)}"
        )


def is_static(x) -> bool:
    """Whether the size `x` is known while tracing (a Python int)."""
    return isinstance(x, int)


def size(x, axis: int):
    """`ops.shape(x)[axis]` for Keras's ops: a symbolic torch size (under
    torch.export) as an int64 tensor, since Keras converts one with
    `torch.as_tensor`, which specializes it to the example's size."""
    length = ops.shape(x)[axis]
    if keras.backend.backend() == "torch":
        import torch

        if isinstance(length, torch.SymInt):
            return torch.scalar_tensor(length, dtype=torch.int64, device=x.device)
    return length


@dataclasses.dataclass(frozen=True)
class Guard:
    """The run-time checks of one cached call whose values are not all known
    when it is traced.

    Attributes:
        inputs, cache: The call's tensors; on TensorFlow graphs they depend
            on the checks (InvalidArgument before anything reads them).
        valid: None when every check passed at trace time; else a bool scalar
            tensor, False when the step must return NaN and keep the cache.
    """

    inputs: Any
    cache: Any
    valid: Any

    @classmethod
    def of(cls, inputs, cache, index, layer_name: str) -> Guard:
        """The checks of `index` (a Python int already range-checked, or an
        int32 tensor), the inputs' batch and time, and the batch-major cache
        tensor's shape."""
        batch, new = tuple(inputs.shape)[:2]
        cache_shape = tuple(cache.shape)
        max_length = cache_shape[2]
        conditions = []
        if not (is_static(batch) and is_static(cache_shape[0])):
            conditions.append(ops.equal(size(inputs, 0), size(cache, 0)))
        if not (is_static(index) and is_static(new) and is_static(max_length)):
            end = ops.add(index, size(inputs, 1))
            # Python's operators (as in `masks`): on torch they trace as
            # aten::ge and aten::le, which OpenVINO's torch frontend
            # converts (it has no rule for aten::greater_equal/less_equal).
            conditions.append(index >= 0)
            conditions.append(end <= size(cache, 2))
        valid = None
        for condition in conditions:
            valid = condition if valid is None else ops.logical_and(valid, condition)
        if keras.backend.backend() == "tensorflow":
            inputs, cache = _tf_assert(inputs, cache, index, valid, layer_name)
        return cls(inputs, cache, valid)

    def output(self, output):
        """`output`, or NaN where the checks failed."""
        if self.valid is None:
            return output
        return ops.where(self.valid, output, ops.cast(float("nan"), output.dtype))


def _tf_assert(inputs, cache, index, valid, layer_name: str):
    """In a TensorFlow graph, raises InvalidArgument when the step runs with
    an index or batch that does not fit, or a cache whose shape differs from
    the traced one (a SavedModel's declared dimensions)."""
    import tensorflow as tf

    if tf.executing_eagerly():
        return inputs, cache
    known = [(axis, n) for axis, n in enumerate(cache.shape) if is_static(n)]
    if known:
        axes, sizes = zip(*known, strict=True)
        have = tf.gather(tf.shape(cache), list(axes))
        shape_ok = tf.reduce_all(tf.equal(have, list(sizes)))
        valid = shape_ok if valid is None else tf.logical_and(valid, shape_ok)
    if valid is None:
        return inputs, cache
    asserts = [
        tf.debugging.Assert(
            valid,
            [
                f"SelfAttention '{layer_name}': cache_update_index must be in "
                "[0, max_length - new positions], the inputs' batch must be "
                f"the cache's, and `cache` must have shape {tuple(cache.shape)}. "
                "Received: cache_update_index=",
                index,
                "inputs.shape=",
                tf.shape(inputs),
                "cache.shape=",
                tf.shape(cache),
            ],
        )
    ]
    with tf.control_dependencies(asserts):
        return tf.identity(inputs), tf.identity(cache)


def check_call(
    layer, inputs, cache, index, attention_mask, return_attention_scores: bool
):
    """Checks a call of the built SelfAttention `layer` with a
    `layouts.Cache` `cache`, and converts its `cache_update_index` `index`
    once: the call reads the value this returns, never `index` again
    (reading an eager tensor's value waits for the device).

    Returns:
        `index` as `index_of` converts it: a Python int when its value is
        known now, else an int32 scalar tensor.

    Raises:
        ValueError: the arguments or the layer (`causal`, head sizes,
            key/value heads, compute dtype) cannot decode, or `index` is
            known to overflow the cache.
    """
    causal, dims, layer_name = layer.causal, layer._dims, layer.name
    problems = {
        "causal": not causal,
        "attention_mask": attention_mask is not None,
        "return_attention_scores": return_attention_scores,
        "cache_update_index": index is None,
    }
    if any(problems.values()):
        raise ValueError(
            f"SelfAttention '{layer_name}': a key/value cache is for causal "
            "decoding: the layer needs causal=True, and the call "
            "`cache_update_index` and no attention_mask or "
            "return_attention_scores. Received: causal="
            f"{causal}, attention_mask="
            f"{'given' if attention_mask is not None else None}, "
            f"return_attention_scores={return_attention_scores}, "
            f"cache_update_index={index!r}"
        )
    if dims.key_dim != dims.value_dim:
        raise ValueError(
            f"SelfAttention '{layer_name}': the cache stores keys and values "
            "in one tensor, so value_dim must equal key_dim. Received: "
            f"key_dim={dims.key_dim}, value_dim={dims.value_dim}"
        )
    check(cache, layer._kv_heads, dims.key_dim, layer.compute_dtype, layer_name)
    check_batch(inputs, cache, layer_name)
    index = index_of(index, layer_name)
    if isinstance(index, int):
        check_fit(index, tuple(inputs.shape)[1], cache.max_length, layer_name)
    return index


def check_no_index(index, layer_name: str) -> None:
    """Raises ValueError for a `cache_update_index` given without a cache."""
    if index is not None:
        raise ValueError(
            f"SelfAttention '{layer_name}': `cache_update_index` goes with "
            f"`cache`. Received: cache=None, cache_update_index={index!r}"
        )
