"""Loop-invariant work out of ONNX `Loop` bodies (a generator's token loop).

tf2onnx converts a TensorFlow while loop's captured tensors (the weights,
the prompt's padding, the sampling controls) into loop-carried values the
body passes through unchanged. ONNX Runtime then sees them as values that
change every iteration: nothing computed from them is folded or prepacked,
and every token recomputes what the request fixed once. This pass

1. reads each such pass-through from the outer scope instead (the Loop's
   initial value) and drops it from the loop's state;
2. moves the body's initializers to the outer graph (one copy, prepacked
   by ONNX Runtime like any initializer), and every body node whose
   inputs are all fixed for the request (outer-scope values, initializers,
   other such nodes) in front of the Loop: it runs once per request;
3. reads the body's `Shape` ops of request-fixed shapes from outside
   (`loop_shapes`) and hoists the shape arithmetic they fed;
4. turns the token's select between sampling and greedy, its condition
   now fixed for the request, into an `If` (`loop_select`): a greedy
   request no longer sorts the vocabulary every token.

The values computed are unchanged: the same nodes on the same inputs.
"""

from __future__ import annotations

from collections.abc import Callable

import onnx

from keras_selfattn.export.formats.onnx import graph as graph_lib
from keras_selfattn.export.formats.onnx import loop_select, loop_shapes


def optimize_loops(proto: onnx.ModelProto) -> onnx.ModelProto:
    """Applies the pass (module docstring) to every `Loop` of the main graph.

    Args:
        proto: The model; changed in place.

    Returns:
        `proto`.
    """
    graph = proto.graph
    count = len(_loops(graph))
    # Each pass may replace the graph's nodes: the loops are found again.
    for index in range(count):
        _outer_passthrough(graph, _loops(graph)[index])
        _hoist(graph, _loops(graph)[index])
    if not count:
        return proto
    graph_lib.topological_sort(graph)
    for index in range(count):
        if loop_shapes.fold_shapes(proto, _loops(graph)[index]):
            _hoist(graph, _loops(graph)[index])
    graph_lib.topological_sort(graph)
    for index in range(count):
        loop_select.branch_selects(proto, _loops(graph)[index])
    graph_lib.prune_dead(graph)
    return proto


def _loops(graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    return [node for node in graph.node if node.op_type == "Loop"]


def _body(loop: onnx.NodeProto) -> onnx.GraphProto:
    return next(a.g for a in loop.attribute if a.name == "body")


def _source(name: str, producers: dict[str, onnx.NodeProto]) -> str:
    """The tensor `name` is an Identity chain of."""
    while name in producers and producers[name].op_type == "Identity":
        name = producers[name].input[0]
    return name


def _outer_passthrough(graph: onnx.GraphProto, loop: onnx.NodeProto) -> None:
    """Reads each loop-carried value the body returns unchanged from the
    outer scope (its initial value), out of the loop's state."""
    body = _body(loop)
    producers = {name: node for node in body.node for name in node.output}
    carried = len(loop.input) - 2
    kept = []
    renamed: dict[str, str] = {}
    final: list[tuple[str, str]] = []
    for k in range(carried):
        inner = body.input[k + 2].name
        returned = body.output[k + 1].name
        initial = loop.input[k + 2]
        if initial and _source(returned, producers) == inner:
            renamed[inner] = initial
            final.append((initial, loop.output[k]))
        else:
            kept.append(k)
    if not renamed:
        return
    body_inputs = [body.input[0], body.input[1]] + [body.input[k + 2] for k in kept]
    body_outputs = [body.output[0]] + [body.output[k + 1] for k in kept]
    body_outputs += list(body.output[carried + 1 :])
    loop_inputs = list(loop.input[:2]) + [loop.input[k + 2] for k in kept]
    loop_outputs = [loop.output[k] for k in kept] + list(loop.output[carried:])
    _replace(body.input, body_inputs)
    _replace(body.output, body_outputs)
    _replace(loop.input, loop_inputs)
    _replace(loop.output, loop_outputs)
    graph_lib.rename_inputs(body.node, renamed)
    # The loop's final value of a pass-through is its initial value.
    graph.node.extend(
        onnx.helper.make_node("Identity", [initial], [output])
        for initial, output in final
        if output
    )
    graph_lib.prune_dead(body)


def _replace(field, values: list) -> None:
    """Sets a repeated protobuf field (names or messages) to `values`."""
    values = [value if isinstance(value, str) else _copy(value) for value in values]
    del field[:]
    field.extend(values)


def _copy(message):
    copy = type(message)()
    copy.CopyFrom(message)
    return copy


def _hoist(graph: onnx.GraphProto, loop: onnx.NodeProto) -> None:
    """Moves the body's initializers, then its request-fixed nodes, in
    front of the loop (module docstring)."""
    body = _body(loop)
    outer_names = _names(graph)
    moved = [init for init in body.initializer if init.name not in outer_names]
    moved_names = {init.name for init in moved}
    graph.initializer.extend(moved)
    _keep(body.initializer, lambda init: init.name not in moved_names)
    varying = {info.name for info in body.input}
    hoisted = []
    for node in body.node:
        fixed = (
            node.op_type not in graph_lib.RANDOM_OPS
            and node.domain in ("", "ai.onnx")
            and not any(a.type in _GRAPH_TYPES for a in node.attribute)
            and not any(name in varying for name in node.input if name)
            and not any(name in outer_names for name in node.output)
        )
        if fixed:
            hoisted.append(node)
        else:
            varying.update(node.output)
    if not hoisted:
        return
    # Nodes by their outputs (protobuf wrappers have no stable id).
    keys = {tuple(node.output) for node in hoisted}
    copies = [_copy(node) for node in hoisted]
    _keep(body.node, lambda node: tuple(node.output) not in keys)
    position = list(graph.node).index(loop)
    nodes = list(graph.node)
    del graph.node[:]
    graph.node.extend(nodes[:position] + copies + nodes[position:])


_GRAPH_TYPES = (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)


def _names(graph: onnx.GraphProto) -> set[str]:
    """Every tensor name of the graph's own scope."""
    names = {info.name for info in graph.input}
    names.update(init.name for init in graph.initializer)
    names.update(name for node in graph.node for name in node.output)
    return names


def _keep(field, keep: Callable[[object], bool]) -> None:
    """Keeps the entries of a repeated protobuf field that `keep` accepts."""
    _replace(field, [entry for entry in field if keep(entry)])
