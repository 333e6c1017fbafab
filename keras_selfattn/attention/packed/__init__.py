"""The packed path: blocks of queries that skip the keys no query shares a
segment with.

A row packed with several sequences (`segment_ids`) attends within each
sequence only, so most of its (T, T) scores are masked: computed in full, a
packed row of 2048 costs as much as four rows of 1024 padded. Here each row's
queries go `chunk_size` at a time (without one, a block chosen from the time
axis: `default_block`), and each block of queries visits the key blocks of
the same size in turn with an online softmax (running maximum,
running denominator, running sum of weighted values, all in float32),
computing only the key blocks whose range of segment ids meets the query
block's (`blocks`): the work follows the sum of the squares of the
sequences' lengths, not the square of the row's. The skipped blocks are
exactly those where no query and key can share an id, so the result is the
explicit path's up to float rounding, for any ids (contiguous sequences skip
the most).

How a call's rows are attended is chosen by a table, `STRATEGIES`, from the
call's `CallFacts` (as `dispatch.IMPLEMENTATIONS` chooses the path), the
first that nothing rules out:

- `chunked`: a time known only at run time (or none): the chunked path's
  loop (`chunked.chunked_attention`);
- `runs` (`runs`): where sizes may vary at run time, with no
  `attention_mask` or `attention_bias`, each sequence alone, batched by
  length; it holds where every id makes one run per row, which only the
  ids' values tell: where one does not, the call takes the next, `pairs`
  (an `ops.cond`);
- `pairs` (`pairs`): likewise, every pair of blocks that meets, at once,
  for any ids;
- `loop` (`loop`): rows one at a time (so one row's sequences never make
  another's blocks run), in a sequential map over (row, query block); the
  key blocks in a loop of a fixed count whose skipped steps do no work
  (`ops.cond`).

The loop's gradient is chosen by a second table, `GRADIENTS`: its `own`,
FlashAttention's written out (`own_gradient`), which keeps each query's
log-sum-exp and visits the same blocks again, so no loop is differentiated;
or, where a modification carries a tensor (relative bias, sinks, an
`attention_bias`) or on PyTorch (Keras has no custom gradient there),
`rematerialized`: the backward pass differentiates the loop, recomputing
each query block (`keras.remat`). The runs' and pairs' operations each have
their own gradient. As in the chunked path, the last block starts at T - C;
the keys it shares with the block before it are masked out of it, so no key
is counted twice.

Shapes use B = batch, H = heads, T = time, C = block, K = key_dim,
V = value_dim.
"""

from __future__ import annotations

import math

from keras import ops

from keras_selfattn.attention import chunked, score_mods
from keras_selfattn.attention.call_facts import CallFacts, Limit, first
from keras_selfattn.attention.packed import loop, pairs, runs
from keras_selfattn.attention.packed.blocks import Packing, in_blocks

# Without `chunk_size` (the layer's default), rows of fewer positions attend
# whole (the fused or explicit path): there the packed path's blocks cost
# more than the other segments' keys they skip.
MIN_DEFAULT_TIME = 256

# What rules out gathering the runs or the pairs of blocks.
_GATHERED: tuple[Limit, ...] = (
    (
        lambda f: not f.sizes_may_vary,
        "sizes are static where it runs (XLA, JAX): the loop over key blocks",
    ),
    (
        lambda f: f.attention_mask,
        "an attention_mask is cut per pair of blocks, not gathered",
    ),
    (
        lambda f: "attention_bias" in f.score_mods,
        "an attention_bias is cut per pair of blocks, not gathered",
    ),
)
# How a call's packed rows are attended, in the order `packed_attention`
# prefers them: the first that nothing rules out.
STRATEGIES: dict[str, tuple[Limit, ...]] = {
    "chunked": (
        (
            lambda f: f.time is not None and f.time != 0,
            "its time is known while tracing: its rows are cut in blocks",
        ),
    ),
    # Only where every id makes one run per row (known at run time): else
    # the call takes the next, `pairs`, whose limits are the same.
    "runs": _GATHERED,
    "pairs": _GATHERED,
    "loop": (),
}
# The loop's gradient, the first that nothing rules out.
GRADIENTS: dict[str, tuple[Limit, ...]] = {
    "own": (
        (lambda f: f.backend == "torch", "Keras has no custom gradient on PyTorch"),
        (
            lambda f: bool(set(f.score_mods) & set(score_mods.WITH_TENSORS)),
            "a modification carries a tensor the gradient must reach",
        ),
    ),
    "rematerialized": (),
}


def default_block(time: int) -> int:
    """The block of a call of `time` positions without `chunk_size`: the
    power of two nearest the cube root of 256 T (32 at T = 256, 64 from 512
    to 2048, 128 from 4096 to 16384).

    The steps of the loop over key blocks grow as (T / C) ** 2, the work of
    the keys of other segments it cannot skip as C * T: the block that
    balances them grows as T ** (1/3). The constant comes from the packing
    benchmark (benchmarks/README.md, "Packing").
    """
    return min(time, 2 ** round(math.log2(256 * time) / 3))


def trains_without_its_loop(facts: CallFacts) -> bool:
    """Whether a call in training gets a gradient that differentiates no loop
    over key blocks: where sizes may vary, the runs' or pairs' (nothing in
    `STRATEGIES` rules them out); where they are static, the loop's `own`
    (`GRADIENTS`)."""
    if facts.sizes_may_vary:
        return not any(rules_out(facts) for rules_out, _ in _GATHERED)
    return first(GRADIENTS, facts) == "own"


def packed_attention(
    query,
    key,
    value,
    masks,
    *,
    scale,
    chunk_size,
    facts: CallFacts,
    dropout=None,
    return_weights=False,
    mods=None,
):
    """Attention of packed rows, skipping key blocks of other segments.

    Args:
        query: (B, H, T, K).
        key: (B, H, T, K).
        value: (B, H, T, V).
        masks: A `Masks` with `segments`.
        scale: Multiplier of the raw scores.
        chunk_size: Queries (and keys) per block (C), or None (the layer's
            default, a `time` known while tracing): `default_block(time)`.
        facts: The call's `CallFacts`, which choose its `STRATEGIES` and
            `GRADIENTS`.
        dropout: Must be None (`dispatch` rules the path out with dropout).
        return_weights: Must be False.
        mods: None or a `score_mods.ScoreMods`.

    Returns:
        Tuple (output (B, H, T, V), None), the explicit path's output. A
        query with no key to attend outputs zeros.
    """
    del dropout, return_weights  # see Args
    time = query.shape[2]
    if chunk_size is None:
        chunk_size = default_block(time)
    strategy = first(STRATEGIES, facts)
    if strategy == "chunked":
        return chunked.chunked_attention(
            query, key, value, masks, scale=scale, chunk_size=chunk_size, mods=mods
        )
    tensors = (query, key, value)
    packing = Packing.of(masks, mods, scale, time, chunk_size)
    if strategy == "loop":
        gradient = first(GRADIENTS, facts)

        def attend(packing, blocks):
            return loop.loop_attention(packing, blocks, gradient)

        return in_blocks(packing, tensors, attend), None
    call_runs = runs.Runs.of(masks.segments, masks.key_padding, time)

    def by_runs():
        return runs.runs_attention(
            query,
            key,
            value,
            masks,
            call_runs,
            scale=scale,
            granule=min(runs.GRANULE, chunk_size),
            mods=mods,
        )

    def by_pairs():
        return in_blocks(packing, tensors, pairs.pairs_attention)

    return ops.cond(call_runs.one_run_per_id, by_runs, by_pairs), None
