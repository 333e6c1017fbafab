"""Small ONNX graph utilities for rewriting passes: lookups, order, pruning."""

from __future__ import annotations

import collections
import contextlib
import contextvars
import heapq
from collections.abc import Callable, Iterable, Iterator

import onnx
from onnx import numpy_helper

# Ops whose output differs between two runs on the same inputs: never
# hoisted out of a loop (`loop_invariant`) nor merged (`common_nodes`).
RANDOM_OPS = frozenset(
    {
        "Bernoulli",
        "Multinomial",
        "RandomNormal",
        "RandomNormalLike",
        "RandomUniform",
        "RandomUniformLike",
    }
)


def _subgraph_inputs(node: onnx.NodeProto) -> set[str]:
    """Names a node's subgraphs (If/Loop/Scan bodies) read from outer scopes."""
    names: set[str] = set()
    for attribute in node.attribute:
        graphs = list(attribute.graphs)
        if attribute.HasField("g"):
            graphs.append(attribute.g)
        for graph in graphs:
            for inner in graph.node:
                names.update(name for name in inner.input if name)
                names.update(_subgraph_inputs(inner))
    return names


def has_op(graph: onnx.GraphProto, op_type: str) -> bool:
    """Whether a node of `graph` or of its subgraphs, at any depth, is an
    `op_type`."""
    for node in graph.node:
        if node.op_type == op_type:
            return True
        for attribute in node.attribute:
            graphs = [
                *attribute.graphs,
                *([attribute.g] if attribute.HasField("g") else []),
            ]
            if any(has_op(inner, op_type) for inner in graphs):
                return True
    return False


def node_inputs(node: onnx.NodeProto) -> set[str]:
    """Every tensor `node` reads, its subgraphs' outer-scope reads included."""
    return {name for name in node.input if name} | _subgraph_inputs(node)


def consumers(graph: onnx.GraphProto) -> dict[str, list[onnx.NodeProto]]:
    """Tensor name -> nodes that read it (subgraph reads count)."""
    result: dict[str, list[onnx.NodeProto]] = collections.defaultdict(list)
    for node in graph.node:
        for name in node_inputs(node):
            result[name].append(node)
    return result


# The folder of the file that holds the external data of the initializers
# being read (`external.WeightFile`), while `external_data_in` runs.
_EXTERNAL_FOLDER = contextvars.ContextVar("external_folder", default="")


@contextlib.contextmanager
def external_data_in(folder: str) -> Iterator[None]:
    """Initializers' values (`initializer_value`) read from external data in
    `folder` while active."""
    token = _EXTERNAL_FOLDER.set(folder)
    try:
        yield
    finally:
        _EXTERNAL_FOLDER.reset(token)


def initializer_value(initializer: onnx.TensorProto):
    """The numpy value of `initializer`, read from its external data file
    if it has one (in the folder of `external_data_in`)."""
    return numpy_helper.to_array(initializer, base_dir=_EXTERNAL_FOLDER.get())


def constant_value(graph: onnx.GraphProto, name: str):
    """The numpy value of an initializer or Constant node output, or None."""
    for initializer in graph.initializer:
        if initializer.name == name:
            return initializer_value(initializer)
    for node in graph.node:
        if node.op_type == "Constant" and name in node.output:
            for attribute in node.attribute:
                if attribute.name == "value":
                    return numpy_helper.to_array(attribute.t)
    return None


class ScopedConstants:
    """The constant tensors a `Loop` body sees (its own, then the graphs
    around it), read on demand: name -> numpy value."""

    def __init__(self, graphs: list[onnx.GraphProto]):
        self._graphs = graphs  # innermost first
        self._values: dict = {}

    def get(self, name: str):
        """`name`'s value, or None where it is not a constant."""
        if name not in self._values:
            found = (constant_value(graph, name) for graph in self._graphs)
            self._values[name] = next((v for v in found if v is not None), None)
        return self._values[name]

    def __contains__(self, name: str) -> bool:
        return self.get(name) is not None

    def __getitem__(self, name: str):
        value = self.get(name)
        if value is None:
            raise KeyError(name)
        return value


