"""Score modifications: what changes the scores before the softmax.

One description (`ScoreMods`) of how a call's scaled scores change, read by
every implementation, in one order (docs/layer.md, "Score modifications"):

1. the scaled scores `Q K^T * scale`, in float32;
2. the soft-cap, `cap * tanh(scores / cap)` (Gemma 2);
3. the position bias: ALiBi's `-slope_h * |i - j|` (Bloom, MPT) or T5's
   learned bias of the bucket of `j - i`;
4. the call's `attention_bias`;
5. the masks (padding, `attention_mask`, causal, window, segments), applied
   with a select: a bias never unmasks a key, and a non-finite bias at a
   masked position changes nothing;
6. the softmax, in float32, with one extra logit per head in its
   denominator when the layer has sinks (gpt-oss), which adds no value.

The position biases depend on `key position - query position` only, so they
are built for any block of queries and keys (`bias_block`), as the masks
are: the chunked path builds one block's bias at a time, never (T, T).

Shapes use B = batch, H = heads, Tq = queries, Tk = keys.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
from keras import ops

from keras_selfattn.attention import masks as masks_lib

# The name of each field of `ScoreMods` (`ScoreMods.names`, `CallFacts`).
_NAMES = {
    "soft_cap": "soft_cap",
    "alibi_slopes": "alibi",
    "relative_table": "relative",
    "bias": "attention_bias",
    "sinks": "sinks",
}
# The fields of `ScoreMods` that hold tensors.
_TENSORS = ("relative_table", "bias", "sinks")
# By name: the position biases; every modification that adds a bias to the
# scores; those that carry tensors (which a gradient reaches).
POSITION_BIASES = ("alibi", "relative")
BIASES = (*POSITION_BIASES, "attention_bias")
WITH_TENSORS = tuple(_NAMES[field] for field in _TENSORS)


def alibi_slopes(num_heads: int, alibi_bias_max: float = 8.0) -> tuple[float, ...]:
    """ALiBi's slope of each head, as keras-hub's `AlibiBias` computes them.

    For a power of two n, the geometric sequence starting at and with ratio
    `2 ** (-alibi_bias_max / n)`; otherwise the sequence of the largest power
    of two below `num_heads`, then every other slope of the sequence for
    twice that power, until there are `num_heads`.
    """

    def power_of_two(n: int) -> list[float]:
        start = 2.0 ** (-(2.0 ** -(math.log2(n) - math.log2(alibi_bias_max))))
        return [start * start**i for i in range(n)]

    closest = 2 ** math.floor(math.log2(num_heads))
    slopes = power_of_two(closest)
    if closest < num_heads:
        slopes += power_of_two(2 * closest)[0::2][: num_heads - closest]
    return tuple(slopes)


def relative_buckets(
    num_buckets: int, max_distance: int, bidirectional: bool
) -> np.ndarray:
    """T5's bucket of each relative position `j - i` in `[-max_distance,
    max_distance]`, as an int32 array of `2 * max_distance + 1` entries
    (entry `d + max_distance` is the bucket of `d`).

    T5's formula, in float32 as T5 computes it: with `bidirectional`, half
    the buckets for keys after the query; in each direction, distances below
    half its buckets get a bucket each, longer ones share logarithmically
    wider buckets up to `max_distance`, and every distance from
    `max_distance` on falls in the last bucket: so the buckets of the
    positions past the table's ends are those of its ends.
    """
    relative = np.arange(-max_distance, max_distance + 1, dtype=np.int64)
    buckets = np.zeros_like(relative)
    if bidirectional:
        num_buckets //= 2
        buckets += (relative > 0) * num_buckets
        distance = np.abs(relative)
    else:
        distance = -np.minimum(relative, 0)
    max_exact = num_buckets // 2
    # The distances below max_exact take the exact branch: 1 in their place
    # keeps log(0) out of the other.
    logarithmic = np.maximum(distance, max_exact).astype(np.float32)
    large = max_exact + (
        np.log(logarithmic / np.float32(max_exact))
        / np.float32(math.log(max_distance / max_exact))
        * np.float32(num_buckets - max_exact)
    ).astype(np.int64, copy=False)
    large = np.minimum(large, num_buckets - 1)
    buckets += np.where(distance < max_exact, distance, large)
    return buckets.astype(np.int32)


@dataclasses.dataclass(frozen=True)
class ScoreMods:
    """How one call's scaled scores change before the softmax.

    Attributes:
        soft_cap: None, or the cap of `cap * tanh(scores / cap)`.
        alibi_slopes: None, or ALiBi's slope of each query head.
        relative_table: None, or float `(2 * max_distance + 1, H)`: T5's
            learned bias of each relative position `j - i`, clipped to
            `[-max_distance, max_distance]` (`relative_buckets` gathered).
        max_distance: The clip of `relative_table`.
        bias: None, or the call's float `attention_bias`, broadcastable to
            `(B, H, Tq, Tk)`.
        sinks: None, or float `(H,)`: each head's sink logit.
    """

    soft_cap: float | None = None
    alibi_slopes: tuple[float, ...] | None = None
    relative_table: Any = None
    max_distance: int = 0
    bias: Any = None
    sinks: Any = None

    @property
    def has_position_bias(self) -> bool:
        """Whether it adds a position bias (ALiBi's or T5's)."""
        return self.alibi_slopes is not None or self.relative_table is not None

    @property
    def adds_bias(self) -> bool:
        """Whether a bias is added to the scores (position or call bias)."""
        return self.has_position_bias or self.bias is not None

    @property
    def has_tensors(self) -> bool:
        """Whether it carries tensors (`tensors()`): T5's learned table, the
        sinks, an `attention_bias`; a gradient must reach them."""
        return bool(self.tensors())

    def tensors(self) -> tuple:
        """The tensors it carries, in a fixed order (`with_tensors`)."""
        return tuple(
            getattr(self, name) for name in _TENSORS if getattr(self, name) is not None
        )

    def with_tensors(self, tensors) -> ScoreMods:
        """It with `tensors` (from `tensors()`, e.g. traced) in their place."""
        present = [name for name in _TENSORS if getattr(self, name) is not None]
        return dataclasses.replace(self, **dict(zip(present, tensors, strict=True)))

    @property
    def names(self) -> tuple[str, ...]:
        """The modifications present, for `call_facts.CallFacts`."""
        return tuple(
            name for field, name in _NAMES.items() if getattr(self, field) is not None
        )


def relative_table(weight, num_buckets: int, max_distance: int, bidirectional: bool):
    """T5's learned `(buckets, H)` weight gathered into `(2 * max_distance + 1,
    H)` float32 rows, one per clipped relative position."""
    index = relative_buckets(num_buckets, max_distance, bidirectional)
    return ops.take(ops.cast(weight, "float32"), ops.convert_to_tensor(index), axis=0)


def position_bias(mods: ScoreMods, distance):
    """The position bias of keys `distance` (int32, key position minus query
    position) from their queries: float32 of shape `(H,) + distance.shape`
    (heads first: a block's bias is made in the scores' layout), or None."""
    if mods.alibi_slopes is not None:
        # A tensor: under PyTorch's exporters a numpy operand would be read
        # back from the traced tensor.
        slopes = -np.asarray(mods.alibi_slopes, "float32")
        slopes = ops.convert_to_tensor(
            np.reshape(slopes, (-1,) + (1,) * len(distance.shape))
        )
        return ops.expand_dims(ops.cast(ops.abs(distance), "float32"), 0) * slopes
    if mods.relative_table is not None:
        index = ops.clip(distance, -mods.max_distance, mods.max_distance)
        # Rows gathered along axis 0, then heads moved first: PyTorch's ONNX
        # exporter has no `aten::ravel`, which `take` along axis 1 emits there
        # (a view on PyTorch, fused by XLA).
        rows = ops.take(mods.relative_table, index + mods.max_distance, axis=0)
        rank = len(distance.shape)  # positive axes: no Transpose perm of -1
        return ops.transpose(rows, (rank,) + tuple(range(rank)))
    return None


def bias_block(
    mods: ScoreMods,
    masks: masks_lib.Masks,
    query_start=0,
    key_start=0,
    query_len=None,
    key_len=None,
):
    """The bias of one block of queries and keys, float32 broadcastable to
    `(B, H, query_len, key_len)`, or None: the position bias plus the cut of
    the call's `attention_bias`. Positions as `masks_lib.block` reads them
    (after `query_offset` when decoding)."""
    terms = []
    if mods.has_position_bias:
        query_pos, key_pos = masks_lib.block_positions(
            masks, query_start, key_start, query_len, key_len
        )
        distance = ops.reshape(key_pos, (1, -1)) - ops.reshape(query_pos, (-1, 1))
        terms.append(ops.expand_dims(position_bias(mods, distance), 0))
    if mods.bias is not None:
        bias = ops.cast(mods.bias, "float32")
        for axis, start, length in (
            (2, query_start, query_len),
            (3, key_start, key_len),
        ):
            # A size-1 axis broadcasts over the block; `cut` keeps the rest.
            if bias.shape[axis] != 1 and (length is not None or not _at_zero(start)):
                bias = masks_lib.cut(bias, axis, start, length)
        terms.append(bias)
    if not terms:
        return None
    return terms[0] if len(terms) == 1 else terms[0] + terms[1]


def _at_zero(start) -> bool:
    return isinstance(start, int) and start == 0


def modify(scores, mods: ScoreMods, bias=None):
    """Float32 `scores` soft-capped, then plus `bias` (from `bias_block`)."""
    if mods.soft_cap is not None:
        cap = mods.soft_cap
        scores = ops.tanh(scores * (1.0 / cap)) * cap
    if bias is not None:
        scores = scores + bias
    return scores


def sink_logits(mods: ScoreMods, shape: tuple[int, ...], heads_axis: int):
    """The sinks, float32, reshaped to `shape` ones but the heads axis."""
    shape = [1] * len(shape)
    shape[heads_axis] = -1
    return ops.reshape(ops.cast(mods.sinks, "float32"), shape)
