"""The packed path's blocks: which key blocks a query block visits, and the
scores of one pair of blocks, read by its strategies (`loop`, `pairs`) and
the loop's own gradient (`own_gradient`) alike.

A packed row is cut into n blocks of C positions (the last one starts at
T - C). The blocks of queries, keys and values are stacked `(B n, H, C, D)`:
block i of row b at b * n + i. Two blocks meet when the ranges of the
segment ids of their real positions overlap: only then can a query of one
attend a key of the other.

Shapes use B = batch, H = heads, T = time, C = block, D = a head's size.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import keras
from keras import ops

from keras_selfattn.attention import chunked, explicit, score_mods
from keras_selfattn.attention import masks as masks_lib

_NO_ID = 2**31 - 1


def row_of(x, row):
    """`x[row:row + 1]` along axis 0, or x when its batch axis is 1."""
    if x is None or x.shape[0] == 1:
        return x
    sizes = list(ops.shape(x))
    sizes[0] = 1
    return ops.slice(x, (row,) + (0,) * (len(x.shape) - 1), sizes)


def fori_loop(count: int, body, state):
    """`body(i, state)` for i in 0 .. count - 1: on TensorFlow a while loop
    with its maximum set, whose gradient XLA compiles; elsewhere
    `ops.fori_loop` (on JAX a scan, which reverse-mode differentiates)."""
    if keras.backend.backend() != "tensorflow":
        return ops.fori_loop(0, count, body, state)
    import tensorflow as tf

    return tf.while_loop(
        lambda i, state: i < count,
        lambda i, state: (i + 1, body(i, state)),
        (tf.constant(0), state),
        maximum_iterations=count,
    )[1]


@dataclasses.dataclass(frozen=True)
class Packing:
    """How one call's packed rows are cut into blocks.

    Attributes:
        masks: The call's `Masks` (with `segments`).
        mods: None or the call's `score_mods.ScoreMods`.
        scale: Multiplier of the raw scores.
        block: Positions per block (C).
        starts: Each block's first position.
        low, high: int32 `(B, n)`: each block's lowest and highest id among
            its real positions (a block of padding alone: an empty range).
    """

    masks: masks_lib.Masks
    mods: score_mods.ScoreMods | None
    scale: float
    block: int
    starts: tuple[int, ...]
    low: Any
    high: Any

    @classmethod
    def of(cls, masks, mods, scale, time: int, chunk_size: int) -> Packing:
        """The blocks of a call of `time` positions, `chunk_size` a block."""
        block = min(chunk_size, time)
        starts = tuple(min(i * block, time - block) for i in range(-(-time // block)))
        segments = ops.cast(masks.segments, "int32")
        low, high = segments, segments
        if masks.key_padding is not None:
            real = ops.cast(masks.key_padding, "bool")
            low = ops.where(real, segments, _NO_ID)
            high = ops.where(real, segments, -_NO_ID)

        def per_block(ids):
            return ops.stack([ids[:, s : s + block] for s in starts], axis=1)

        return cls(
            masks,
            mods,
            scale,
            block,
            starts,
            ops.min(per_block(low), axis=-1),
            ops.max(per_block(high), axis=-1),
        )

    @property
    def num_blocks(self) -> int:
        """n, the blocks of a row."""
        return len(self.starts)

    def blocked(self, x):
        """(B, H, T, D) -> (B n, H, C, D). A block is then taken whole (a
        gather), not sliced out of the sequence."""
        parts = ops.stack([x[:, :, s : s + self.block] for s in self.starts], axis=1)
        return ops.reshape(parts, (-1, x.shape[1], self.block, x.shape[3]))

    def blocked_ids(self, ids):
        """(B, T) -> (B n, C), as `blocked` cuts the sequences."""
        parts = ops.stack([ids[:, s : s + self.block] for s in self.starts], axis=1)
        return ops.reshape(parts, (-1, self.block))

    def meeting(self):
        """Bool `(B, n, n)`: whether query block i and key block j of row b
        share an id, at `[b, i, j]`."""
        low, high = self.low, self.high
        return ops.logical_and(
            ops.expand_dims(low, 1) <= ops.expand_dims(high, 2),
            ops.expand_dims(high, 1) >= ops.expand_dims(low, 2),
        )

    def for_row(
        self, row, mods: score_mods.ScoreMods | None
    ) -> tuple[masks_lib.Masks, score_mods.ScoreMods | None]:
        """The masks of one row, and `mods` (the call's, or the same with
        traced tensors) with the row's cut of the `attention_bias`."""
        masks = dataclasses.replace(
            self.masks,
            key_padding=row_of(self.masks.key_padding, row),
            attention=row_of(self.masks.attention, row),
            segments=row_of(self.masks.segments, row),
        )
        if mods is not None and mods.bias is not None:
            mods = dataclasses.replace(mods, bias=row_of(mods.bias, row))
        return masks, mods

    def meets(self, row, query_block, key_block):
        """Bool scalar: whether the two blocks of `row` share an id."""
        return ops.logical_and(
            self.low[row, key_block] <= self.high[row, query_block],
            self.high[row, key_block] >= self.low[row, query_block],
        )

    def scores(self, queries, keys, row_masks, row_mods, query_block, key_block):
        """The modified float32 scores `(1, H, C, C)` of a pair of blocks,
        MASK_VALUE where masked; their mask; and the soft-cap's derivative
        (`1 - tanh(raw / cap) ** 2`, for the gradient) or None. Keys of the
        last block that the block before it covered are masked: none is
        counted twice."""
        starts = ops.convert_to_tensor(self.starts, "int32")
        query_start = ops.take(starts, query_block)
        key_start = ops.take(starts, key_block)
        scores = ops.cast(
            explicit.attention_scores(queries, keys, self.scale), "float32"
        )
        mask = masks_lib.block(
            row_masks, query_start, key_start, self.block, self.block
        )
        fresh = ops.reshape(
            key_start + masks_lib.positions(self.block) >= key_block * self.block,
            (1, 1, 1, -1),
        )
        mask = fresh if mask is None else ops.logical_and(mask, fresh)
        slope = None
        if row_mods is not None:
            if row_mods.soft_cap is not None:
                slope = 1.0 - ops.square(ops.tanh(scores * (1.0 / row_mods.soft_cap)))
            bias = score_mods.bias_block(
                row_mods, row_masks, query_start, key_start, self.block, self.block
            )
            scores = score_mods.modify(scores, row_mods, bias)
        return ops.where(mask, scores, explicit.MASK_VALUE), mask, slope


def in_blocks(packing: Packing, tensors, attend):
    """`attend(packing, blocks)` on the blocks of `tensors` (the queries, keys
    and values `(B, H, T, D)`), assembled `(B, H, T, V)`."""
    query, _, value = tensors
    outputs = attend(packing, tuple(packing.blocked(x) for x in tensors))
    num_blocks, num_heads, value_dim = (
        packing.num_blocks,
        query.shape[1],
        value.shape[3],
    )
    outputs = ops.reshape(
        outputs, (-1, num_blocks, num_heads, packing.block, value_dim)
    )
    outputs = ops.transpose(outputs, (1, 0, 2, 3, 4))  # (n, B, H, C, V)
    return chunked.assemble(outputs, query.shape[2], packing.block, num_blocks)
