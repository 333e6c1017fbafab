"""The writes of a cached call's new keys and values into its cache, and
the keys and values the call then attends (`attended`).

Each cache class (`layouts`) writes with the one function its layout
needs: `in_place` (time-major, TensorFlow's InplaceUpdate),
`torch_in_place` (eager PyTorch tensors), `gathered` (one gather, for
converters without a dynamic update slice and JAX's shape-polymorphic
export), `strided` (TensorFlow's TensorStridedSliceUpdate, for graphs
that XLA does not compile), `sliced` (Keras's `slice_update`) and
`selected` (the whole updated cache selected, for torch.export); each
takes `(cache, key, value, index, valid)` and returns the cache.
"""

from __future__ import annotations

import keras
from keras import ops

from keras_selfattn.attention import masks, nan_safe
from keras_selfattn.attention.cache import environment
from keras_selfattn.attention.cache.checks import is_static, size


def _index_dtype() -> str:
    # int64 on torch: Keras's slice_update indexes with the starts' own
    # dtype there, and torch.onnx writes int32 indices into an invalid
    # ScatterND.
    return "int64" if keras.backend.backend() == "torch" else "int32"


def _starts(start) -> tuple:
    """The starts of a slice at time `start` (every other axis at 0)."""
    zero = ops.zeros((), _index_dtype())
    return (zero, zero, start, zero, zero)


def _stacked(cache, key, value):
    """The new keys and values `(B, 2, Tn, G, K)` in the cache's dtype."""
    return ops.cast(ops.stack([key, value], axis=1), cache.dtype)


def _clamped(cache, new, index, valid):
    """`index` as the starts' dtype, moved into range where a guard may
    have refused it (the write then keeps the old values)."""
    start = ops.cast(index, _index_dtype())
    if valid is None:
        return start
    last = size(cache, 2) - size(new, 2)  # aten::sub on torch (see `checks`)
    return ops.minimum(ops.maximum(start, 0), ops.maximum(last, 0))


def _kept(cache, new, start, valid):
    """`new`, or where `valid` is False the values it would overwrite."""
    if valid is None:
        return new
    old = ops.slice(cache, _starts(start), ops.shape(new))
    return nan_safe.where(valid, new, old)


def in_place(cache, key, value, index, valid):
    """The time-major cache `(2, L, B, G, K)` with one new position written
    at `index`, in the cache's own buffer (`_tf_write_in_place`)."""
    if key.shape[1] != 1:
        raise ValueError(
            "A time-major cache (TimeMajorCache) decodes one position per "
            "call. Received: "
            f"key.shape={tuple(key.shape)}"
        )
    new = ops.cast(ops.stack([key, value], axis=0), cache.dtype)  # (2, B, 1, G, K)
    return _tf_write_in_place(cache, new, index)


def torch_in_place(cache, key, value, index, valid):
    """The cache with the new positions written at `index` into its own
    tensor, where Keras's `slice_update` clones the whole cache first (a
    copy of every layer's cache on every step). For eager PyTorch calls on
    a `TorchInPlaceCache`: the generation loop's steps, whose caches only
    these writes read (the keys and values attended are views of the
    cache up to the new positions; the next step writes after them)."""
    start = int(index)
    end = start + key.shape[1]
    # Two copies (cast to the cache's dtype as they go), no stacked tensor.
    cache[:, 0, start:end] = key
    cache[:, 1, start:end] = value
    return cache


def torch_indexed(cache, key, value, index, valid):
    """The cache with the new positions written at `index`, a tensor, into
    its own tensor by one `index_copy_`: for a `TorchRecordedCache`, whose
    writes a recording keeps in place (an index a recording reads would be a
    constant of the graph)."""
    import torch

    new = torch.stack([key, value], dim=1).to(cache.dtype)  # (B, 2, Tn, G, K)
    start = torch.as_tensor(index, device=cache.device).to(torch.int64)
    positions = start + torch.arange(key.shape[1], device=cache.device)
    return cache.index_copy_(2, positions, new)


def gathered(cache, key, value, index, valid):
    start = ops.cast(index, _index_dtype())
    return _gather_write(cache, _stacked(cache, key, value), start, valid)


def strided(cache, key, value, index, valid):
    new = _stacked(cache, key, value)
    start = _clamped(cache, new, index, valid)
    return _tf_strided_write(cache, _kept(cache, new, start, valid), start)


def sliced(cache, key, value, index, valid):
    new = _stacked(cache, key, value)
    start = _clamped(cache, new, index, valid)
    return ops.slice_update(cache, _starts(start), _kept(cache, new, start, valid))


def selected(cache, key, value, index, valid):
    """Keras's torch slice narrows by tensor sizes, which torch.export
    cannot trace (data-dependent shapes): the whole updated cache is
    selected instead (the update copies it anyway)."""
    new = _stacked(cache, key, value)
    start = _clamped(cache, new, index, valid)
    updated = ops.slice_update(cache, _starts(start), new)
    return nan_safe.where(valid, updated, cache)


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
    length = new.shape[2] if is_static(new.shape[2]) else tf.shape(new)[2]
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


