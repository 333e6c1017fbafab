"""Every layer of a model, nested ones included: the one walk that the
decoding checks, the exporters' precision and quantization readers and the
fused ONNX rewrite share."""

from __future__ import annotations

import keras


def every_layer(model: keras.layers.Layer) -> list[keras.layers.Layer]:
    """`model` first, then every layer it tracks at any depth, each once,
    depth first in the order they were tracked."""
    found, stack, seen = [], [model], set()
    while stack:
        layer = stack.pop()
        if id(layer) in seen:
            continue
        seen.add(id(layer))
        found.append(layer)
        stack.extend(reversed(layer._layers))
    return found
