"""The decoding scope: key/value caches that SelfAttention layers find
wherever they sit in a model.

A decoding run (`generation.cached_model.run_cached`: `generate`, the
exported decoding steps and generators) calls the model the way its user
does, `model(new_positions)`, inside a `Scope`. Each SelfAttention layer
called within it, top-level or inside a subclassed layer, a nested model or
a subclassed `keras.Model`, takes its own cache object from the scope
(`attention.cache.layouts`, under the layer's stable key:
`cached_model.layer_names`, which survives a reload or a clone), runs
the new positions against it and leaves the updated cache there for the
caller; its output is what the full forward pass computes at
those positions. Nothing walks the model's graph, so code the package does
not own decodes as long as it hands each SelfAttention one tensor.

Position layers read the new positions' indices from the scope
(`positions`): `keras_selfattn.PositionEmbedding` directly, keras-hub's
through their `positions` argument (`generation.position_layers`).

A scope holds only in the thread (or asyncio task) that entered it, and a
traced graph keeps what it was traced with, as `tracing`'s modes do.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import inspect
from collections.abc import Callable, Iterator, Mapping

from keras_selfattn._keras_private import set_keras_mask

# SelfAttention's call arguments that a decoding step cannot apply to its
# cache.
_REFUSED = (
    "attention_mask",
    "return_attention_scores",
    "attention_bias",
    "segment_ids",
)


# The names of each layer class's `call` parameters, after `self` (a plain
# dict: torch.compile warns about a `functools.cache` it traces through).
_PARAMETERS: dict[type, tuple[str, ...]] = {}


def _parameters(layer_class: type) -> tuple[str, ...]:
    names = _PARAMETERS.get(layer_class)
    if names is None:
        names = tuple(inspect.signature(layer_class.call).parameters)[1:]
        _PARAMETERS[layer_class] = names
    return names


def call_arguments(layer, args: tuple, kwargs: Mapping) -> dict:
    """The arguments of a call of `layer`, by the names of its `call`'s
    parameters (those given only)."""
    arguments = dict(zip(_parameters(type(layer)), args, strict=False))
    arguments.update(kwargs)
    return arguments


@dataclasses.dataclass
class Scope:
    """One decoding run over new positions.

    Attributes:
        caches: The cache object (`attention.cache.Cache`) each SelfAttention
            layer reads, by the layer's stable key.
        keys: Each layer's stable key, by the layer (the layer objects of
            this run; the key names it in errors).
        index: The first new position's cache slot (int or int32 scalar).
        padding: Optional bool `(batch, max_length)`, True where a cache
            slot holds a token: every layer's `mask`.
        make_positions: Computes `positions` (only for a model with a
            position layer: a step without one holds no such ops).
        updated: The caches the layers returned, by stable key.
        refusal: The one-line reason a layer refused to decode, kept for
            the caller (Keras rewrites errors raised inside layer calls
            into several lines).
    """

    caches: dict
    keys: Mapping
    index: object
    padding: object
    make_positions: Callable[[], object]
    updated: dict = dataclasses.field(default_factory=dict)
    refusal: str | None = None
    _positions: object = None

    @property
    def positions(self):
        """int32 `(batch or 1, new)`: each new position's index in its own
        row (the slot less the slot of the row's first token)."""
        if self._positions is None:
            self._positions = self.make_positions()
        return self._positions


_SCOPE: contextvars.ContextVar[Scope | None] = contextvars.ContextVar(
    "keras_selfattn_decoding_scope", default=None
)


@contextlib.contextmanager
def decoding(scope: Scope) -> Iterator[Scope]:
    """Within this context, SelfAttention calls decode against `scope`."""
    token = _SCOPE.set(scope)
    try:
        yield scope
    finally:
        _SCOPE.reset(token)


def active() -> Scope | None:
    """The scope calls made now decode in, or None."""
    return _SCOPE.get()


def attend(layer, call: Callable, args: tuple, kwargs: dict):
    """Runs `layer` (a SelfAttention) on the active scope's new positions.

    Args:
        layer: The SelfAttention layer being called.
        call: Calls the layer with explicit cache arguments
            (`layer.__call__`), returning `(output, cache)`.
        args, kwargs: The arguments the model's code passed.

    Returns:
        The layer's output at the new positions; the updated cache is left
        in the scope.

    Raises:
        ValueError: (one line) for a layer the run holds no cache for, a
            second call of one layer in a step, or call arguments a step
            cannot apply to the cache.
    """
    scope = _SCOPE.get()
    key = scope.keys.get(layer)
    if key is None:
        _refuse(
            scope,
            f"SelfAttention {layer.name!r} was called while decoding but holds "
            "no cache: it was not among the model's layers when the model was "
            "read (a layer created during the call cannot decode)",
        )
    if key in scope.updated:
        _refuse(
            scope,
            f"SelfAttention {key!r} is called more than once in one decoding "
            "step: a layer shared between calls would need one cache per call. "
            "Give each call its own layer",
        )
    arguments = call_arguments(layer, args, kwargs)
    refused = [name for name in _REFUSED if _given(arguments.get(name))]
    if refused:
        _refuse(
            scope,
            f"SelfAttention {key!r} is called with {refused}, which a decoding "
            "step cannot apply to the cached positions (use causal=True, "
            "sliding_window= and the padding mask)",
        )
    output, cache = call(
        arguments["inputs"],
        mask=scope.padding,
        training=arguments.get("training"),
        cache=scope.caches[key],
        cache_update_index=scope.index,
    )
    scope.updated[key] = cache
    # The padding covers the cache, not these positions: no Keras mask on.
    set_keras_mask(output, None)
    return output


def _refuse(scope: Scope, why: str) -> None:
    scope.refusal = why
    raise ValueError(why)


def _given(value) -> bool:
    return value is not None and value is not False
