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
tracing it for export, whether it is made within `exact_unchunked()`), never
by tensor values, so a traced or exported call takes one fixed path. Each
implementation in `IMPLEMENTATIONS` declares what it cannot do, as
(predicate over the facts, reason) pairs, and `choose` takes the first one,
in the order fused, single_query, packed, chunked, explicit, that nothing rules
out; those declarations are the only rules.

While PyTorch traces a call for export, the path taken is one its exporters
convert for every length: the fused path with key and value repeated to the
query's heads (they refuse `enable_gqa=True`), and the explicit path in place
of the chunked one (whose blocks are a Python loop on PyTorch, which a trace
would unroll at the traced length). Both compute the same numbers.

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

import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any

import keras

from keras_selfattn.attention import (
    cache,
    chunked,
    explicit,
    fused,
    heads,
    packed,
    single_query,
)
from keras_selfattn.attention.masks import Masks

# Set within `exact_unchunked()`; a ContextVar, so other threads and
# asyncio tasks that did not enter the context keep the chunked path.
_EXACT_UNCHUNKED: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "keras_selfattn_exact_unchunked", default=False
)


@contextlib.contextmanager
def exact_unchunked() -> Iterator[None]:
    """Within this context, calls take an exact unchunked path, never the
    chunked one.

    For exporters whose format cannot hold the chunked path (a loop over
    blocks): enter it around the tracing of the exported function, so the
    artifact computes attention whole (the fused path where `choose` would
    take it anyway, else the explicit one). The numbers are the chunked
    path's up to float32 rounding; only the memory bound of `chunk_size` is
    given up, in the artifact. Decided while a call is traced, so a traced
    function keeps the path it was traced with (a `tf.function` traced before
    entering keeps the chunked one). It nests, and it holds in the thread (or
    asyncio task) that entered it only.

    Example:

    >>> from keras_selfattn.attention import dispatch  # doctest: +SKIP
    >>> with dispatch.exact_unchunked():  # doctest: +SKIP
    ...     model.export("model.tflite", format="litert")
    """
    token = _EXACT_UNCHUNKED.set(True)
    try:
        yield
    finally:
        _EXACT_UNCHUNKED.reset(token)


def unchunked_requested() -> bool:
    """Whether the call is made within `exact_unchunked()`."""
    return _EXACT_UNCHUNKED.get()


def exporting() -> bool:
    """Whether PyTorch is tracing the call for an exporter.

    `torch.jit.trace` traces Keras's ONNX export with dynamic shapes and its
    OpenVINO export; `torch.export` its `.pt2`, LiteRT and static-shape ONNX
    exports (`torch.compiler.is_exporting()` holds in strict and non-strict
    mode alike). False on the other backends.
    """
    if keras.backend.backend() != "torch":
        return False
    import torch

    return torch.jit.is_tracing() or torch.compiler.is_exporting()


