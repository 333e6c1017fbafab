"""The key/value cache for decoding: its layout, checks, and updates.

A cache holds the keys and values of every position decoded so far, in one
tensor of shape `(batch, 2, max_length, num_key_value_heads, key_dim)`:
`cache[:, 0]` the keys, `cache[:, 1]` the values, in the `(B, T, H, D)`
layout (keras-hub's `CachedMultiHeadAttention` convention). Positions not
written yet hold zeros in `empty_cache`; whatever they hold, no output reads
them: `update` hands attention the positions up to the last one written, and
zeroes the others where sizes must be static (and padded positions).

A call's `cache_update_index` and shapes are checked where their values are
known: eagerly, a ValueError. Where they are not (a traced index or dynamic
batch), `Guard` checks them when the step runs: in TensorFlow graphs (and the
SavedModels made from them) a failed check raises InvalidArgument; where the
runtime has no errors (XLA under `jax.jit`, torch.compile, ONNX) the step
returns NaN outputs and leaves the cache as it was.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator
from typing import Any

import keras
import numpy as np
from keras import ops

from keras_selfattn import _converting
from keras_selfattn._checks import positive_int
from keras_selfattn.attention import masks, nan_safe


def shape(batch_size: int, max_length: int, num_heads: int, head_dim: int) -> tuple:
    """The cache's shape."""
    return (batch_size, 2, max_length, num_heads, head_dim)


def empty(
    layer_name: str, batch_size, max_length, num_heads: int, head_dim, dtype: str
):
    """A cache of zeros (`SelfAttention.empty_cache`); `head_dim` is None
    while the layer is not built (ValueError)."""
    if head_dim is None:
        raise ValueError(
            f"SelfAttention '{layer_name}' is not built, so its key_dim is not "
            "known yet. Build it (or call it once) before empty_cache()."
        )
    batch_size = positive_int("batch_size", batch_size)
    max_length = positive_int("max_length", max_length)
    return ops.zeros(shape(batch_size, max_length, num_heads, head_dim), dtype)


