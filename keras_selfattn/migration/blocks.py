"""Attention inside layers the package does not own: a user's subclassed
block (keras.io's `TransformerBlock`), keras-hub's `TransformerEncoder`.

`convert` copies such a layer from its config, then puts a
`MultiHeadAttentionAdapter` where the copy holds each MultiHeadAttention or
GroupQueryAttention that the original model calls as self-attention: the
block's own code keeps calling `self.att(x, x, ...)`. How each attention
layer is called comes from one run of the original model on example inputs
(`record_calls`) of the package's own copy of the model, never on the
user's layers. Sublayers are matched by their place in Keras's own tracking
(`_keras_private.sublayers`, the order `__init__` and `build` created them),
which a copy from the config repeats.

A converted block saves as `keras_selfattn>ConvertedLayer`: the user's own
serialized layer and its adapters by place. Loading rebuilds the user's
layer from its own class, then puts the adapters back, so the file loads
with the user's registered classes and this package only.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator

import keras
import numpy as np

from keras_selfattn import _from_keras
from keras_selfattn._keras_private import (
    get_keras_mask,
    serialized_as_class,
    sublayers,
    unlocked,
)
from keras_selfattn.migration import configs, hub_attention
from keras_selfattn.migration.adapter import AttentionAdapter

Place = tuple  # indices into `sublayers`, from the block down
# The query's Keras mask when a recorded call was made.
KERAS_MASK = "keras_mask"


def attention_places(layer) -> Iterator[tuple[Place, keras.layers.Layer]]:
    """Each Keras attention layer (or keras-hub attention layer of
    `hub_attention.CLASSES`) inside `layer` (not inside a nested model,
    whose graph holds its layers) with its place."""

    def walk(parent, place):
        for index, child in enumerate(sublayers(parent)):
            if isinstance(child, _from_keras.CONVERTIBLE) or hub_attention.row(child):
                yield (*place, index), child
            elif not isinstance(child, keras.Model):
                yield from walk(child, (*place, index))

    yield from walk(layer, ())


def other_attention(layer) -> list:
    """Attention layers of other classes directly inside `layer` (keras-hub's
    `Gemma3Attention`, ...): named in the report."""
    return [
        child
        for child in sublayers(layer)
        if type(child).__name__.endswith("Attention")
        and not isinstance(child, (*_from_keras.CONVERTIBLE, AttentionAdapter))
        and hub_attention.row(child) is None
        and type(child).__name__ != "SelfAttention"
    ]


def holds_attention(layer) -> bool:
    return any(True for _ in attention_places(layer))


def at(layer, place: Place):
    for index in place:
        layer = sublayers(layer)[index]
    return layer


@contextlib.contextmanager
def record_calls(layers) -> Iterator[dict]:
    """Within the context, each of `layers` records its calls' arguments
    (by name, by `id(layer)`) before Keras casts them, and the query's
    Keras mask (`KERAS_MASK`).

    Their class is swapped for a subclass recording the calls meanwhile:
    `layers` are the package's own copies (`convert` records on the model it
    builds), never layers a user holds.
    """
    calls: dict = {}
    classes = {}
    for layer in layers:
        base = type(layer)
        signature = inspect.signature(base.call)

        def __call__(self, *args, _base=base, _signature=signature, **kwargs):
            bound = _signature.bind(None, *args, **kwargs).arguments
            bound.pop("self", None)
            # Keras's attention layers take the masks off their inputs.
            bound[KERAS_MASK] = get_keras_mask(bound.get("query"))
            calls.setdefault(id(self), []).append(bound)
            return _base.__call__(self, *args, **kwargs)

        classes[id(layer)] = base
        layer.__class__ = type(base.__name__, (base,), {"__call__": __call__})
    try:
        yield calls
    finally:
        for layer in layers:
            layer.__class__ = classes[id(layer)]


def example_inputs(model: keras.Model):
    """Inputs to run `model` once: unknown sizes 2 (batch) and 4, floats
    random, integers ones (a token id every vocabulary has, a real
    position of a padding mask)."""
    rng = np.random.default_rng(0)

    def one(x):
        shape = [
            d if d is not None else (2 if i == 0 else 4) for i, d in enumerate(x.shape)
        ]
        if "float" in str(x.dtype):
            return rng.standard_normal(shape).astype(x.dtype)
        return np.ones(shape, dtype=x.dtype)

    return keras.tree.map_structure(one, model.input)


def why_not(calls: list[dict] | None, in_block: bool = True) -> str | None:
    """Why the calls of one attention layer cannot become one
    SelfAttention's (`in_block`: behind an adapter, recorded on a run;
    otherwise read off a Functional model's graph), or None."""
    if not calls:
        return "not called when the model ran on example inputs"
    for call in calls:
        query = call.get("query")
        if call.get("value") is not query or call.get("key") not in (None, query):
            return "a cross-attention call (query, key and value differ) stays"
        given = [m for m in ("query_mask", "value_mask", "key_mask") if m in call]
        if given and not in_block:
            return f"a call passes {given[0]} (SelfAttention takes the Keras mask)"
    if not in_block:
        if len({bool(call.get("use_causal_mask")) for call in calls}) > 1:
            return "its calls differ in use_causal_mask"
    elif len({causal_of([call]) for call in calls}) > 1:
        return "its calls differ in use_causal_mask (or causal attention_mask)"
    return None


