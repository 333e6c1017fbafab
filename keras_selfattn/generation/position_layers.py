"""keras-hub's position layers, given the decoded positions.

keras-hub's `PositionEmbedding` (inside its `TokenAndPositionEmbedding`)
and `SinePositionEncoding` take each position's index as their `positions`
call argument, which the code around them (keras-hub's or the user's)
leaves out. `adapt(model)` makes each such layer of the model take the
active decoding scope's positions (`keras_selfattn.decoding`) whenever one
is active: its `call` is replaced, on the instance, by one that passes
them and otherwise calls the class's own `call` unchanged. The
replacement stays (it changes nothing outside a decoding run), so models
used from several threads at once need no lock.

keras-hub is not imported here: its classes are looked up only when the
user's program has imported it.
"""

from __future__ import annotations

import sys
import types

from keras import ops

from keras_selfattn import decoding
from keras_selfattn._model_layers import every_layer

# keras-hub's position layers: (module, class, whether `positions` are
# floats in the layer's compute dtype, else int32).
_KERAS_HUB = (
    ("keras_hub.src.layers.modeling.position_embedding", "PositionEmbedding", False),
    (
        "keras_hub.src.layers.modeling.sine_position_encoding",
        "SinePositionEncoding",
        True,
    ),
)
_MARK = "_keras_selfattn_positions"


def _classes() -> list[tuple[type, bool]]:
    found = []
    for module, name, floats in _KERAS_HUB:
        loaded = sys.modules.get(module)
        if loaded is not None and hasattr(loaded, name):
            found.append((getattr(loaded, name), floats))
    return found


def _positioned_call(self, *args, **kwargs):
    scope = decoding.active()
    if scope is not None:
        positions = scope.positions
        if getattr(self, _MARK):
            positions = ops.cast(positions, self.compute_dtype)
        kwargs["positions"] = positions
        kwargs.pop("start_index", None)
    return type(self).call(self, *args, **kwargs)


def adapt(model) -> None:
    """Makes the model's keras-hub position layers take decoded positions
    (module docstring); layers already adapted are left as they are."""
    classes = _classes()
    if not classes:
        return
    for layer in every_layer(model):
        if _MARK in vars(layer):
            continue
        for cls, floats in classes:
            if isinstance(layer, cls):
                object.__setattr__(layer, _MARK, floats)
                object.__setattr__(
                    layer, "call", types.MethodType(_positioned_call, layer)
                )
                break
