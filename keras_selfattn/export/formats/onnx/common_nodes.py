"""One node for each value a generator's graph computes more than once.

tf2onnx converts every layer on its own: each of a Llama's layers computes
again, from the same step index and the same shapes, its cache write's
clamped start and mask, its key mask, the slices' ends and the rotary
tables' reshapes, about half of its 105 nodes in a `Loop` body. Their
constants are equal in value but not in name, so ONNX Runtime's own common
subexpression elimination, which compares inputs by name, merges none:
each runs once per layer and token.

`merge` keeps the first of every set of nodes that compute the same thing
(the same op, domain and attributes on the same inputs, a small constant
input compared by value: `SMALL_ELEMENTS`) and has later readers read it,
in the main graph and in every `Loop` body. Ops whose outputs differ from
run to run (`graph.RANDOM_OPS`) and ops with subgraphs are kept as they are, and
so is a node writing a graph's output. The values computed are unchanged.
"""

from __future__ import annotations

import hashlib

import onnx

from keras_selfattn.export.formats.onnx import graph as graph_lib

# Constants of at most this many elements are compared by value.
SMALL_ELEMENTS = 1024


def merge(proto: onnx.ModelProto) -> int:
    """Merges the nodes of the main graph and of its `Loop` bodies that
    compute the same values (module docstring).

    Args:
        proto: The model; changed in place.

    Returns:
        The number of nodes removed.
    """
    graph = proto.graph
    values = _small_constants(graph, {})
    removed = _merge_graph(graph, values)
    for node in graph.node:
        if node.op_type == "Loop":
            body = next(a.g for a in node.attribute if a.name == "body")
            removed += _merge_graph(body, _small_constants(body, values))
    if removed:  # the constants only the merged nodes read
        graph_lib.prune_dead(graph)
    return removed


def _small_constants(graph: onnx.GraphProto, outer: dict) -> dict[str, tuple]:
    """{initializer name: its value's key} for `graph`'s small initializers
    held in the file (not external data), with `outer`'s."""
    keys = dict(outer)
    for tensor in graph.initializer:
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            continue
        elements = 1
        for dim in tensor.dims:
            elements *= dim
        if elements > SMALL_ELEMENTS:
            continue
        value = graph_lib.initializer_value(tensor)
        digest = hashlib.sha256(value.tobytes()).hexdigest()
        keys[tensor.name] = ("value", str(value.dtype), value.shape, digest)
    return keys


def _node_key(node: onnx.NodeProto, inputs: tuple) -> tuple:
    attributes = tuple(sorted((a.name, a.SerializeToString()) for a in node.attribute))
    outputs = tuple(bool(name) for name in node.output)  # optional ones unnamed
    return (node.domain, node.op_type, inputs, attributes, outputs)


def _mergeable(node: onnx.NodeProto, written: set[str]) -> bool:
    """Whether `node` may be replaced by an equal earlier one."""
    if node.op_type in graph_lib.RANDOM_OPS or any(
        a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
        for a in node.attribute
    ):
        return False
    return not any(name in written for name in node.output)


def _merge_graph(graph: onnx.GraphProto, constants: dict[str, tuple]) -> int:
    """`merge`'s pass over one graph, its nodes in topological order."""
    written = {info.name for info in graph.output}
    renamed: dict[str, str] = {}
    first: dict[tuple, onnx.NodeProto] = {}
    doomed = []
    for node in graph.node:
        inputs = tuple(
            constants.get(renamed.get(name, name), renamed.get(name, name))
            for name in node.input
        )
        if not _mergeable(node, written):
            continue
        kept = first.setdefault(_node_key(node, inputs), node)
        if kept is node:
            continue
        for mine, theirs in zip(node.output, kept.output, strict=True):
            if mine:
                renamed[mine] = theirs
        doomed.append(node)
    if doomed:
        graph_lib.remove_nodes(graph, doomed)
        graph_lib.rename_inputs(graph.node, renamed)
    return len(doomed)