def causal_of(calls: list[dict]) -> bool:
    """Whether the calls are causal: `use_causal_mask=True`, or an
    `attention_mask` that is the causal mask (on the example inputs, which
    pad nothing)."""
    return bool(calls[0].get("use_causal_mask")) or causal_mask_given(calls)


def causal_mask_given(calls: list[dict], window: int | None = None) -> bool:
    """Whether every call's `attention_mask` was the causal mask (keras-hub's
    decoders compute their own), within `window` positions where given
    (Mistral's band): the example run pads nothing."""
    for call in calls:
        mask = call.get("attention_mask")
        if mask is None or len(mask.shape) != 3 or mask.shape[-1] < 2:
            return False
        mask = keras.ops.convert_to_numpy(mask).astype(bool)
        queries, keys = mask.shape[-2:]
        i, j = np.arange(queries)[:, None], np.arange(keys)[None, :]
        expected = (j <= i) & ((i - j) < (window or keys + 1))
        if queries != keys or not (mask == expected).all():
            return False
    return True


def install(block, adapters: dict[Place, keras.layers.Layer]) -> None:
    """Puts each adapter where `block` holds the layer at its place: the
    attribute (or list item) that holds it, and its place in `_layers`."""
    for place, adapter in adapters.items():
        parent = at(block, place[:-1])
        old = sublayers(parent)[place[-1]]
        if not _replaced(parent, place[-1], adapter):
            raise ValueError(
                f"Cannot convert '{old.name}' inside {type(parent).__name__} "
                f"'{parent.name}': no attribute of the layer holds it. "
                f"Received: layer={old.name!r}"
            )
    _mark_converted(block, sorted(adapters))


def share_sublayers(original, new) -> None:
    """Puts in `new` (a copy of `original` from its config) the sublayers of
    `original` that hold no attention, in place of its own: their weights
    are then held once, by both. The attention layers, and the layers
    holding them (shared likewise, one level down), stay the copy's; a
    sublayer no attribute holds keeps its copy (`copy_weights` fills it)."""
    old_children, new_children = sublayers(original), sublayers(new)
    _same_count(original, old_children, new_children)
    for index, old_child in enumerate(old_children):
        if isinstance(old_child, _from_keras.CONVERTIBLE) or hub_attention.row(
            old_child
        ):
            continue
        if not isinstance(old_child, keras.Model) and holds_attention(old_child):
            share_sublayers(old_child, new_children[index])
        else:
            _replaced(new, index, old_child)


def _replaced(parent, index: int, new) -> bool:
    """Whether the sublayer of `parent` at `index` (of `sublayers`) is now
    `new`, in the attribute (or list or dict item) that held it and in
    `_layers`; False where no attribute held it (nothing changed)."""
    tracked = sublayers(parent)
    old = tracked[index]
    with unlocked(parent):
        if not _replace_attribute(parent, old, new):
            return False
        # Keras's tracker appends the new layer: it takes the old one's place.
        tracked[:] = [layer for layer in tracked if layer is not new]
        tracked[index] = new
    return True


