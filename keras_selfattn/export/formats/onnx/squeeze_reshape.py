"""A `Reshape` of a `Squeeze` reads the squeezed tensor itself.

A generator's decoding step reads each layer's keys and values from its
cache `(B, 2, L, H_kv, D)` as a slice `(B, 1, Lk, H_kv, D)` squeezed to
`(B, Lk, H_kv, D)`, which the fused attention (`step_core.replacement`)
reshapes to `(B, Lk, H_kv * D)`: the squeeze is a kernel per layer, keys
and values, and token that the reshape does not need.

`skip_squeezes` has a `Reshape` read a `Squeeze`'s input where that gives
the same tensor: the squeeze's axes are constant and non-negative, and the
reshape's shape is constant with no 0 (a copied dim) at or after the first
squeezed axis, so it reads only the elements' order and the dims before
that axis, which the squeeze keeps. A squeeze nothing else reads goes.
"""

from __future__ import annotations

import numpy as np
import onnx

from keras_selfattn.export.formats.onnx import graph as graph_lib


def skip_squeezes(proto: onnx.ModelProto) -> int:
    """Rewrites the reshapes of squeezes in `proto`'s main graph and `Loop`
    bodies (module docstring); returns how many."""
    return graph_lib.rewrite_with_bodies(
        proto,
        lambda graph, main: _rewrite(graph, graph_lib.ScopedConstants([graph, main])),
    )


def _rewrite(graph: onnx.GraphProto, constants: graph_lib.ScopedConstants) -> int:
    producers = {out: node for node in graph.node for out in node.output}
    count = 0
    for node in graph.node:
        if node.op_type != "Reshape" or any(
            a.name == "allowzero" for a in node.attribute
        ):
            continue
        squeeze = producers.get(node.input[0])
        if squeeze is None or squeeze.op_type != "Squeeze" or len(squeeze.input) < 2:
            continue
        axes = constants.get(squeeze.input[1])
        shape = constants.get(node.input[1])
        if axes is None or shape is None or axes.size == 0 or (axes < 0).any():
            continue
        copied = np.flatnonzero(np.asarray(shape) == 0)
        if copied.size and copied.max() >= axes.min():
            continue
        node.input[0] = squeeze.input[0]
        count += 1
    return count