@dataclasses.dataclass(frozen=True)
class CallFacts:
    """The static facts of one call that decide its implementation.

    Attributes:
        backend: The Keras backend.
        dtype: The compute dtype.
        on_gpu: Whether the call runs on an accelerator.
        same_head_dims: Whether value_dim equals key_dim.
        attention_mask: Whether an `attention_mask` is given.
        sliding_window: Whether the layer has a `sliding_window`.
        decoding: Whether the call decodes with a key/value cache.
        single_query: Whether the call has one query, known while tracing.
        dropout: Whether dropout is active in this call.
        return_weights: Whether the weights are returned.
        exporting: Whether PyTorch is tracing the call for export.
        unchunked: Whether the call is made within `exact_unchunked()`.
        chunk_size: The layer's `chunk_size`.
        flash_attention: The layer's `flash_attention`, or where that is
            None, `keras.config.is_flash_attention_enabled()`: None
            (automatic), True (required) or False (never).
        time_major_cache: Whether the call is traced within
            `cache.time_major()` (its keys and values come time-major).
        score_mods: The names of the call's score modifications
            (`score_mods.ScoreMods.names`).
        segments: Whether the call has `segment_ids`.
        training: Whether the call is made in training.
    """

    backend: str
    dtype: str
    on_gpu: bool
    same_head_dims: bool
    attention_mask: bool
    sliding_window: bool
    decoding: bool
    single_query: bool
    dropout: bool
    return_weights: bool
    exporting: bool
    unchunked: bool
    chunk_size: int | None
    flash_attention: bool | None
    time_major_cache: bool
    score_mods: tuple[str, ...] = ()
    segments: bool = False
    training: bool = False

    @classmethod
    def of(
        cls,
        masks: Masks,
        *,
        query_on_gpu: bool,
        single_query: bool,
        same_head_dims: bool,
        dtype: str,
        flash_attention: bool | None,
        chunk_size: int | None,
        dropout: bool,
        return_weights: bool,
        score_mods: tuple[str, ...] = (),
        training: bool = False,
    ) -> CallFacts:
        """The facts of a call with these masks and arguments.

        Args:
            masks: The call's `Masks`.
            query_on_gpu: Whether the call runs on an accelerator.
            single_query: Whether the call has one query (a static time
                of 1).
            same_head_dims: Whether value_dim equals key_dim.
            dtype: The compute dtype.
            flash_attention: The layer's argument: None (automatic: the
                fused path where it applies, unless `keras.config.
                disable_flash_attention()` was called), True (require it)
                or False (never).
            chunk_size: The layer's `chunk_size`.
            dropout: Whether dropout is active in this call.
            return_weights: Whether the weights are returned.
            score_mods: The names of the call's score modifications.
            training: Whether the call is made in training.
        """
        if flash_attention is None:
            flash_attention = keras.config.is_flash_attention_enabled()
        return cls(
            backend=keras.backend.backend(),
            dtype=dtype,
            on_gpu=query_on_gpu,
            same_head_dims=same_head_dims,
            attention_mask=masks.attention is not None,
            sliding_window=masks.sliding_window is not None,
            decoding=masks.decoding,
            single_query=single_query,
            dropout=dropout,
            return_weights=return_weights,
            exporting=exporting(),
            unchunked=unchunked_requested(),
            chunk_size=chunk_size,
            flash_attention=flash_attention,
            time_major_cache=cache.is_time_major(),
            score_mods=score_mods,
            segments=masks.segments is not None,
            training=training,
        )


# What an implementation cannot do: a predicate over the facts, and the
# reason (a `str.format` template over the facts' fields).
Limit = tuple[Callable[[CallFacts], bool], str]


@dataclasses.dataclass(frozen=True)
class Choice:
    """The implementation a call takes, with its arguments from the facts.

    Attributes:
        name: "fused", "single_query", "chunked" or "explicit".
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
        return [
            reason.format(**vars(facts))
            for rules_out, reason in self.cannot
            if rules_out(facts)
        ]

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
    (lambda f: f.chunk_size is None, "the layer has no chunk_size"),
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
# The score modifications that add a bias to the scores.
_BIASES = {"alibi", "relative", "attention_bias"}

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
                    and set(f.score_mods) & _BIASES
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
        ),
        # PyTorch's exporters refuse `enable_gqa=True`: while exporting, the
        # layer repeats key and value to the query's heads instead.
        arguments=lambda f: {"grouped_key_value": not f.exporting},
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
                # Measured on the packing benchmark (benchmarks.score_mods):
                # its training step took 5.5x (TensorFlow) and 1.9x (JAX) the
                # padded batch's time, the chunked path's 1.4x.
                lambda f: f.training,
                "its gradient through the loop over key blocks is slower than "
                "the chunked path's, so training takes that one",
            ),
            *_LOOP_OVER_BLOCKS,
        ),
        arguments=lambda f: {"chunk_size": f.chunk_size},
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
            `flash_attention`, `chunk_size`, `dropout`, `return_weights`).

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
    return next(
        implementation.choice(facts)
        for implementation in IMPLEMENTATIONS.values()
        if not implementation.reasons(facts)
    )