def _replace_attribute(parent, old, new) -> bool:
    modules = getattr(parent, "_modules", None) or {}  # torch.nn.Module's
    # Framework bookkeeping (`_layers`, TensorFlow's `_self_...` tracking)
    # follows the attribute; the attribute is the user's.
    held = [*vars(parent).items(), *modules.items()]
    for name, value in held:
        if value is old:
            setattr(parent, name, new)
            return True
    for name, value in held:
        if name == "_layers" or name.startswith("_self_unconditional"):
            continue
        if isinstance(value, list) and any(item is old for item in value):
            value[next(i for i, item in enumerate(value) if item is old)] = new
            return True
        if isinstance(value, dict) and any(item is old for item in value.values()):
            value[next(k for k, item in value.items() if item is old)] = new
            return True
    return False


def _same_count(original, old_children: list, new_children: list) -> None:
    if len(old_children) != len(new_children):
        raise ValueError(
            f"Cannot copy the weights of {type(original).__name__} "
            f"'{original.name}': its copy from get_config() holds "
            f"{len(new_children)} sublayers where it holds "
            f"{len(old_children)}. Received: layer={original.name!r}"
        )


def copy_weights(original, new) -> None:
    """Copies the variables of every sublayer of `original` to the one at
    the same place in `new`, adapters (which hold their own) and the
    sublayers `new` shares with `original` left out."""
    if isinstance(new, AttentionAdapter) or new is original:
        return
    old_children, new_children = sublayers(original), sublayers(new)
    _same_count(original, old_children, new_children)
    store: dict = {}
    original.save_own_variables(store)
    # Copies: on JAX an assigned array is shared, and Keras's compiled
    # `predict` of the original donates (deletes) its variables' arrays.
    new.load_own_variables({k: np.array(v) for k, v in store.items()})
    for old_child, new_child in zip(old_children, new_children, strict=True):
        copy_weights(old_child, new_child)


# --- saving: a converted block is a ConvertedLayer in the file -------------

_CONVERTED_CLASSES: dict[type, type] = {}
_REGISTERED = "keras_selfattn>ConvertedLayer"


def _mark_converted(block, places: list[Place]) -> None:
    base = type(block)
    if base in _CONVERTED_CLASSES.values():
        base = base.__mro__[1]
    object.__setattr__(block, "_converted_places", tuple(places))
    if base not in _CONVERTED_CLASSES:
        converted = type(
            base.__name__,
            (base,),
            {
                "get_config": _converted_config,
                "from_config": classmethod(ConvertedLayer.from_config.__func__),
                "__module__": base.__module__,
            },
        )
        # Saved as ConvertedLayer, whose `from_config` it shares.
        keras.saving.register_keras_serializable(*_REGISTERED.split(">"))(converted)
        _CONVERTED_CLASSES[base] = converted
    block.__class__ = _CONVERTED_CLASSES[base]


def _converted_config(self) -> dict:
    base = type(self).__mro__[1]
    return {
        "layer": serialized_as_class(base, configs.config_of(self, base)),
        "build_config": self.get_build_config(),
        "adapters": [
            [list(place), keras.saving.serialize_keras_object(at(self, place))]
            for place in self._converted_places
        ],
    }


@keras.saving.register_keras_serializable(package="keras_selfattn")
class ConvertedLayer(keras.layers.Layer):
    """How a layer whose attention `convert` replaced is saved: its own
    class's config and its `MultiHeadAttentionAdapter`s by place.

    `from_config` returns the user's layer (its own class), with the
    adapters back in place; no ConvertedLayer instance exists.
    """

    @classmethod
    def from_config(cls, config: dict):
        block = keras.saving.deserialize_keras_object(config["layer"])
        if config.get("build_config") and not block.built:
            block.build_from_config(config["build_config"])
        install(
            block,
            {
                tuple(place): keras.saving.deserialize_keras_object(adapter)
                for place, adapter in config["adapters"]
            },
        )
        return block