def portable(cache, key, value, index, valid):
    """The write that every runtime and converter takes: a gather where JAX
    traces the number of new positions as a symbol (shape-polymorphic
    export: a slice cannot be proven to fit), a selected update where
    torch.export traces a guarded call, else Keras's `slice_update`."""
    if keras.backend.backend() == "jax" and not is_static(ops.shape(key)[1]):
        return gathered(cache, key, value, index, valid)
    if valid is not None and keras.backend.backend() == "torch":
        return selected(cache, key, value, index, valid)
    return sliced(cache, key, value, index, valid)


def time_major_attended(cache, index):
    """The keys and values of positions `0 .. index` of a time-major cache
    `(2, L, B, G, K)`, `(index + 1, B, G, K)` each: views of its buffer
    where TensorFlow reads a leading slice."""
    end = ops.add(index, 1)
    return cache[0][:end], cache[1][:end]


def attended_length(cache, key, index, checked: bool = False):
    """How many keys `attended` returns after writing `key` at `index`.

    The layers of a model decoding one step compute it from the same index
    and sizes, so a graph computes it once: a mask built from it (not from
    the keys' own shape, which each layer reads from its own cache) is
    common to the layers (`Masks.key_length`).

    Args:
        cache: `(B, 2, L, G, K)`.
        key: `(B, Tn, G, K)`, the keys written at `index .. index + Tn - 1`.
        index: The first new position (an int or a scalar int32 tensor).
        checked: As `attended`'s.

    Returns:
        `Lk` as an int or a scalar int32 tensor, or None where `attended`
        returns all `L` positions.
    """
    return _window(cache, key, index, checked)[0]


def _window(cache, key, index, checked: bool):
    """(`attended_length`, None) where the keys are cut to the positions
    written so far, else (None, bool `(1, L)`, True at those positions)."""
    max_length = ops.shape(cache)[2]
    new_length = ops.shape(key)[1]
    if is_static(index) and is_static(new_length):
        end = index + new_length
    else:
        end = ops.add(index, size(key, 1))
    length, visible = None, None
    if all(is_static(n) for n in (end, max_length)):
        length = end if end < max_length else None
    elif environment.torch_eager():
        # Eager PyTorch reads the index now: the keys written so far are a
        # view, and no later slot is attended (or masked). At least one key,
        # as below.
        length = int(end)
        if not checked:
            length = min(max(length, 1), max_length)
    elif environment.outside_xla():
        # At least one key: an index out of range returns NaN (`Guard`);
        # a checked caller passes none.
        length = end
        if not checked:
            length = ops.minimum(ops.maximum(end, 1), max_length)
    else:
        positions = masks.positions(max_length)
        visible = ops.expand_dims(ops.less(positions, end), 0)
    return length, visible


def attended(cache, key, index, padding=None, checked: bool = False):
    """The keys and values a call attends after writing `key` at `index`.

    Args:
        cache: `(B, 2, L, G, K)`, written.
        key: `(B, Tn, G, K)`, the keys written at `index .. index + Tn - 1`.
        index: The first new position (an int or a scalar int32 tensor).
        padding: None, or bool `(B, L)`, False at padded positions.
        checked: Whether the caller checked the call and keeps zeros in
            every slot no query may attend (then nothing is clamped or
            zeroed).

    Returns:
        Tuple (keys `(B, Lk, G, K)`, values): those of positions `0 .. Lk
        - 1`, with `Lk = index + Tn` where sizes may depend on `index`
        (eager calls, TensorFlow graphs without XLA) and else `L`.
        Positions no query of the call may attend (padded ones, and those
        >= index + Tn) read zero, whatever the cache holds there, so their
        values (NaN, inf) change no output.
    """
    length, visible = _window(cache, key, index, checked)
    keys, values = cache[:, 0, :length], cache[:, 1, :length]
    if checked:
        # The caller's caches read zero wherever no query may attend.
        padding, visible = None, None
    if padding is not None:
        padding = ops.cast(padding, "bool")[:, :length]
        visible = padding if visible is None else ops.logical_and(visible, padding)
    if visible is not None:
        visible = ops.expand_dims(visible, (2, 3))
        keys, values = (nan_safe.zero_unless(visible, x) for x in (keys, values))
    return keys, values


def _tf_write_in_place(cache, new, index):
    """The time-major `cache` `(2, L, B, G, K)` with `new` `(2, B, 1, G, K)`
    written at time `index`, into the cache's own buffer by TensorFlow's
    InplaceUpdate: about 10 us per write where TensorStridedSliceUpdate,
    which also writes in place when it may, took about 100 (batch 8, 8
    heads of 32; either way whatever `L` is). InplaceUpdate writes into
    its input even where other ops still read it, so it is for caches that
    only this write reads: a `TimeMajorCache`, each step's cache going
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
