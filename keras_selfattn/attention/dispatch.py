"""Which implementation computes a call's attention.

Every implementation has one signature,

    fn(query, key, value, masks, *, scale, dropout, return_weights)
        -> (output, weights or None)

with query, key, value and output in the head layout the implementation
declares (`heads.TIME_FIRST` or `heads.HEADS_FIRST`), weights
`(B, H, Tq, Tk)` and `masks` a `Masks`; `IMPLEMENTATIONS` says what each
supports (an implementation with `grouped_key_value` takes key and value
with fewer heads than query, H a multiple of theirs). `choose` picks one
from the call's static facts only (backend, device, masks present, dropout
in training, returned weights, `chunk_size`, `flash_attention`, whether
PyTorch is tracing it for export), never from tensor values, so a traced or
exported call takes one fixed path.

While PyTorch traces a call for export, the path taken is one its exporters
convert for every length: the fused path with key and value repeated to the
query's heads (they refuse `enable_gqa=True`), and the explicit path in place
of the chunked one (whose blocks are a Python loop on PyTorch, which a trace
would unroll at the traced length). Both compute the same numbers.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import Callable, Iterator

import keras

from keras_selfattn.attention import chunked, explicit, fused, heads
from keras_selfattn.attention import masks as masks_lib
from keras_selfattn.attention.masks import Masks


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
class Implementation:
    """One attention implementation and what it supports."""

    name: str
    fn: Callable
    layout: str  # heads.TIME_FIRST or heads.HEADS_FIRST
    returns_weights: bool
    dropout: bool
    attention_mask: bool
    memory: str  # how its peak memory grows with time T
    # Whether key and value may have fewer heads than query (each shared by
    # a group of consecutive query heads); else the layer repeats them.
    grouped_key_value: bool = False


IMPLEMENTATIONS = {
    "explicit": Implementation(
        "explicit",
        explicit.explicit_attention,
        heads.HEADS_FIRST,
        True,
        True,
        True,
        "O(T^2)",
    ),
    "chunked": Implementation(
        "chunked",
        chunked.chunked_attention,
        heads.HEADS_FIRST,
        False,
        True,
        True,
        "O(chunk_size * T)",
    ),
    "fused": Implementation(
        "fused",
        fused.fused_attention,
        heads.TIME_FIRST,
        False,
        False,
        False,
        "O(T) on a GPU",
        grouped_key_value=True,
    ),
}


# Set by `preferred`: the path calls take wherever it can serve them.
_PREFERRED: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "keras_selfattn_preferred_path", default=None
)
# The block size of the chunked path when `preferred("chunked")` picks it for
# a layer without chunk_size: small, so short test sequences span blocks.
PREFERRED_CHUNK_SIZE = 2


@contextlib.contextmanager
def preferred(name: str) -> Iterator[None]:
    """Within this context, calls take the `name` path wherever it can serve
    them, whatever the layers' `flash_attention` and `chunk_size` say (the
    tests run the numerics suites once per path with it). A call the path
    cannot serve (say, returned scores on the fused path) is chosen as usual.

    Args:
        name: "explicit", "chunked" or "fused".
    """
    if name not in IMPLEMENTATIONS:
        raise ValueError(
            f"`name` must be one of {sorted(IMPLEMENTATIONS)}. Received: name={name!r}"
        )
    token = _PREFERRED.set(name)
    try:
        yield
    finally:
        _PREFERRED.reset(token)


def _chunked(chunk_size: int) -> Implementation:
    implementation = IMPLEMENTATIONS["chunked"]
    return dataclasses.replace(
        implementation, fn=functools.partial(implementation.fn, chunk_size=chunk_size)
    )


def _fused_blockers(
    masks: Masks,
    dropout: bool,
    return_weights: bool,
    same_head_dims: bool,
    float16_on_cpu: bool,
) -> list[str]:
    """Why this call cannot take the fused path (empty: it can)."""
    backend = keras.backend.backend()
    reasons = []
    if backend not in fused.SUPPORTS_SLIDING_WINDOW:
        reasons.append(f"the {backend} backend has no fused attention kernel")
    elif (
        masks.sliding_window is not None and not fused.SUPPORTS_SLIDING_WINDOW[backend]
    ):
        reasons.append(f"the {backend} fused kernel takes no sliding_window")
    elif backend == "jax" and not same_head_dims:
        reasons.append("JAX's kernel needs value_dim equal to key_dim")
    elif backend == "jax" and float16_on_cpu:
        # XLA's CPU dot has no float16 x float16 -> float32 algorithm.
        reasons.append("JAX's kernel takes float16 only on a GPU")
    if return_weights:
        reasons.append("return_attention_scores=True needs the weights")
    if dropout:
        reasons.append("dropout on the weights (in training) needs the weights")
    if masks.attention is not None:
        reasons.append("an attention_mask is not a mask the kernels take")
    return reasons


def _exportable(implementation: Implementation) -> Implementation:
    """The implementation PyTorch's exporters convert for every length, with
    the same numbers (see the module docstring)."""
    if implementation.name == "chunked":
        return IMPLEMENTATIONS["explicit"]
    if implementation.name == "fused":
        return dataclasses.replace(
            implementation,
            fn=functools.partial(implementation.fn, grouped_key_value=False),
            grouped_key_value=False,
        )
    return implementation


def _exportable_while_exporting(choose_fn):
    """`choose_fn`, its choice made exportable while an exporter traces."""

    @functools.wraps(choose_fn)
    def wrapper(*args, **kwargs) -> Implementation:
        implementation = choose_fn(*args, **kwargs)
        return _exportable(implementation) if exporting() else implementation

    return wrapper


@_exportable_while_exporting
def choose(
    masks: Masks,
    *,
    query_on_gpu: bool,
    same_head_dims: bool,
    dtype: str,
    flash_attention: bool | None,
    chunk_size: int | None,
    dropout: bool,
    return_weights: bool,
    layer_name: str,
) -> Implementation:
    """The implementation for one call.

    Args:
        query_on_gpu: Whether the call runs on an accelerator.
        same_head_dims: Whether value_dim equals key_dim.
        dtype: The compute dtype.
        masks: The call's `Masks`.
        flash_attention: The layer's argument: None (automatic: the fused
            path where it applies, unless `keras.config.
            disable_flash_attention()` was called), True (require it) or
            False (never).
        chunk_size: The layer's `chunk_size`.
        dropout: Whether dropout is active in this call.
        return_weights: Whether the weights are returned.
        layer_name: For error messages.

    Returns:
        An `Implementation`.

    Raises:
        ValueError: `flash_attention=True` requires the fused path, and
            this call cannot take it; the message says why.
    """
    float16_on_cpu = dtype == "float16" and not query_on_gpu
    blockers = _fused_blockers(
        masks, dropout, return_weights, same_head_dims, float16_on_cpu
    )
    if not masks_lib.aligned(masks):
        # Decoding with a cache: a few new queries against the cached keys;
        # the chunked path blocks the queries of a whole sequence.
        chunk_size = None
    preference = _PREFERRED.get()
    if preference == "fused" and not blockers:
        return IMPLEMENTATIONS["fused"]
    if preference == "chunked" and not return_weights and masks_lib.aligned(masks):
        return _chunked(chunk_size or PREFERRED_CHUNK_SIZE)
    if preference == "explicit":
        return IMPLEMENTATIONS["explicit"]
    wanted = flash_attention
    if wanted is None:
        wanted = keras.config.is_flash_attention_enabled()
    if wanted and blockers:
        raise ValueError(
            f"SelfAttention '{layer_name}' has flash_attention=True, but this "
            f"call cannot use a fused kernel: {'; '.join(blockers)}. Use "
            "flash_attention=None to fall back to the explicit path where "
            f"needed. Received: flash_attention={flash_attention}, "
            f"backend={keras.backend.backend()!r}"
        )
    use_fused = not blockers and wanted is not False
    if use_fused and wanted is None and chunk_size is not None:
        # chunk_size asks for bounded memory: the fused kernels bound it on a
        # GPU, not on every CPU backend.
        use_fused = query_on_gpu
    if use_fused:
        return IMPLEMENTATIONS["fused"]
    if chunk_size is not None:
        return _chunked(chunk_size)
    return IMPLEMENTATIONS["explicit"]
