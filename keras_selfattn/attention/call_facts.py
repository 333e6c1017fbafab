"""The static facts of a call that decide its implementation (`CallFacts`),
the tables of choices over them (`Limit`, `allowed`, `first`), and the
tracing contexts they read: the modes of `keras_selfattn.tracing`
(`exact_unchunked()` its public shortcut), PyTorch's export tracers
(`exporting()`) and whether tensors may have sizes known only when they run
(`sizes_may_vary()`)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable

import keras

from keras_selfattn import tracing
from keras_selfattn.attention.cache import environment
from keras_selfattn.attention.masks import Masks


def exact_unchunked() -> contextlib.AbstractContextManager[None]:
    """Within this context, calls take an exact unchunked path, never the
    chunked one: `tracing.traced_as(tracing.EXACT_UNCHUNKED)`.

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
    return tracing.traced_as(tracing.EXACT_UNCHUNKED)


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


def sizes_may_vary() -> bool:
    """Whether a call made now may hold tensors whose sizes are known only
    when it runs: on PyTorch, and on TensorFlow outside XLA (eager calls, and
    graphs that XLA does not compile)."""
    backend = keras.backend.backend()
    if backend == "torch":
        return True
    if backend != "tensorflow":
        return False
    import tensorflow as tf

    return tf.executing_eagerly() or environment.outside_xla()


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
        unchunked: Whether the call is made in `tracing.EXACT_UNCHUNKED`.
        chunk_size: The layer's `chunk_size`.
        flash_attention: The layer's `flash_attention`, or where that is
            None, `keras.config.is_flash_attention_enabled()`: None
            (automatic), True (required) or False (never).
        time_major_cache: Whether the call decodes with a time-major cache
            (`cache.TimeMajorCache`: its keys and values come time-major).
        score_mods: The names of the call's score modifications
            (`score_mods.ScoreMods.names`).
        segments: Whether the call has `segment_ids`.
        training: Whether the call is made in training.
        time: The call's number of positions where it is known while
            tracing, else None.
        sizes_may_vary: Whether the call is made where tensors may have
            sizes known only when it runs (`sizes_may_vary()`).
        key_padding: Whether the call has a padding mask of its keys.
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
    time: int | None = None
    sizes_may_vary: bool = False
    key_padding: bool = False

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
        time: int | None = None,
        time_major_cache: bool = False,
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
            time: The call's number of positions, a Python int where it is
                known while tracing, else None.
            time_major_cache: Whether it decodes with a time-major cache.
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
            unchunked=tracing.active(tracing.EXACT_UNCHUNKED),
            chunk_size=chunk_size,
            flash_attention=flash_attention,
            time_major_cache=time_major_cache,
            score_mods=score_mods,
            segments=masks.segments is not None,
            training=training,
            time=time,
            sizes_may_vary=sizes_may_vary(),
            key_padding=masks.key_padding is not None,
        )


# What rules a choice out for a call: a predicate over its facts, and the
# reason (a `str.format` template over the facts' fields).
Limit = tuple[Callable[[CallFacts], bool], str]


def reasons(limits: tuple[Limit, ...], facts: CallFacts) -> list[str]:
    """Why `limits` rule a choice out for a call with these facts (empty:
    they do not)."""
    return [
        reason.format(**vars(facts)) for rules_out, reason in limits if rules_out(facts)
    ]


def allowed(table: dict[str, tuple[Limit, ...]], facts: CallFacts) -> list[str]:
    """The names of `table` (in its order) whose limits do not rule them out
    for a call with these facts."""
    return [
        name
        for name, limits in table.items()
        if not any(rules_out(facts) for rules_out, _ in limits)
    ]


def first(table: dict[str, tuple[Limit, ...]], facts: CallFacts) -> str:
    """The first name of `table` that nothing rules out for a call with these
    facts: each room's choices are such tables (the last entry of each has
    no limit)."""
    return next(
        name
        for name, limits in table.items()
        if not any(rules_out(facts) for rules_out, _ in limits)
    )
