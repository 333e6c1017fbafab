"""The packed path where sizes may vary at run time: each sequence alone,
sequences of similar lengths together.

Eager calls and TensorFlow graphs that XLA does not compile take tensors
whose sizes are known only when they run. There a packed row's sequences
(its runs: real positions of one id, one after the other) are taken out of
their rows and attended alone, as a padded batch would attend them, but
grouped by length: the runs whose length rounds up to the same multiple L
of a granule (64 positions, or `chunk_size` when smaller) attend together
in a batch of L positions, on the explicit path. The work follows the sum
of the squares of the runs' lengths, in large products, with no loop: a
graph of a few operations per length class, differentiated as it is
(learned modifications included).

It holds where every id appears in one run per row; `packed_attention`
falls back on `pairs` (any ids) where one does not. The positions
inside a run count from its start: the rules that read them (causal, the
window, ALiBi, T5's buckets) read differences only, so that changes
nothing.

Shapes use B = batch, H = heads, T = time, N = runs, L = a class's length,
K = key_dim, V = value_dim.
"""

from __future__ import annotations

import dataclasses

from keras import ops

from keras_selfattn.attention import explicit
from keras_selfattn.attention import masks as masks_lib

GRANULE = 64


@dataclasses.dataclass(frozen=True)
class Runs:
    """The runs of a call: where each starts (in the flattened `(B T)`
    positions), its length, and whether every id makes one run per row."""

    starts: object
    lengths: object
    one_run_per_id: object

    @classmethod
    def of(cls, segments, key_padding, time: int) -> Runs:
        """The runs of int `segments` (B, T), among the real positions."""
        ids = ops.reshape(ops.cast(segments, "int32"), (-1,))
        if key_padding is None:
            real = ops.ones_like(ids, "bool")
        else:
            real = ops.reshape(ops.cast(key_padding, "bool"), (-1,))
        first = ops.equal(ops.arange(ops.shape(ids)[0], dtype="int32") % time, 0)
        # A position continues the run before it when both are real: a
        # padded position ends a run, even one whose id goes on.
        continues = ops.logical_and(
            ops.logical_and(ops.logical_not(first[1:]), real[1:]),
            ops.logical_and(real[:-1], ops.equal(ids[1:], ids[:-1])),
        )
        continues = ops.concatenate([ops.zeros((1,), "bool"), continues], axis=0)
        begins = ops.logical_and(real, ops.logical_not(continues))
        ends = ops.logical_and(
            real,
            ops.logical_not(
                ops.concatenate([continues[1:], ops.zeros((1,), "bool")], 0)
            ),
        )
        starts = ops.nonzero(begins)[0]
        lengths = ops.nonzero(ends)[0] - starts + 1
        rows, run_ids = starts // time, ops.take(ids, starts)
        same = ops.logical_and(
            ops.equal(ops.expand_dims(rows, 0), ops.expand_dims(rows, 1)),
            ops.equal(ops.expand_dims(run_ids, 0), ops.expand_dims(run_ids, 1)),
        )
        # Only each run with itself.
        one_run = ops.equal(ops.sum(ops.cast(same, "int32")), ops.shape(starts)[0])
        return cls(ops.cast(starts, "int32"), ops.cast(lengths, "int32"), one_run)


def runs_attention(query, key, value, masks, runs: Runs, *, scale, granule, mods):
    """Attention of each run alone.

    Args:
        query: (B, H, T, K).
        key: (B, H, T, K).
        value: (B, H, T, V).
        masks: The call's `Masks` (no `attention`): its causal rule and window
            apply within each run.
        runs: The call's `Runs` (`one_run_per_id` true).
        scale: Multiplier of the raw scores.
        granule: Runs attend in batches of lengths rounded up to this.
        mods: None or a `score_mods.ScoreMods` without `bias`.

    Returns:
        (B, H, T, V); zeros at positions that belong to no run (padding).
    """
    batch, num_heads, time = ops.shape(query)[0], query.shape[1], query.shape[2]

    def flat(x):  # (B, H, T, D) -> (B T, H, D)
        return ops.reshape(ops.transpose(x, (0, 2, 1, 3)), (-1, num_heads, x.shape[3]))

    tensors = (flat(query), flat(key), flat(value))
    classes = (runs.lengths + granule - 1) // granule
    outputs, places = [], []
    for size in range(1, -(-time // granule) + 1):
        length = min(size * granule, time)
        members = ops.nonzero(ops.equal(classes, size))[0]
        if members.shape[0] == 0:
            continue  # known while running eagerly: Keras takes no empty max
        starts = ops.take(runs.starts, members)
        offsets = masks_lib.positions(length)
        valid = ops.expand_dims(offsets, 0) < ops.expand_dims(
            ops.take(runs.lengths, members), 1
        )
        index = ops.expand_dims(starts, 1) + ops.where(valid, offsets, 0)  # (n, L)
        q, k, v = (
            ops.transpose(ops.take(x, index, axis=0), (0, 2, 1, 3)) for x in tensors
        )
        run_masks = masks_lib.Masks(
            key_padding=valid,
            causal=masks.causal,
            sliding_window=masks.sliding_window,
        )
        output, _ = explicit.explicit_attention(
            q, k, v, run_masks, scale=scale, mods=mods
        )
        output = ops.transpose(output, (0, 2, 1, 3))  # (n, L, H, V)
        output = ops.where(ops.expand_dims(valid, (2, 3)), output, 0)
        outputs.append(ops.reshape(output, (-1, num_heads, value.shape[3])))
        places.append(ops.reshape(index, (-1,)))
    if not outputs:
        return ops.zeros_like(value)  # no run: every position is padding
    summed = ops.segment_sum(
        ops.concatenate(outputs, axis=0),
        ops.concatenate(places, axis=0),
        num_segments=batch * time,
    )
    summed = ops.reshape(summed, (batch, time, num_heads, value.shape[3]))
    return ops.transpose(summed, (0, 2, 1, 3))