def check(cache, num_heads: int, head_dim: int, dtype: str, layer_name: str) -> None:
    """Raises ValueError unless `cache` has the layout above (where known) and
    the layer's compute dtype `dtype`."""
    cache_shape = tuple(cache.shape)
    expected = (None, 2, None, num_heads, head_dim)
    if _TIME_MAJOR.get():
        expected = (2, None, None, num_heads, head_dim)
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

        # Under torch.jit.trace (Keras's ONNX and OpenVINO exports) the value
        # would be baked into the trace as a constant.
        if (
            torch.compiler.is_compiling()
            or torch.jit.is_tracing()
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
    """Raises ValueError if `inputs` and `cache` have known, different batches."""
    batch, cache_batch = tuple(inputs.shape)[0], tuple(cache.shape)[_batch_axis()]
    if isinstance(batch, int) and isinstance(cache_batch, int) and batch != cache_batch:
        raise ValueError(
            f"SelfAttention '{layer_name}': `cache` must have the batch size of "
            f"the inputs ({batch}). Received: cache.shape={tuple(cache.shape)}, "
            f"inputs.shape={tuple(inputs.shape)}"
        )


def max_length(cache):
    """The cache's `max_length` as its shape gives it (None where unknown)."""
    return tuple(cache.shape)[1 if _TIME_MAJOR.get() else 2]


def _batch_axis() -> int:
    return 2 if _TIME_MAJOR.get() else 0


def _static(x) -> bool:
    return isinstance(x, int)


def _size(x, axis: int):
    """`ops.shape(x)[axis]` for Keras's ops: a symbolic torch size (under
    torch.export) as an int64 tensor, since Keras converts one with
    `torch.as_tensor`, which specializes it to the example's size."""
    size = ops.shape(x)[axis]
    if keras.backend.backend() == "torch":
        import torch

        if isinstance(size, torch.SymInt):
            return torch.scalar_tensor(size, dtype=torch.int64, device=x.device)
    return size


@contextlib.contextmanager
def _raised(flag: contextvars.ContextVar) -> Iterator[None]:
    """Sets the bool `flag` within the context (the contexts below)."""
    token = flag.set(True)
    try:
        yield
    finally:
        flag.reset(token)


_CHECKED_BY_CALLER = contextvars.ContextVar(
    "keras_selfattn_cache_checked_by_caller", default=False
)


def checked_by_caller() -> contextlib.AbstractContextManager[None]:
    """Within this context, cached calls make no run-time checks (`Guard`),
    zero no cache slot and no output: for a caller that has proven every
    index, batch and cache shape it passes valid, whose caches hold zeros in
    every slot no query may attend (padded, or not yet written), and whose
    new positions are all real tokens (True in the padding mask), as the
    generation loop's steps after the prompt do. Decided while a call is
    traced; it nests."""
    return _raised(_CHECKED_BY_CALLER)


def is_checked_by_caller() -> bool:
    """Whether calls traced now are within `checked_by_caller()`."""
    return _CHECKED_BY_CALLER.get()


_TIME_MAJOR = contextvars.ContextVar("keras_selfattn_cache_time_major", default=False)


def time_major() -> contextlib.AbstractContextManager[None]:
    """Within this context, cached calls take and return their caches
    time-major, `(2, max_length, batch, num_key_value_heads, key_dim)`
    (`to_time_major`), and their keys and values are the leading slices
    `cache[0][:n]` and `cache[1][:n]`, which a TensorFlow graph reads as
    views of the cache; in the public layout `cache[:, 0, :n]` is a copy
    on every call. Only for callers that `views_pay()` and that decode one
    position per call within `checked_by_caller()`, as the generation
    loop's steps do. A call writes into the buffer of the cache it takes
    (`_tf_write_in_place`): callers read only the cache it returns. Decided
    while a call is traced; it nests."""
    return _raised(_TIME_MAJOR)


def is_time_major() -> bool:
    """Whether calls traced now are within `time_major()`."""
    return _TIME_MAJOR.get()


def views_pay() -> bool:
    """Whether calls traced now would read time-major caches as views: in
    a TensorFlow graph that XLA does not compile, traced for no converter
    (XLA, JAX's and PyTorch's graphs and the converters slice to static
    lengths or gather, so there the public layout costs nothing more)."""
    return _outside_xla() and not _converting.tracing_for_converter()


def to_time_major(cache):
    """`(B, 2, L, G, K)` -> `(2, L, B, G, K)`."""
    return ops.transpose(cache, (1, 2, 0, 3, 4))


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
        int32 tensor), the inputs' batch and time, and the cache's shape;
        none within `checked_by_caller()`."""
        if _CHECKED_BY_CALLER.get():
            return cls(inputs, cache, None)
        batch, new = tuple(inputs.shape)[:2]
        cache_shape = tuple(cache.shape)
        max_length = cache_shape[2]
        conditions = []
        if not (_static(batch) and _static(cache_shape[0])):
            conditions.append(ops.equal(_size(inputs, 0), _size(cache, 0)))
        if not (_static(index) and _static(new) and _static(max_length)):
            end = ops.add(index, _size(inputs, 1))
            conditions.append(ops.greater_equal(index, 0))
            conditions.append(ops.less_equal(end, _size(cache, 2)))
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
    known = [(axis, size) for axis, size in enumerate(cache.shape) if _static(size)]
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


def _outside_xla() -> bool:
    """Whether this call is traced into a TensorFlow graph that XLA does not
    compile (not eager, not under `jit_compile=True`): there tensors may
    have sizes known only when it runs (eager calls know every size; XLA
    under `jax.jit` or `jit_compile=True` needs static ones)."""
    if keras.backend.backend() != "tensorflow":
        return False
    import tensorflow as tf

    if tf.executing_eagerly():
        return False
    try:
        from tensorflow.python.ops import control_flow_util
    except ImportError:  # pragma: no cover - TF internals moved: be safe.
        return False
    return not control_flow_util.GraphOrParentsInXlaContext(
        tf.compat.v1.get_default_graph()
    )


_GATHERED_WRITES = contextvars.ContextVar(
    "keras_selfattn_gathered_cache_writes", default=False
)


def gathered_writes() -> contextlib.AbstractContextManager[None]:
    """Within this context, cached calls write their caches as one gather
    (`_gather_write`) instead of a dynamic update slice: for converters that
    have no such op (OpenVINO's TensorFlow frontend has no
    XlaDynamicUpdateSlice). Decided while a call is traced; it nests."""
    return _raised(_GATHERED_WRITES)


def _gather_write(cache, new, start, valid):
    """`cache` with `new` written from position `start`, as one gather from
    both: JAX's shape-polymorphic export (jax2tf, jax2onnx) cannot slice by a
    symbolic number of new positions, as it cannot prove that they fit the
    cache. Where `valid` is False the cache is left as it was."""
    max_length = ops.shape(cache)[2]
    positions = masks.positions(max_length)
    offset = ops.subtract(positions, start)
    written = ops.logical_and(
        ops.greater_equal(offset, 0), ops.less(offset, ops.shape(new)[2])
    )
    if valid is not None:
        written = ops.logical_and(written, valid)
    # Position p reads `new` at p - start (behind the cache), or the cache at
    # p. The concatenation, unlike a select, refuses a batch of other size.
    source = ops.where(written, ops.add(offset, max_length), positions)
    return ops.take(ops.concatenate([cache, new], axis=2), source, axis=2)


def _tf_strided_write(cache, new, start):
    """`cache` with `new` written from position `start` (in range) of the
    time axis, by TensorFlow's TensorStridedSliceUpdate. Keras's
    `slice_update` is XlaDynamicUpdateSlice there, an op that runs only
    where XLA may compile, and TF Serving disables XLA on CPUs unless
    started with `--xla_cpu_compilation_enabled=true`: every request would
    fail."""
    import tensorflow as tf

    zero = tf.zeros((), "int32")
    start = tf.cast(start, "int32")
    length = new.shape[2] if _static(new.shape[2]) else tf.shape(new)[2]
    # Every axis but time whole (begin and end masks): no shape is read.
    whole = 0b11011
    return tf.raw_ops.TensorStridedSliceUpdate(
        input=cache,
        begin=tf.stack([zero, zero, start, zero, zero]),
        end=tf.stack([zero, zero, start + length, zero, zero]),
        strides=tf.ones((5,), "int32"),
        value=new,
        begin_mask=whole,
        end_mask=whole,
    )


def update(cache, key, value, index, valid=None, padding=None):
    """Writes the new positions' keys and values into the cache.

    Args:
        cache: `(B, 2, L, G, K)`.
        key: `(B, Tn, G, K)`, the keys of positions `index .. index + Tn - 1`.
        value: `(B, Tn, G, K)`, their values.
        index: The first new position (an int or a scalar int32 tensor).
        valid: None, or a bool scalar: where False the cache is left as it
            was (the write is clamped into range and writes the old values,
            or on torch is not selected).
        padding: None, or bool `(B, L)`, False at padded positions.

    Returns:
        Tuple (the updated cache, keys `(B, Lk, G, K)`, values): the keys and
        values of positions `0 .. Lk - 1` for attention, with `Lk = index +
        Tn` where sizes may depend on `index` (eager calls, TensorFlow graphs
        without XLA) and else `L`. Positions no query of the call may attend
        (padded ones, and those >= index + Tn) read zero, whatever the cache
        holds there, so their values (NaN, inf) change no output.
    """
    if _TIME_MAJOR.get():
        return _time_major_update(cache, key, value, index)
    new = ops.cast(ops.stack([key, value], axis=1), cache.dtype)
    backend = keras.backend.backend()
    # int64 on torch: Keras's slice_update indexes with the starts' own
    # dtype there, and torch.onnx writes int32 indices into an invalid
    # ScatterND.
    index_dtype = "int64" if backend == "torch" else "int32"
    zero = ops.zeros((), index_dtype)
    start = ops.cast(index, index_dtype)
    symbolic = backend == "jax" and not _static(ops.shape(new)[2])
    if symbolic or _GATHERED_WRITES.get():
        cache = _gather_write(cache, new, start, valid)
    else:
        if valid is not None:
            last = ops.subtract(_size(cache, 2), _size(new, 2))
            start = ops.minimum(ops.maximum(start, 0), ops.maximum(last, 0))
        starts = (zero, zero, start, zero, zero)
        if valid is not None and backend != "torch":
            old = ops.slice(cache, starts, ops.shape(new))
            new = nan_safe.where(valid, new, old)
        # TensorFlow's converters take XlaDynamicUpdateSlice, not
        # TensorStridedSliceUpdate (`_converting`).
        converter = _converting.tracing_for_converter()
        if backend == "tensorflow" and not converter and _outside_xla():
            cache = _tf_strided_write(cache, new, start)
        elif valid is None or backend != "torch":
            cache = ops.slice_update(cache, starts, new)
        else:
            # Keras's torch slice narrows by tensor sizes, which torch.export
            # cannot trace (data-dependent shapes): the whole updated cache
            # is selected instead (the update copies it anyway).
            updated = ops.slice_update(cache, starts, new)
            cache = nan_safe.where(valid, updated, cache)
    max_length = ops.shape(cache)[2]
    new_length = ops.shape(new)[2]
    if _static(index) and _static(new_length):
        end = index + new_length
    else:
        end = ops.add(index, _size(new, 2))
    length, visible = None, None
    if all(_static(size) for size in (end, max_length)):
        length = end if end < max_length else None
    elif _outside_xla():
        # At least one key: an index out of range returns NaN (`Guard`);
        # within `checked_by_caller()` none is.
        length = end
        if not _CHECKED_BY_CALLER.get():
            length = ops.minimum(ops.maximum(end, 1), max_length)
    else:
        positions = masks.positions(max_length)
        visible = ops.expand_dims(ops.less(positions, end), 0)
    keys, values = cache[:, 0, :length], cache[:, 1, :length]
    if _CHECKED_BY_CALLER.get():
        # The caller's caches read zero wherever no query may attend.
        padding, visible = None, None
    if padding is not None:
        padding = ops.cast(padding, "bool")[:, :length]
        visible = padding if visible is None else ops.logical_and(visible, padding)
    if visible is not None:
        visible = ops.expand_dims(visible, (2, 3))
        keys, values = (nan_safe.zero_unless(visible, x) for x in (keys, values))
    return cache, keys, values


def _time_major_update(cache, key, value, index):
    """`update` within `time_major()`: the cache `(2, L, B, G, K)`, and the
    keys and values of positions `0 .. index`, `(index + 1, B, G, K)`."""
    if key.shape[1] != 1:
        raise ValueError(
            "cache.time_major() decodes one position per call. Received: "
            f"key.shape={tuple(key.shape)}"
        )
    new = ops.cast(ops.stack([key, value], axis=0), cache.dtype)  # (2, B, 1, G, K)
    cache = _tf_write_in_place(cache, new, index)
    end = ops.add(index, 1)
    return cache, cache[0][:end], cache[1][:end]


def _tf_write_in_place(cache, new, index):
    """The time-major `cache` `(2, L, B, G, K)` with `new` `(2, B, 1, G, K)`
    written at time `index`, into the cache's own buffer by TensorFlow's
    InplaceUpdate: about 10 us per write where TensorStridedSliceUpdate,
    which also writes in place when it may, took about 100 (batch 8, 8
    heads of 32; either way whatever `L` is). InplaceUpdate writes into
    its input even where other ops still read it, so it is for caches that
    only this write reads: within `time_major()`, each step's cache goes
    from the loop into one layer's write, which the step's reads follow
    (the views end at `index`; the next step writes after them)."""
    import tensorflow as tf

    max_length = cache.shape[1] or tf.shape(cache)[1]
    at = tf.cast(index, "int32")
    # Time is 1: (2, B, 1, G, K) -> (2, B G K) keeps the cache's order.
    rows = tf.raw_ops.InplaceUpdate(
        x=tf.reshape(cache, (2 * max_length, -1)),  # (2 L, B G K)
        i=tf.stack([at, at + max_length]),
        v=tf.reshape(new, (2, -1)),
    )
    rows = tf.reshape(rows, tf.shape(cache))
    rows.set_shape(cache.shape)  # static sizes stay static (the while loop's)
    return rows


def check_call(
    layer, inputs, cache, index, attention_mask, return_attention_scores: bool
):
    """Checks a call of the built SelfAttention `layer` with a `cache` (not
    None), and converts its `cache_update_index` `index` once: the call reads
    the value this returns, never `index` again (reading an eager tensor's
    value waits for the device).

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
        check_fit(index, tuple(inputs.shape)[1], max_length(cache), layer_name)
    return index


def check_no_index(index, layer_name: str) -> None:
    """Raises ValueError for a `cache_update_index` given without a cache."""
    if index is not None:
        raise ValueError(
            f"SelfAttention '{layer_name}': `cache_update_index` goes with "
            f"`cache`. Received: cache=None, cache_update_index={index!r}"
        )
