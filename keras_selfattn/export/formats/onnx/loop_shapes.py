"""A `Loop` body's `Shape` ops of request-fixed shapes, read from outside.

A generator's token step reshapes every layer's activations, and tf2onnx
computes each target shape from `Shape` of a tensor of the step (the batch
is dynamic): a chain of small ops per reshape, every token. Where ONNX
Runtime's symbolic shape inference finds such a tensor's shape made of
fixed sizes and the graph inputs' named axes ("batch"), the `Shape` op
becomes that shape, built once in front of the loop from the graph input's
own `Shape`; `loop_invariant` then hoists the chain it feeds. Nothing is
changed where the inference fails or finds another symbol.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

from keras_selfattn.export.formats.onnx import loop_select


def fold_shapes(proto: onnx.ModelProto, loop: onnx.NodeProto) -> int:
    """Rewrites the body's `Shape` nodes of request-fixed shapes (module
    docstring) as Identity of a tensor computed before `loop`; returns how
    many."""
    inferred = _infer(proto)
    if inferred is None:
        return 0
    body = next(a.g for a in loop.attribute if a.name == "body")
    axes = _named_axes(proto.graph)
    graph = proto.graph
    built: dict[tuple, str] = {}
    count = 0
    for node in body.node:
        if node.op_type != "Shape" or node.attribute:
            continue
        dims = inferred.get(node.input[0])
        if dims is None or not all(isinstance(d, int) or d in axes for d in dims):
            continue
        key = tuple(dims)
        if key not in built:
            built[key] = _build(graph, dims, axes, f"{node.output[0]}__fixed")
        node.op_type = "Identity"
        node.input[0] = built[key]
        count += 1
    return count


def _named_axes(graph: onnx.GraphProto) -> dict[str, tuple[str, int]]:
    """A graph input's named axis -> (that input, the axis)."""
    axes: dict[str, tuple[str, int]] = {}
    for info in graph.input:
        for axis, dim in enumerate(info.type.tensor_type.shape.dim):
            if dim.dim_param and dim.dim_param not in axes:
                axes[dim.dim_param] = (info.name, axis)
    return axes


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


def _infer(proto: onnx.ModelProto) -> dict[str, list] | None:
    """Tensor name -> dims (ints, symbols) of the Loop bodies' tensors by
    ONNX Runtime's symbolic shape inference; None where it fails."""
    try:
        from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference
    except ImportError:
        return None
    model = loop_select.light_copy(proto)
    for node in model.graph.node:  # the tool needs every Loop input named
        if node.op_type == "Loop" and not node.input[0]:
            model.graph.initializer.append(
                numpy_helper.from_array(np.array(2**62, np.int64), "__trip_count")
            )
            node.input[0] = "__trip_count"
    # `SymbolicShapeInference.infer_shapes`'s steps, without the file it
    # writes into the working directory when the inference is incomplete.
    inference = SymbolicShapeInference(2**31 - 1, True, False, 0)
    try:
        inference._preprocess(model)
        complete = False
        while inference.run_:
            complete = inference._infer_impl()
        inference._update_output_from_vi()
    except Exception:  # noqa: BLE001 - an optimization: skipped where it fails
        return None
    if not complete:
        return None
    inferred = inference.out_mp_
    shapes = {}
    for node in inferred.graph.node:
        for attribute in node.attribute:
            if attribute.type != onnx.AttributeProto.GRAPH:
                continue
            for info in [*attribute.g.value_info, *attribute.g.input]:
                shape = info.type.tensor_type
                if shape.HasField("shape"):
                    shapes[info.name] = [
                        d.dim_value if d.HasField("dim_value") else d.dim_param
                        for d in shape.shape.dim
                    ]
    return shapes
