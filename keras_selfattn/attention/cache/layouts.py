"""The cache classes: one per layout, each with the one write and read it
needs (`update`), built once by the caller that knows which it needs.

A cache object wraps the cache tensor of one SelfAttention layer. Its class
says how a call writes the new keys and values and which it attends:

- `Cache`: batch-major `(B, 2, L, G, K)`, copied on every write, its calls
  guarded (`checks.Guard`) and the slots they may not attend zeroed. What a
  user's raw tensor becomes (`layer(x, cache=tensor, ...)`); it writes as
  where it runs allows: TensorStridedSliceUpdate in a TensorFlow graph that
  XLA does not compile (TF Serving without XLA), else `writes.portable`.
- `ConverterCache`: as `Cache`, always `writes.portable` (XlaDynamicUpdateSlice
  on TensorFlow, which tf2onnx and LiteRT's converter take).
- `GatheredCache`: as `Cache`, written by one gather (OpenVINO's
  TensorFlow frontend converts no dynamic update slice).
- `CheckedCache`: batch-major, for a caller that proved every index, batch
  and shape it passes valid, keeps zeros in every slot no query may attend
  and feeds only real tokens (the generation loop's steps): no guard, no
  zeroing, `writes.portable`.
- `TorchInPlaceCache`: a `CheckedCache` that eager PyTorch writes into its
  own tensor (Keras's `slice_update` clones the whole cache first).
- `TorchRecordedCache`: a `CheckedCache` of a recorded PyTorch step
  (`generation.torch_steps`), written into its own tensor at a tensor index
  by `index_copy_`; the whole cache attended, masked.
- `TimeMajorCache`: checked, time-major `(2, L, B, G, K)`, written in its
  own buffer by TensorFlow's InplaceUpdate, one position a call, its keys
  and values read as views (`writes.time_major_attended`): the loop's
  steps in a TensorFlow graph that XLA does not compile.

The in-place classes write into the tensor they wrap: their caller reads
only the caches the calls return.
"""

from __future__ import annotations

from typing import Any, ClassVar

from keras import KerasTensor, ops

from keras_selfattn.attention.cache import checks, environment, writes


class Cache:
    """A batch-major cache `(B, 2, L, G, K)` that each call copies, guards
    and zeroes where no query may attend (module docstring).

    Args:
        tensor: The cache tensor.
    """

    checked: ClassVar[bool] = False
    time_major: ClassVar[bool] = False

    def __init__(self, tensor: Any):
        self.tensor = tensor

    @property
    def shape(self) -> tuple:
        return tuple(self.tensor.shape)

    @property
    def dtype(self):
        return self.tensor.dtype

    @property
    def max_length(self):
        """`max_length` as the shape gives it (None where unknown)."""
        return self.shape[1 if self.time_major else 2]

    @property
    def batch_size(self):
        """The batch size as the shape gives it (None where unknown)."""
        return self.shape[2 if self.time_major else 0]

    def expected_shape(self, num_heads: int, head_dim: int) -> tuple:
        """The shape this layout has (None: any size)."""
        if self.time_major:
            return (2, None, None, num_heads, head_dim)
        return (None, 2, None, num_heads, head_dim)

    @classmethod
    def from_batch_major(cls, tensor: Any) -> Cache:
        """A cache of this class holding the batch-major `(B, 2, L, G, K)`
        `tensor` (in its own layout)."""
        return cls(tensor)

    def replaced(self, tensor: Any) -> Cache:
        """A cache of this class wrapping `tensor`."""
        return type(self)(tensor)

    def guard(self, inputs, index, layer_name: str) -> checks.Guard:
        """The run-time checks of a call (none for a checked cache)."""
        if self.checked:
            return checks.Guard(inputs, self.tensor, None)
        return checks.Guard.of(inputs, self.tensor, index, layer_name)

    def write(self, key, value, index, valid):
        """The cache tensor with the new positions written at `index`."""
        if environment.outside_xla():
            return writes.strided(self.tensor, key, value, index, valid)
        return writes.portable(self.tensor, key, value, index, valid)

    def attended_length(self, key, index):
        """How many keys `update` returns for new keys `key` at `index`
        (`writes.attended_length`): an int, a scalar int32 tensor, or None
        where it reads from the keys' shape."""
        return writes.attended_length(self.tensor, key, index, self.checked)

    def update(self, key, value, index, valid=None, padding=None):
        """Writes the new positions' keys and values.

        Args:
            key: `(B, Tn, G, K)`, the keys of positions `index .. index +
                Tn - 1`.
            value: `(B, Tn, G, K)`, their values.
            index: The first new position (an int or a scalar int32 tensor).
            valid: None, or a bool scalar: where False the cache is left as
                it was (`checks.Guard`).
            padding: None, or bool `(B, L)`, False at padded positions.

        Returns:
            Tuple (the updated cache, of this class; keys `(B, Lk, G, K)`,
            values: those to attend, `writes.attended`).
        """
        tensor = self.write(key, value, index, valid)
        keys, values = writes.attended(tensor, key, index, padding, self.checked)
        return self.replaced(tensor), keys, values


