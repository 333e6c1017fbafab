"""A `Loop` body's `Shape` ops of request-fixed shapes, read from outside.

A generator's token step reshapes every layer's activations, and tf2onnx
computes each target shape from `Shape` of a tensor of the step (the batch
is dynamic): a chain of small ops per reshape, every token. Where the
body's shapes (`shape_probes`) give such a tensor's shape as fixed sizes
and the graph inputs' named axes ("batch"), the `Shape` op becomes that
shape, built once in front of the loop from the graph input's own
`Shape`; `loop_invariant` then hoists the chain it feeds. Nothing is
changed where a dim is unknown.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

from keras_selfattn.export.formats.onnx import shape_probes


def fold_shapes(proto: onnx.ModelProto, loop: onnx.NodeProto) -> int:
    """Rewrites the body's `Shape` nodes of request-fixed shapes (module
    docstring) as Identity of a tensor computed before `loop`; returns how
    many."""
    inferred = shape_probes.body_shapes(proto, loop)
    body = next(a.g for a in loop.attribute if a.name == "body")
    axes = shape_probes.named_axes(proto.graph)
    graph = proto.graph
    built: dict[tuple, str] = {}
    count = 0
    for node in body.node:
        if node.op_type != "Shape" or node.attribute:
            continue
        dims = inferred.get(node.input[0])  # sizes and named axes only
        if dims is None:
            continue
        key = tuple(dims)
        if key not in built:
            built[key] = _build(graph, dims, axes, f"{node.output[0]}__fixed")
        node.op_type = "Identity"
        node.input[0] = built[key]
        count += 1
    return count


def _build(graph, dims, axes, name: str) -> str:
    """int64 `dims` (sizes and named axes) as nodes of `graph`; the name."""
    pieces = []
    for index, dim in enumerate(dims):
        piece = f"{name}_{index}"
        if isinstance(dim, int):
            graph.initializer.append(
                numpy_helper.from_array(np.array([dim], np.int64), piece)
            )
        else:
            source, axis = axes[dim]
            bounds = [f"{piece}_start", f"{piece}_end"]
            for bound, value in zip(bounds, (axis, axis + 1), strict=True):
                graph.initializer.append(
                    numpy_helper.from_array(np.array([value], np.int64), bound)
                )
            graph.node.extend(
                [
                    onnx.helper.make_node("Shape", [source], [f"{piece}_shape"]),
                    onnx.helper.make_node(
                        "Slice", [f"{piece}_shape", *bounds], [piece]
                    ),
                ]
            )
        pieces.append(piece)
    graph.node.append(onnx.helper.make_node("Concat", pieces, [name], axis=0))
    return name