def value_types(model: onnx.ModelProto) -> dict[str, onnx.TypeProto]:
    """Tensor name -> inferred type (shape inference on a copy of `model`)."""
    inferred = onnx.shape_inference.infer_shapes(model)
    graph = inferred.graph
    types = {
        info.name: info.type
        for info in list(graph.input) + list(graph.output) + list(graph.value_info)
    }
    for initializer in graph.initializer:
        types[initializer.name] = onnx.helper.make_tensor_type_proto(
            initializer.data_type, list(initializer.dims)
        )
    return types


def topological_sort(graph: onnx.GraphProto) -> None:
    """Reorders `graph.node` so every node follows its inputs' producers.

    Stable: nodes keep their relative order where the dependencies allow.

    Raises:
        ValueError: if the graph has a cycle.
    """
    nodes = list(graph.node)
    produced_by = {name: i for i, node in enumerate(nodes) for name in node.output}
    waiting = [0] * len(nodes)
    dependents: dict[int, list[int]] = collections.defaultdict(list)
    for i, node in enumerate(nodes):
        for name in node_inputs(node):
            if name in produced_by:
                waiting[i] += 1
                dependents[produced_by[name]].append(i)
    ready = [i for i, count in enumerate(waiting) if count == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        i = heapq.heappop(ready)
        order.append(i)
        for j in dependents[i]:
            waiting[j] -= 1
            if waiting[j] == 0:
                heapq.heappush(ready, j)
    if len(order) != len(nodes):
        raise ValueError("The ONNX graph has a cycle; cannot order its nodes.")
    del graph.node[:]
    graph.node.extend(nodes[i] for i in order)


def rename_inputs(nodes: Iterable[onnx.NodeProto], renamed: dict[str, str]) -> None:
    """Replaces the names in `renamed` among the nodes' inputs, their
    subgraphs' included."""
    for node in nodes:
        for i, name in enumerate(node.input):
            if name in renamed:
                node.input[i] = renamed[name]
        for attribute in node.attribute:
            graphs = list(attribute.graphs)
            if attribute.HasField("g"):
                graphs.append(attribute.g)
            for graph in graphs:
                rename_inputs(graph.node, renamed)
                for output in graph.output:
                    if output.name in renamed:
                        output.name = renamed[output.name]


def remove_nodes(graph: onnx.GraphProto, doomed: Iterable[onnx.NodeProto]) -> None:
    """Removes the given nodes (compared by identity) from `graph`."""
    doomed_ids = {id(node) for node in doomed}
    kept = [node for node in graph.node if id(node) not in doomed_ids]
    del graph.node[:]
    graph.node.extend(kept)


def prune_dead(graph: onnx.GraphProto) -> int:
    """Removes nodes and initializers nothing reads; returns nodes removed."""
    outputs = {info.name for info in graph.output}
    removed = 0
    while True:
        read = set(outputs)
        for node in graph.node:
            read.update(node_inputs(node))
        dead = [
            node for node in graph.node if not any(name in read for name in node.output)
        ]
        if not dead:
            break
        remove_nodes(graph, dead)
        removed += len(dead)
    read = set(outputs)
    for node in graph.node:
        read.update(node_inputs(node))
    # Deleted in place: rebuilding the field would copy every weight.
    for index in reversed(range(len(graph.initializer))):
        if graph.initializer[index].name not in read:
            del graph.initializer[index]
    produced = {name for node in graph.node for name in node.output}
    kept_info = [info for info in graph.value_info if info.name in produced]
    del graph.value_info[:]
    graph.value_info.extend(kept_info)
    return removed


def rewrite_with_bodies(
    proto: onnx.ModelProto,
    rewrite: Callable[[onnx.GraphProto, onnx.GraphProto], int],
) -> int:
    """Runs `rewrite(graph, main graph)` on `proto`'s main graph, then on
    each of its `Loop` bodies, and prunes the dead nodes of each graph it
    changed (a body first: the main graph's values it read count as read);
    returns the sum of `rewrite`'s counts."""
    graph = proto.graph
    count = rewrite(graph, graph)
    for node in graph.node:
        if node.op_type == "Loop":
            body = next(a.g for a in node.attribute if a.name == "body")
            rewritten = rewrite(body, graph)
            if rewritten:
                prune_dead(body)
            count += rewritten
    if count:
        prune_dead(graph)
    return count