class ConverterCache(Cache):
    """A `Cache` written by `writes.portable` wherever it is traced: for
    TensorFlow's converters (tf2onnx, LiteRT's), which take
    XlaDynamicUpdateSlice and not TensorStridedSliceUpdate."""

    def write(self, key, value, index, valid):
        return writes.portable(self.tensor, key, value, index, valid)


class GatheredCache(Cache):
    """A `Cache` written by one gather: for converters that have no dynamic
    update slice (OpenVINO's TensorFlow frontend)."""

    def write(self, key, value, index, valid):
        return writes.gathered(self.tensor, key, value, index, valid)


class CheckedCache(Cache):
    """A batch-major cache whose caller checked every call (module
    docstring): no guard, no zeroing, `writes.portable`."""

    checked = True

    def write(self, key, value, index, valid):
        return writes.portable(self.tensor, key, value, index, valid)


class TorchInPlaceCache(CheckedCache):
    """A `CheckedCache` of eager PyTorch, written into its own tensor."""

    def write(self, key, value, index, valid):
        return writes.torch_in_place(self.tensor, key, value, index, valid)


class TorchRecordedCache(CheckedCache):
    """A `CheckedCache` of a recorded PyTorch step (`generate`'s, replayed
    by `generation.torch_steps`), written into its own tensor at a tensor
    index; the whole cache is attended, masked as its caller masks it."""

    def write(self, key, value, index, valid):
        return writes.torch_indexed(self.tensor, key, value, index, valid)


class TimeMajorCache(CheckedCache):
    """A checked, time-major cache `(2, L, B, G, K)` that TensorFlow writes
    in place and reads as views (module docstring)."""

    time_major = True

    @classmethod
    def from_batch_major(cls, tensor: Any) -> TimeMajorCache:
        """`(B, 2, L, G, K)` -> `(2, L, B, G, K)`."""
        return cls(ops.transpose(tensor, (1, 2, 0, 3, 4)))

    def write(self, key, value, index, valid):
        return writes.in_place(self.tensor, key, value, index, valid)

    def attended_length(self, key, index):
        return ops.add(index, 1)  # `writes.time_major_attended`

    def update(self, key, value, index, valid=None, padding=None):
        tensor = self.write(key, value, index, valid)
        keys, values = writes.time_major_attended(tensor, index)
        return self.replaced(tensor), keys, values


def wrapped(cache) -> Cache:
    """`cache` itself if it is a `Cache` (a raw tensor: a `Cache`), its
    tensor a backend tensor (an array converted)."""
    if not isinstance(cache, Cache):
        cache = Cache(cache)
    if not (ops.is_tensor(cache.tensor) or isinstance(cache.tensor, KerasTensor)):
        cache = cache.replaced(ops.convert_to_tensor(cache.tensor))
    return cache
