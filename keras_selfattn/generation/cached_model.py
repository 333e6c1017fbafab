"""A model run on new positions only, with one key/value cache per layer.

Decoding (an exported step, `generate`) runs a model on the positions
`index .. index + new - 1` only: each causal SelfAttention layer reads and
extends its own cache, every other layer runs as in the full forward. This
holds for a Sequential model, or a Functional model, in which every
SelfAttention is a top-level layer with `causal=True`, called once on a
single tensor without masks; any graph around them works as long as it is
position-wise (position t's output depends on earlier positions only
through the SelfAttention layers), which callers check numerically, since
it cannot be read from the graph.
"""

from __future__ import annotations

from collections.abc import Sequence

import keras

from keras_selfattn._model_layers import every_layer
from keras_selfattn.attention import rotary
from keras_selfattn.self_attention import SelfAttention

SUPPORTED = (
    "supported: one input, one output, top-level causal SelfAttention layers "
    "each called once on one tensor, no padding masks"
)


def refusal(model: keras.Model, why: str, action: str) -> ValueError:
    """The ValueError for a model that cannot decode: `action` ("export a
    decoding step of", "generate with") names what was asked."""
    return ValueError(f"Cannot {action} model {model.name!r}: {why} ({SUPPORTED})")


def _calls(model: keras.Model, action: str) -> list[SelfAttention]:
    """The SelfAttention layers in call order; refuses extra call arguments."""
    if isinstance(model, keras.Sequential):
        return [layer for layer in model.layers if isinstance(layer, SelfAttention)]
    calls = []
    for depth in sorted(model._nodes_by_depth, reverse=True):
        for node in model._nodes_by_depth[depth]:
            if not isinstance(node.operation, SelfAttention):
                continue
            calls.append(node.operation)
            tensors = [
                value
                for value in keras.tree.flatten(
                    (node.arguments.args, node.arguments.kwargs)
                )
                if isinstance(value, keras.KerasTensor)
            ]
            extra = {
                k: v
                for k, v in node.arguments.kwargs.items()
                if v is not None and v is not False
            }
            if len(tensors) != 1 or extra:
                raise refusal(
                    model,
                    f"SelfAttention {node.operation.name!r} is called with more "
                    f"than one input tensor or with {sorted(extra)}",
                    action,
                )
    return calls


def cached_layers(model: keras.Model, action: str) -> tuple[SelfAttention, ...]:
    """The model's SelfAttention layers in call order, each of which gets a
    cache (module docstring).

    Args:
        model: A Sequential or Functional model.
        action: How refusals name what was asked ("generate with").

    Raises:
        ValueError: for a structure that cannot decode (one line).
    """
    if not isinstance(model, keras.Sequential) and not hasattr(
        model, "_nodes_by_depth"
    ):
        raise refusal(model, "it is not a Sequential or Functional model", action)
    top = list(model.layers)
    calls = _calls(model, action)
    names = [layer.name for layer in calls]
    duplicated = sorted({name for name in names if names.count(name) > 1})
    if duplicated:
        raise refusal(
            model, f"SelfAttention {duplicated} is called more than once", action
        )
    nested = [
        layer.name
        for layer in every_layer(model)
        if isinstance(layer, SelfAttention) and layer not in top
    ]
    if nested:
        raise refusal(
            model, f"SelfAttention {nested} is nested inside another layer", action
        )
    if not calls:
        raise refusal(model, "it has no SelfAttention layer", action)
    for layer in calls:
        if not layer.causal:
            raise refusal(
                model, f"SelfAttention {layer.name!r} has causal=False", action
            )
    masking = [
        layer.name
        for layer in every_layer(model)
        if isinstance(layer, keras.layers.Masking) or getattr(layer, "mask_zero", 0)
    ]
    if masking:
        raise refusal(
            model,
            f"layers {masking} make padding masks, which a step over the new "
            "positions cannot apply to the cached ones",
            action,
        )
    return tuple(calls)


def run_cached(
    model: keras.Model,
    layers: Sequence[SelfAttention],
    inputs,
    caches: Sequence,
    index,
    padding=None,
):
    """Runs `model` on new positions with a cache per layer.

    Args:
        model: The model `layers` came from (`cached_layers`).
        layers: Its SelfAttention layers, in call order.
        inputs: The new positions `(batch, new, ...)`.
        caches: One cache per layer, in `layers` order.
        index: The first new position (int or int32 scalar tensor).
        padding: Optional `(batch, max_length)` bool mask over the whole
            cached sequence, True where a position holds a token; handed to
            every SelfAttention call as its `mask`.

    Returns:
        Tuple (the model's output for the new positions, the updated caches
        in `layers` order).
    """
    by_layer = dict(zip(layers, caches, strict=True))
    updated = {}

    def call_layer(layer, *args, **kwargs):
        if not isinstance(layer, SelfAttention):
            return layer(*args, **kwargs)
        kwargs = {k: v for k, v in kwargs.items() if k != "mask"}
        if padding is not None:
            kwargs["mask"] = padding
        output, cache = layer(
            *args, cache=by_layer[layer], cache_update_index=index, **kwargs
        )
        updated[layer] = cache
        return output

    # Every layer rotates the same new positions: one rotary table.
    with rotary.shared_tables():
        if isinstance(model, keras.Sequential):
            output = inputs
            for layer in model.layers:
                output = call_layer(layer, output)
        else:
            output = model._run_through_graph(
                [inputs], operation_fn=lambda op: op, call_fn=call_layer
            )
            output = keras.tree.flatten(output)[0]
    return output, [updated[layer] for layer in layers]
