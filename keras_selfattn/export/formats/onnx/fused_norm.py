"""Replaces RMS norms in an ONNX graph by ONNX's RMSNormalization op (opset 23).

Keras's and keras-hub's RMS norms (keras-hub's `LlamaLayerNorm` and the
norms written like it, Gemma's `x * (1 + scale)`,
`keras.ops.rms_normalization`, hence `keras.layers.RMSNormalization`)
convert through tf2onnx to one chain, about 7 kernels per norm:

    Pow(x, 2) | Mul(x, x)
      -> GlobalAveragePool(.) | ReduceMean(., axes=[-1], keepdims=1)
      -> Add(., epsilon) -> Sqrt -> Reciprocal  (or Div(1, Sqrt(.)))
      -> Mul(x, .) -> Mul(., scale)

which is `RMSNormalization(x, scale, epsilon, axis)`: tf2onnx writes a
mean over axes 2 to the last as GlobalAveragePool (axis 2; a rank-3
activation's last axis), ReduceMean over the last axis as it is (axis -1).
A chain is replaced only where it is exactly that: every intermediate
tensor read by the next node of the chain alone (and no graph output), the
exponent 2, epsilon a float32 constant of one element (hence `x` float32:
ONNX's Add takes one type; read from the graph or, in a `Loop` body, from
the graphs around it), the scale a float32 tensor of rank 1 (a constant or
a tensor whose type is inferred: Gemma's `1 + scale`, computed once in
front of a generator's loop), the square and the product reading one `x`.
A norm that centres its input keeps its form: LayerNormalization (and
Keras's `LayerNormalization(rms_scaling=True)`, a variance) squares `x -
mean` but multiplies `x`; casts between the steps break the chain too.

The rewrite works on a model already at opset 23 (`fused.upgrade`), in the
main graph and in every `Loop`/`If`/`Scan` body, recursively. RMSNormalization
computes in float32 (`stash_type` 1), `x * (1 / sqrt(mean(x^2) + eps)) *
scale` as the chain does, up to float32 rounding.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
from onnx import TensorProto, helper

from keras_selfattn.export.formats.onnx import graph as og


@dataclasses.dataclass(frozen=True)
class _Norm:
    """One recognised RMS norm chain."""

    nodes: tuple[onnx.NodeProto, ...]
    x: str
    scale: str
    epsilon: float
    axis: int
    output: str


def fuse_rms_norms(
    proto: onnx.ModelProto, types: dict[str, onnx.TypeProto] | None = None
) -> int:
    """Replaces every recognised RMS norm chain (module docstring).

    Args:
        proto: A model at opset 23 or later; changed in place.
        types: Tensor name -> inferred type of the main graph
            (`graph.value_types(proto)`), or None to infer them.

    Returns:
        How many norms became one RMSNormalization node each.

    Example:

    >>> proto = fused.upgrade(proto)  # doctest: +SKIP
    >>> fuse_rms_norms(proto)  # doctest: +SKIP
    9
    """
    if types is None:
        types = og.value_types(proto)
    return _fuse_graph(proto.graph, {}, types)


def _constants(graph: onnx.GraphProto) -> dict[str, np.ndarray]:
    """The graph's initializers and Constant outputs of one element or a
    rank-1 tensor (epsilons, exponents, scales), by name."""
    values = {}
    for initializer in graph.initializer:
        if len(initializer.dims) <= 1:
            values[initializer.name] = og.initializer_value(initializer)
    for node in graph.node:
        if node.op_type == "Constant":
            value = og.constant_value(graph, node.output[0])
            if value is not None and np.ndim(value) <= 1:
                values[node.output[0]] = value
    return values


def _fuse_graph(
    graph: onnx.GraphProto,
    outer: dict[str, np.ndarray],
    types: dict[str, onnx.TypeProto],
) -> int:
    """Fuses `graph`'s chains, then its nodes' subgraphs' (which see `graph`'s
    constants as outer-scope values); returns how many."""
    constants = {**outer, **_constants(graph)}
    count = 0
    for node in graph.node:
        for attribute in node.attribute:
            bodies = list(attribute.graphs)
            if attribute.HasField("g"):
                bodies.append(attribute.g)
            for body in bodies:
                count += _fuse_graph(body, constants, types)
    norms = _find(graph, constants, types)
    if norms:
        og.remove_nodes(graph, [node for norm in norms for node in norm.nodes])
        graph.node.extend(_replacement(norm) for norm in norms)
        og.prune_dead(graph)
        og.topological_sort(graph)
    return count + len(norms)


def _replacement(norm: _Norm) -> onnx.NodeProto:
    name = f"{norm.output}/RMSNormalization"
    return helper.make_node(
        "RMSNormalization",
        [norm.x, norm.scale],
        [norm.output],
        name,
        axis=norm.axis,
        epsilon=norm.epsilon,
    )


def _find(graph, constants, types) -> list[_Norm]:
    readers = og.consumers(graph)
    outputs = {info.name for info in graph.output}
    found, taken = [], set()
    for node in graph.node:
        norm = _match(node, readers, outputs, constants, types)
        if norm is not None and not taken & {id(n) for n in norm.nodes}:
            taken.update(id(n) for n in norm.nodes)
            found.append(norm)
    return found


def _scalar(constants, name: str) -> float | None:
    """The value of a float32 constant of one element, or None."""
    value = constants.get(name)
    if value is None or np.size(value) != 1 or value.dtype != np.float32:
        return None
    return float(np.asarray(value).reshape(()))


def _sole_reader(readers, outputs, node, op_types) -> onnx.NodeProto | None:
    """The one node reading `node`'s output, if its op is one of `op_types`
    and the output is no graph output."""
    name = node.output[0]
    reading = readers.get(name, [])
    if name in outputs or len(reading) != 1 or reading[0].op_type not in op_types:
        return None
    return reading[0]


def _other(node, name: str) -> str | None:
    """The input of a binary `node` that is not `name` (None if both are)."""
    others = [other for other in node.input if other != name]
    return others[0] if len(others) == 1 and len(node.input) == 2 else None


def _squares(node, constants) -> str | None:
    """The `x` that `node` squares (Pow(x, 2) or Mul(x, x)), or None."""
    if node.op_type == "Pow" and _scalar(constants, node.input[1]) == 2.0:
        return node.input[0]
    if node.op_type == "Mul" and node.input[0] == node.input[1]:
        return node.input[0]
    return None


def _mean_axis(node, constants) -> int | None:
    """The RMSNormalization axis of the mean `node`, or None."""
    if node.op_type == "GlobalAveragePool":
        return 2
    if node.op_type != "ReduceMean":
        return None
    attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if attributes.get("keepdims", 1) != 1:
        return None
    axes = attributes.get("axes")
    if axes is None and len(node.input) > 1:
        axes = constants.get(node.input[1])
    return -1 if axes is not None and list(np.ravel(axes)) == [-1] else None


def _inverse_root(add, mean: str, readers, outputs, constants):
    """From `add` (mean + epsilon): (epsilon, the nodes, the 1 / sqrt tensor),
    or None. A float32 epsilon makes the mean, hence `x`, float32 (ONNX's
    Add takes one type)."""
    epsilon = _scalar(constants, _other(add, mean) or "")
    root = _sole_reader(readers, outputs, add, {"Sqrt"})
    if epsilon is None or root is None:
        return None
    inverse = _sole_reader(readers, outputs, root, {"Reciprocal", "Div"})
    if inverse is None or (
        inverse.op_type == "Div"
        and (
            inverse.input[1] != root.output[0]
            or _scalar(constants, inverse.input[0]) != 1.0
        )
    ):
        return None
    return epsilon, [add, root, inverse], inverse.output[0]


def _is_float32_vector(types, constants, name: str) -> bool:
    value = constants.get(name)
    if value is not None:
        return value.dtype == np.float32 and value.ndim == 1
    tensor = types.get(name)
    if tensor is None or not tensor.tensor_type.HasField("shape"):
        return False
    return (
        tensor.tensor_type.elem_type == TensorProto.FLOAT
        and len(tensor.tensor_type.shape.dim) == 1
    )


def _products(inverse, inv: str, x: str, readers, outputs, constants, types):
    """The two Muls after 1 / sqrt, `(x * inv) * scale` or `x * (inv *
    scale)` (tf2onnx's order in a prompt pass): (scale, first, second), or
    None."""
    first = _sole_reader(readers, outputs, inverse, {"Mul"})
    second = None if first is None else _sole_reader(readers, outputs, first, {"Mul"})
    if second is None:
        return None
    if _other(first, inv) == x:
        scale = _other(second, first.output[0])
    elif _other(second, first.output[0]) == x:
        scale = _other(first, inv)
    else:
        return None
    if scale is None or not _is_float32_vector(types, constants, scale):
        return None
    return scale, first, second


def _match(node, readers, outputs, constants, types) -> _Norm | None:
    x = _squares(node, constants)
    if x is None:
        return None
    mean = _sole_reader(readers, outputs, node, {"GlobalAveragePool", "ReduceMean"})
    axis = None if mean is None else _mean_axis(mean, constants)
    if axis is None:
        return None
    add = _sole_reader(readers, outputs, mean, {"Add"})
    inverse = (
        None
        if add is None
        else _inverse_root(add, mean.output[0], readers, outputs, constants)
    )
    if inverse is None:
        return None
    epsilon, root_nodes, inv = inverse
    products = _products(root_nodes[-1], inv, x, readers, outputs, constants, types)
    if products is None:
        return None
    scale, first, second = products
    return _Norm(
        (node, mean, *root_nodes, first, second),
        x,
        scale,
        epsilon,
        axis,
        second.output[0],
    )
