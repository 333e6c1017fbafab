"""A model run on new positions only, with one key/value cache per layer.

Decoding (an exported step, `generate`) runs a model on the positions
`index .. index + new - 1` only: the model is called as its user calls it,
inside a decoding scope (`keras_selfattn.decoding`) from which each causal
SelfAttention layer, wherever it sits (top level, inside a subclassed
layer, a nested model or a subclassed model), reads and extends its own
cache; position layers read the new positions there. Every other layer runs
as in the full forward pass, which is right as long as it is position-wise
(position t's output depends on earlier positions only through the
SelfAttention layers and the position layers): `decode_check` checks that
numerically, since it cannot be read from the code.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Sequence

import keras
from keras import ops

from keras_selfattn import decoding
from keras_selfattn._model_layers import every_layer
from keras_selfattn.attention import cache as cache_lib
from keras_selfattn.attention import masks, rotary
from keras_selfattn.generation import position_layers
from keras_selfattn.self_attention import SelfAttention

SUPPORTED = (
    "supported: causal SelfAttention layers anywhere in the model, each "
    "called once per step on one tensor, position-wise layers around them, "
    "no padding masks"
)


def refusal(model: keras.Model, why: str, action: str) -> ValueError:
    """The ValueError for a model that cannot decode: `action` ("export a
    decoding step of", "generate with") names what was asked."""
    return ValueError(f"Cannot {action} model {model.name!r}: {why} ({SUPPORTED})")


# Subclassed models and their Functional views (`functional_view`).
_VIEWS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def functional_view(model: keras.Model, action: str) -> keras.Model:
    """`model` itself if it is Sequential or Functional; for a subclassed
    model, a Functional model calling it on int32 token ids named "tokens"
    (the same weights; one per model), so that it has a named input and an
    output to read and export.

    Raises:
        ValueError: (one line) for a subclassed model that cannot be called
            on `(batch, time)` int32 ids.
    """
    if isinstance(model, keras.Sequential) or hasattr(model, "_nodes_by_depth"):
        return model
    if model not in _VIEWS:
        tokens = keras.Input((None,), dtype="int32", name="tokens")
        try:
            outputs = model(tokens)
        except Exception as error:  # the user's code: any error
            raise refusal(
                model,
                "it is a subclassed model that cannot be called on int32 token "
                f"ids (batch, time) ({type(error).__name__}: "
                f"{str(error).splitlines()[0] if str(error) else ''}); wrap it: "
                "keras.Model(keras.Input(...), model(...))",
                action,
            ) from error
        _VIEWS[model] = keras.Model(tokens, outputs, name=model.name)
    return _VIEWS[model]


@dataclasses.dataclass(frozen=True)
class Reading:
    """A model read once for one decoding call (`read`): what the loop, the
    decode check and the exporters need, so that none walks it again.

    Attributes:
        model: The model decoding runs: the user's (its `functional_view`),
            or the package's graph over its layers that hands keras-hub's
            position layers their positions (`position_layers.positioned`).
        layers: Its SelfAttention layers at any depth, in the order the
            model tracks them, each of which gets a cache.
        names: Each layer's stable name (`layer_names`).
        every: Every layer of the user's model (`every_layer`), for the
            readers of its dtypes, embeddings and classes.
    """

    model: keras.Model
    layers: tuple[SelfAttention, ...]
    names: tuple[str, ...]
    every: tuple[keras.layers.Layer, ...]

    @property
    def compute_dtypes(self) -> set[str]:
        """The compute dtypes of the model's layers."""
        return {layer.compute_dtype for layer in self.every}

    @property
    def quantizes_inputs(self) -> bool:
        """Whether a layer rounds its inputs to integers before its matmul
        (Keras's int8 and int4 `Dense` and `EinsumDense`)."""
        return any(getattr(layer, "inputs_quantizer", None) for layer in self.every)


# The latest reading of each decoding model, for `layer_names`.
_READINGS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def read(model: keras.Model, action: str) -> Reading:
    """Reads `model` (Sequential, Functional or a `functional_view`) for one
    decoding call: one walk of its layers.

    Args:
        model: Any Keras model.
        action: How refusals name what was asked ("generate with").

    Raises:
        ValueError: for a structure that cannot decode (one line:
            `refusal_reason`), or SelfAttention names that clash.
    """
    every = tuple(every_layer(model))
    holders, names = _structure(model, every)
    layers = tuple(layer for layer in every if isinstance(layer, SelfAttention))
    hub = position_layers.found(every, holders)
    why = refusal_reason(model, every, layers, hub, holders)
    if why is not None:
        raise refusal(model, why, action)
    if isinstance(names, str):
        raise ValueError(names)
    decoded = position_layers.positioned(model, hub)
    reading = Reading(decoded, layers, names, every)
    _READINGS[decoded] = reading
    return reading


# Each model's holders and stable names (`_structure`), for the layers it
# held when they were worked out.
_STRUCTURES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _structure(model: keras.Model, every: tuple) -> tuple[dict, object]:
    """Each layer's holder `{id(layer): holder}` and the SelfAttention
    layers' stable names (or, where they clash, the message of the
    ValueError), worked out again only when the model's layers changed."""
    ids = tuple(map(id, every))
    known = _STRUCTURES.get(model)
    if known is None or known[0] != ids:
        holders = {}
        for holder in every:
            for inner in holder._layers:
                holders.setdefault(id(inner), holder)
        layers = [layer for layer in every if isinstance(layer, SelfAttention)]
        try:
            names = _stable_names(model, layers, holders)
        except ValueError as error:
            names = str(error)
        known = (ids, holders, names)
        _STRUCTURES[model] = known
    return known[1], known[2]


def refusal_reason(model, every, layers, hub, holders) -> str | None:
    """Why the structure `read` found cannot decode, or None."""
    if not layers:
        return "it has no SelfAttention layer"
    for layer in layers:
        if not layer.causal:
            return f"SelfAttention {layer.name!r} has causal=False"
    masking = [
        layer.name
        for layer in every
        if isinstance(layer, keras.layers.Masking) or getattr(layer, "mask_zero", 0)
    ]
    if masking:
        return (
            f"layers {masking} make padding masks, which a step over the new "
            "positions cannot apply to the cached ones"
        )
    hidden = position_layers.unreachable(model, every, hub, holders)
    if hidden:
        return (
            f"keras-hub position layers {hidden} sit where no Functional graph "
            "calls them (inside a subclassed layer or model, or a Sequential "
            "model), so they cannot be given the decoded positions: build the "
            "model functionally, or use keras_selfattn's PositionEmbedding or "
            "TokenAndPositionEmbedding"
        )
    return None


def layer_names(model: keras.Model, layers: Sequence[SelfAttention]) -> list[str]:
    """A unique name per cached layer, for exported inputs and errors, that
    the same model loaded from its .keras file in another process gives
    too: the layer's own name where a Functional or Sequential model holds
    it (its config keeps that name); else, for a layer a subclassed layer
    creates in its code (named anew in each process), its holder's name
    and the attribute holding it, joined by "_" (`transformer_block_att`,
    `mini_gpt_blocks_0_att`). Read from the model's `Reading` (`read`),
    or read now for a model no decoding call has read.

    Raises:
        ValueError: if two such names clash, or as `read`.
    """
    reading = _READINGS.get(model)
    if reading is None or tuple(map(id, reading.layers)) != tuple(map(id, layers)):
        reading = read(model, "name the layers of")
    return list(reading.names)


def _graph_model(layer) -> bool:
    """Whether `layer` keeps its layers' names in its config."""
    return isinstance(layer, keras.Sequential) or hasattr(layer, "_nodes_by_depth")


def _attribute(holder, layer) -> str:
    """The attribute of `holder` holding `layer` (`blocks_0` for an item of
    a list), or the layer's own name. On PyTorch a layer attribute lives in
    the module's `_modules`, not in its `__dict__`."""
    attributes = {**getattr(holder, "_modules", {}), **vars(holder)}
    for key, value in attributes.items():
        if key.startswith("_"):  # Keras's own tracking lists
            continue
        if value is layer:
            return key
        if isinstance(value, (list, tuple)):
            for index, item in enumerate(value):
                if item is layer:
                    return f"{key}_{index}"
    return layer.name


def _stable_names(model, layers, holders) -> tuple[str, ...]:
    def name(layer) -> str:
        holder = holders.get(id(layer))
        if holder is None or _graph_model(holder):
            return layer.name
        return f"{name(holder)}_{_attribute(holder, layer)}"

    names = tuple(name(layer) for layer in layers)
    if len(set(names)) != len(names):
        raise ValueError(
            f"Model {model.name!r} holds SelfAttention layers whose names and "
            f"paths clash: {list(names)}. Name them apart"
        )
    return names


def _positions(index, new, starts):
    """int32 `(batch or 1, new)`: slot `index + t` less each row's start."""
    slots = ops.add(masks.positions(new), ops.cast(index, "int32"))
    slots = ops.expand_dims(slots, 0)
    if starts is None:
        return slots
    moved = ops.subtract(slots, ops.expand_dims(ops.cast(starts, "int32"), 1))
    return ops.maximum(moved, 0)


def run_cached(
    model: keras.Model,
    layers: Sequence[SelfAttention],
    inputs,
    caches: Sequence,
    index,
    padding=None,
    starts=None,
):
    """Runs `model` on new positions with a cache per layer.

    Args:
        model: The model `layers` came from (`Reading.model`).
        layers: Its SelfAttention layers.
        inputs: The new positions `(batch, new, ...)`.
        caches: One cache per layer, in `layers` order: a cache object
            (`attention.cache.Cache`, of the class the caller needs) or a
            tensor (a `Cache`).
        index: The first new position's cache slot (int or int32 scalar).
        padding: Optional `(batch, max_length)` bool mask over the whole
            cached sequence, True where a slot holds a token; every
            SelfAttention call's `mask`.
        starts: Optional int32 `(batch,)`: the slot of each row's first
            token (left-padded rows), so that position layers see each
            row's positions counted from its own start. None: 0.

    Returns:
        Tuple (the model's output for the new positions, the updated caches
        in `layers` order, each in the form given).
    """
    names = layer_names(model, layers)
    scope = decoding.Scope(
        caches={n: cache_lib.wrapped(c) for n, c in zip(names, caches, strict=True)},
        keys=dict(zip(layers, names, strict=True)),
        index=index,
        padding=padding,
        make_positions=lambda: _positions(index, ops.shape(inputs)[1], starts),
    )
    # Every layer rotates the same new positions: one rotary table.
    with rotary.shared_tables(), decoding.decoding(scope):
        try:
            output = model(inputs)
        except Exception:
            if scope.refusal is None:
                raise
            raise refusal(model, scope.refusal, "decode") from None
    output = keras.tree.flatten(output)[0]
    updated = [
        _like(given, scope.updated.get(name))
        for name, given in zip(names, caches, strict=True)
    ]
    return output, updated


def _like(given, updated):
    """`updated` (a `cache_lib.Cache`, None where the layer was not called)
    in the form the caller gave its cache: the object, or its tensor."""
    if updated is None:
        return given
    return updated if isinstance(given, cache_lib.Cache) else updated.tensor
