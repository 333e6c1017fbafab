"""Which implementation computes a call's attention.

Every implementation has one signature,

    fn(query, key, value, masks, *, scale, dropout, return_weights, mods)
        -> (output, weights or None)

with query, key, value and output in the head layout the implementation
declares (`heads.TIME_FIRST` or `heads.HEADS_FIRST`), weights
`(B, H, Tq, Tk)`, `masks` a `Masks` and `mods` None or a
`score_mods.ScoreMods`.

A call is described once, by its static facts (`CallFacts`: backend, dtype,
device, masks present, decoding, one query, dropout in training, returned
weights, the layer's `chunk_size` and `flash_attention`, whether PyTorch is
tracing it for export, whether it is made within `exact_unchunked()`, its
time where known while tracing, whether sizes may vary where it runs),
never by tensor values, so a traced or exported call takes one fixed path.
There are five paths: fused, single_query, packed, chunked and explicit.
Each implementation in `IMPLEMENTATIONS` declares what it cannot do, as
(predicate over the facts, reason) pairs (`call_facts.Limit`), and `choose`
takes the first one, in that order, that nothing rules out.

Each room declares its own choices the same way, in tables of limits that
read only `CallFacts`, the first entry that nothing rules out taken
(`call_facts.first`): `packed.STRATEGIES` and `packed.GRADIENTS` (how
packed rows are attended, and the loop's gradient), `fused.VARIANTS` and
`fused.JAX_KERNELS` (which kernel call, with which masks); a cache's write
is its class's (`cache.layouts`), built by the caller. What only the tensors
tell (a batch's right-padding, a bias that requires grad, whether every
segment id makes one run) is decided at run time, within the entry the
table chose, which falls back to the next one.

While PyTorch traces a call for export, the path taken is one its exporters
convert for every length: the fused path with key and value repeated to the
query's heads (they refuse `enable_gqa=True`), and the explicit path in place
of the chunked one (whose blocks are a Python loop on PyTorch, which a trace
would unroll at the traced length). Both compute the same numbers.

A call with `segment_ids` takes the packed path with `chunk_size`, and
without it (the layer's default) on a CPU where its rows have at least
`packed.MIN_DEFAULT_TIME` positions, known while tracing: its blocks then
have `packed.default_block(time)` positions. The fused path gives way to it
there.

`chunk_size` is a memory option of the layer, not a property of its
function: within `exact_unchunked()` every call traced takes an exact
unchunked path (fused where it serves the call, else explicit) instead of
the chunked one. An exporter whose format cannot hold the chunked path's
loop enters it around tracing: the LiteRT converter cannot convert
`tf.map_fn`'s while loop and TensorList ops to builtin LiteRT ops (the file
would need the Flex delegate, "Select TensorFlow op(s)"), so the LiteRT
export traces the unchunked path, as PyTorch's exporters already do. Keras's
own calls (training, inference, `predict`) keep the chunked path.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

from keras_selfattn.attention import (
    chunked,
    explicit,
    fused,
    heads,
    packed,
    score_mods,
    single_query,
)
from keras_selfattn.attention.call_facts import (
    CallFacts,
    Limit,
    exact_unchunked,
    exporting,
    reasons,
)
from keras_selfattn.attention.masks import Masks

__all__ = [
    "IMPLEMENTATIONS",
    "CallFacts",
    "Choice",
    "Implementation",
    "choose",
    "exact_unchunked",
    "exporting",
]


@dataclasses.dataclass(frozen=True)
class Choice:
    """The implementation a call takes, with its arguments from the facts.

    Attributes:
        name: One of the five paths: "fused", "single_query", "packed",
            "chunked" or "explicit".
        fn: The implementation, called with the signature above.
        layout: `heads.TIME_FIRST` or `heads.HEADS_FIRST`.
        grouped_key_value: Whether key and value may have fewer heads than
            query (each shared by a group of consecutive query heads); else
            the layer repeats them.
    """

    name: str
    fn: Callable
    layout: str
    grouped_key_value: bool


def _no_arguments(facts: CallFacts) -> dict[str, Any]:
    return {}


@dataclasses.dataclass(frozen=True)
class Implementation:
    """One attention implementation and what it cannot do.

    Attributes:
        name: Its name, as `SelfAttention.implementation` reports it.
        fn: The implementation.
        layout: The head layout of its query, key, value and output.
        cannot: The `Limit`s that rule it out for a call.
        arguments: The keyword arguments `fn` takes from the facts; a
            `grouped_key_value=True` among them means key and value keep
            fewer heads than query.
    """

    name: str
    fn: Callable
    layout: str
    cannot: tuple[Limit, ...] = ()
    arguments: Callable[[CallFacts], dict[str, Any]] = _no_arguments

    def reasons(self, facts: CallFacts) -> list[str]:
        """Why it cannot serve a call with these facts (empty: it can)."""
        return reasons(self.cannot, facts)

    def choice(self, facts: CallFacts) -> Choice:
        """It, as a call with these facts takes it."""
        arguments = self.arguments(facts)
        return Choice(
            self.name,
            functools.partial(self.fn, **arguments) if arguments else self.fn,
            self.layout,
            grouped_key_value=bool(arguments.get("grouped_key_value")),
        )


_WEIGHTS = "return_attention_scores=True needs the weights"
# What the paths with a loop over blocks (packed, chunked) cannot do.
_LOOP_OVER_BLOCKS: tuple[Limit, ...] = (
    (lambda f: f.return_weights, _WEIGHTS),
    (
        lambda f: f.exporting,
        "PyTorch's exporters would unroll its blocks at the traced length",
    ),
    (
        lambda f: f.unchunked,
        "the call is traced within exact_unchunked(), for a format "
        "that cannot hold its loop over blocks",
    ),
)


def _packed_serves(facts: CallFacts) -> bool:
    """Whether the packed path takes a call with these facts."""
    return not IMPLEMENTATIONS["packed"].reasons(facts)


# In the order `choose` prefers them.
IMPLEMENTATIONS = {
    "fused": Implementation(
        "fused",
        fused.fused_attention,
        heads.TIME_FIRST,
        cannot=(
            (
                lambda f: f.backend not in ("jax", "torch"),
                "the {backend} backend has no fused attention kernel",
            ),
            (
                lambda f: f.backend == "torch" and f.sliding_window,
                "the {backend} fused kernel takes no sliding_window",
            ),
            (
                lambda f: f.backend == "jax" and not f.same_head_dims,
                "JAX's kernel needs value_dim equal to key_dim",
            ),
            (
                # XLA's CPU dot has no float16 x float16 -> float32 algorithm.
                lambda f: f.backend == "jax" and f.dtype == "float16" and not f.on_gpu,
                "JAX's kernel takes float16 only on a GPU",
            ),
            (lambda f: f.return_weights, _WEIGHTS),
            (
                lambda f: f.dropout,
                "dropout on the weights (in training) needs the weights",
            ),
            (
                lambda f: {"soft_cap", "sinks"} & set(f.score_mods),
                "the kernels take no logit_soft_cap and no sinks",
            ),
            (
                lambda f: (
                    f.backend == "torch"
                    and f.dtype != "float32"
                    and set(f.score_mods) & set(score_mods.BIASES)
                ),
                "PyTorch's kernel would add the bias in {dtype}, not float32",
            ),
            (
                lambda f: f.attention_mask,
                "an attention_mask is not a mask the kernels take",
            ),
            (lambda f: f.flash_attention is False, "flash_attention=False"),
            (
                # chunk_size asks for bounded memory: the fused kernels bound
                # it on a GPU, not on every CPU backend.
                lambda f: (
                    f.flash_attention is None
                    and f.chunk_size is not None
                    and not f.decoding
                    and not f.on_gpu
                ),
                "chunk_size bounds memory, which the fused kernels do on a GPU only",
            ),
            (
                # The packing benchmark's training step without chunk_size
                # (docs/layer.md, "Packing short sequences"): on JAX faster
                # than the padded batch on the packed path, slower on the
                # fused one.
                lambda f: (
                    f.flash_attention is None
                    and f.chunk_size is None
                    and f.segments
                    and _packed_serves(f)
                ),
                "the packed path attends segment_ids, skipping the keys of "
                "other segments",
            ),
        ),
        # PyTorch's exporters refuse `enable_gqa=True`: while exporting, the
        # layer repeats key and value to the query's heads instead.
        arguments=lambda f: {"grouped_key_value": not f.exporting, "facts": f},
    ),
    "single_query": Implementation(
        "single_query",
        single_query.single_query_attention,
        heads.TIME_FIRST,
        cannot=(
            (
                lambda f: not (f.decoding and f.single_query),
                "it serves a decoding call with one query, known while tracing",
            ),
            (lambda f: f.return_weights, _WEIGHTS),
            (lambda f: f.dropout, "it applies no dropout"),
            (lambda f: f.attention_mask, "it takes no attention_mask"),
            (
                lambda f: "attention_bias" in f.score_mods,
                "it takes no attention_bias",
            ),
        ),
        arguments=lambda f: {
            "grouped_key_value": True,
            "time_major": f.time_major_cache,
        },
    ),
    "packed": Implementation(
        "packed",
        packed.packed_attention,
        heads.HEADS_FIRST,
        cannot=(
            (lambda f: not f.segments, "the call has no segment_ids"),
            (lambda f: f.dropout, "it applies no dropout"),
            (
                # The packing benchmark (benchmarks.score_mods, its results
                # file): with the gradient through its loop, its training
                # step is slower than the chunked path's.
                lambda f: f.training and not packed.trains_without_its_loop(f),
                "in training its gradient would go through its loop over key "
                "blocks, slower than the chunked path's, so training takes "
                "that one",
            ),
            (
                lambda f: f.chunk_size is None and f.on_gpu,
                "without chunk_size, an accelerator attends packed rows whole",
            ),
            (
                lambda f: (
                    f.chunk_size is None
                    and (f.time is None or f.time < packed.MIN_DEFAULT_TIME)
                ),
                "without chunk_size, rows shorter than "
                f"{packed.MIN_DEFAULT_TIME} positions (or of a length known "
                "only at run time) are attended whole, faster",
            ),
            *_LOOP_OVER_BLOCKS,
        ),
        # None (the layer's default): a block chosen from the time axis.
        arguments=lambda f: {"chunk_size": f.chunk_size, "facts": f},
    ),
    "chunked": Implementation(
        "chunked",
        chunked.chunked_attention,
        heads.HEADS_FIRST,
        cannot=(
            (
                lambda f: f.decoding,
                "decoding with a cache attends a few new queries, not the "
                "blocks of a whole sequence",
            ),
            (lambda f: f.chunk_size is None, "the layer has no chunk_size"),
            *_LOOP_OVER_BLOCKS,
        ),
        arguments=lambda f: {"chunk_size": f.chunk_size},
    ),
    "explicit": Implementation(
        "explicit", explicit.explicit_attention, heads.HEADS_FIRST
    ),
}


def choose(masks: Masks, *, layer_name: str, **arguments: Any) -> Choice:
    """The implementation for one call: the first in `IMPLEMENTATIONS` that
    no `Limit` rules out.

    Args:
        masks: The call's `Masks`.
        layer_name: For error messages.
        **arguments: The rest of the call's facts, as `CallFacts.of` takes
            them (`query_on_gpu`, `same_head_dims`, `dtype`,
            `flash_attention`, `chunk_size`, `dropout`, `return_weights`,
            `time`, ...).

    Returns:
        A `Choice`.

    Raises:
        ValueError: `flash_attention=True` requires the fused path, and
            this call cannot take it; the message says why.
    """
    facts = CallFacts.of(masks, **arguments)
    if facts.flash_attention:
        reasons = IMPLEMENTATIONS["fused"].reasons(facts)
        if reasons:
            raise ValueError(
                f"SelfAttention '{layer_name}' has flash_attention=True, but "
                f"this call cannot use a fused kernel: {'; '.join(reasons)}. "
                "Use flash_attention=None to fall back to the explicit path "
                "where needed. Received: "
                f"flash_attention={arguments['flash_attention']}, "
                f"backend={facts.backend!r}"
            )
    return _first(facts)


@functools.lru_cache(maxsize=256)
def _first(facts: CallFacts) -> Choice:
    """The first implementation no limit rules out, found once per set of
    facts (they are static): an eager call would otherwise test every limit,
    and format the reasons of those that rule a path out, each time."""
    return next(
        implementation.choice(facts)
        for implementation in IMPLEMENTATIONS.values()
        if not implementation.reasons(facts)
    )
