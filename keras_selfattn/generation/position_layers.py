"""keras-hub's position layers, given the decoded positions through their
public `positions` call argument.

keras-hub's `PositionEmbedding`, `SinePositionEncoding` and
`TokenAndPositionEmbedding` take each position's index as `positions`,
which the code around them (keras-hub's or the user's) leaves out. Where
such a layer is a node of a Functional model (at any depth of nested
Functional models), `positioned(model, found)` builds, once per model, a
package-owned Functional graph over the same layers (no weight copy,
`keras.models.clone_model` with `call_function`) in which each of them is
called through `Positioned`: a wrapper that passes the active decoding
scope's positions (`keras_selfattn.decoding`) whenever one is active and
calls the layer as it was called otherwise. Nothing of the user's layers
is replaced. A position layer that no graph reaches (inside a subclassed
layer or model, or a Sequential model) is named by `unreachable`, and the
reading of the model refuses it (`cached_model.read`).

keras-hub is not imported here: its classes are looked up only when the
user's program has imported it.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Mapping, Sequence

import keras
from keras import ops

from keras_selfattn import decoding

# keras-hub's position layers, by their public names: whether `positions`
# are floats in the layer's compute dtype, else int32.
_KERAS_HUB = {
    "PositionEmbedding": False,
    "SinePositionEncoding": True,
    "TokenAndPositionEmbedding": False,
}


def found(
    layers: Sequence[keras.layers.Layer], holders: Mapping[int, keras.layers.Layer]
) -> dict[int, bool]:
    """The keras-hub position layers among `layers` (`holders`: each
    layer's holder) that no `Positioned` calls yet: {id(layer): floats}."""
    hub = sys.modules.get("keras_hub")
    if hub is None:
        return {}
    classes = [
        (getattr(hub.layers, name), floats)
        for name, floats in _KERAS_HUB.items()
        if hasattr(hub.layers, name)
    ]
    return {
        id(layer): floats
        for layer in layers
        for cls, floats in classes
        if isinstance(layer, cls) and not isinstance(holders.get(id(layer)), Positioned)
    }


def _graph(layer) -> bool:
    """Whether `layer` is a Functional model (Sequential is not)."""
    return not isinstance(layer, keras.Sequential) and hasattr(layer, "_nodes_by_depth")


def unreachable(
    model: keras.Model,
    layers: Sequence[keras.layers.Layer],
    hub: Mapping[int, bool],
    holders: Mapping[int, keras.layers.Layer],
) -> list[str]:
    """The names of the position layers of `hub` (`found`) that no
    Functional graph from `model` calls, so that `positioned` cannot pass
    them positions (`holders`: each layer's holder). One held by another
    of them (keras-hub's `TokenAndPositionEmbedding` holds a
    `PositionEmbedding`) is reached through its holder."""
    names = []
    for layer in layers:
        if id(layer) not in hub or id(holders.get(id(layer))) in hub:
            continue
        holder = holders.get(id(layer))
        while holder is not None and _graph(holder):
            holder = holders.get(id(holder))
        if holder is not None or not _graph(model):
            names.append(f"{layer.name!r} ({type(layer).__name__})")
    return names


class Positioned(keras.layers.Layer):
    """Calls a keras-hub position layer with the active decoding scope's
    positions, or as it was called outside a decoding run.

    Args:
        layer: The keras-hub layer (called, never changed).
        floats: Whether it takes float positions in its compute dtype
            (`SinePositionEncoding`), else int32.
    """

    def __init__(self, layer: keras.layers.Layer, floats: bool, **kwargs):
        super().__init__(
            name=f"{layer.name}_positioned", dtype=layer.dtype_policy, **kwargs
        )
        self.layer = layer
        self.floats = floats
        self.built = True

    def call(self, *args, **kwargs):
        scope = decoding.active()
        if scope is not None:
            positions = scope.positions
            if self.floats:
                positions = ops.cast(positions, self.layer.compute_dtype)
            kwargs["positions"] = positions
            kwargs.pop("start_index", None)
        return self.layer(*args, **kwargs)

    def compute_output_spec(self, *args, **kwargs):
        return self.layer.compute_output_spec(*args, **kwargs)


# The package's graph by model (`positioned`).
_GRAPHS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def positioned(model: keras.Model, hub: Mapping[int, bool]) -> keras.Model:
    """A Functional model over `model`'s own layers whose position layers
    of `hub` (`found`, none `unreachable`) are called through `Positioned`
    (module docstring); `model` itself when `hub` is empty. One per model."""
    if not hub:
        return model
    if model not in _GRAPHS:

        def call(layer, *args, **kwargs):
            if id(layer) in hub:
                return Positioned(layer, hub[id(layer)])(*args, **kwargs)
            return layer(*args, **kwargs)

        _GRAPHS[model] = keras.models.clone_model(
            model,
            clone_function=lambda layer: layer,
            call_function=call,
            recursive=True,
        )
    return _GRAPHS[model]
