"""Recognises one SelfAttention core in a converted ONNX graph (`analyse`).

The explicit path's core under `tracing.FUSABLE_CORE_SCOPE`, as tf2onnx
converts it, in the layer's order (`attention.score_mods`):

    Q, Transpose(K, (0, 1, 3, 2)) -> MatMul -> Mul(scale)
      -> soft-cap: Mul(1 / cap) -> Tanh -> Mul(cap)   (TensorFlow folds the
         two first multipliers into one: the scale is their product)
      -> Add(bias)      (the position bias plus `attention_bias`; the nodes
         computing it from positions may sit under the scope too)
      -> the bool mask's select -> Softmax -> (rows without a key: 0)
      -> MatMul(weights, V)

which is ONNX's `Attention(Q, K, V, attn_mask, scale, softcap)` with the
bias and the mask in one float `attn_mask` (`fused`). Sinks (one more logit
per head in the softmax's denominator) have no place in that operator.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
from onnx import TensorProto, helper

from keras_selfattn.export.formats.onnx import graph as og

# Ops the core may convert to outside its scores and bias; anything else (say,
# dropout's random ops) is not the computation Attention performs.
_CORE_OPS = frozenset(
    {"MatMul", "Transpose", "Mul", "Add", "Sub", "Softmax", "Where", "Not", "Cast"}
)


@dataclasses.dataclass(frozen=True)
class Core:
    """One recognised attention core, ready to replace.

    Attributes:
        nodes: The nodes the Attention node replaces (not the bias's).
        query, key, value: The (B, H, T, D) float32 inputs.
        mask: None, or the bool mask (True where allowed), rank 4.
        bias: None, or the float32 bias added to the scores, rank 4.
        output: The tensor the Attention node writes.
        scale: The multiplier of the raw scores.
        soft_cap: None, or the cap of `cap * tanh(scores / cap)`.
    """

    nodes: tuple[onnx.NodeProto, ...]
    query: str
    key: str
    value: str
    mask: str | None
    bias: str | None
    output: str
    scale: float
    soft_cap: float | None


class NotFusable(Exception):
    """A core that must keep its decomposed form; the message is the reason."""


def elem_type(types: dict[str, onnx.TypeProto], name: str) -> int | None:
    """The element type of tensor `name`, or None if unknown."""
    tensor_type = types.get(name)
    if tensor_type is None or not tensor_type.HasField("tensor_type"):
        return None
    return tensor_type.tensor_type.elem_type


def _rank(types: dict[str, onnx.TypeProto], name: str) -> int | None:
    tensor_type = types.get(name)
    if tensor_type is None or not tensor_type.tensor_type.HasField("shape"):
        return None
    return len(tensor_type.tensor_type.shape.dim)


def _only(nodes, op_type: str) -> list[onnx.NodeProto]:
    return [node for node in nodes if node.op_type == op_type]


def _reader(nodes, name: str) -> onnx.NodeProto | None:
    """The one node of `nodes` that reads `name`, or None."""
    found = [node for node in nodes if name in node.input]
    return found[0] if len(found) == 1 else None


def _factor(graph, node, name: str) -> float | None:
    """The scalar constant `node` (a Mul) multiplies `name` by, or None."""
    if node is None or node.op_type != "Mul":
        return None
    others = [other for other in node.input if other != name]
    value = og.constant_value(graph, others[0]) if len(others) == 1 else None
    if value is None or np.size(value) != 1:
        return None
    return float(np.asarray(value).reshape(()))


def _scale_and_cap(graph, nodes, scores: str, layer):
    """Walks the raw scores' multipliers and soft-cap.

    Returns:
        (scale, cap or None, the nodes walked, the tensor after them).
    """
    walked, factor, tensor = [], 1.0, scores
    node = _reader(nodes, tensor)
    while (value := _factor(graph, node, tensor)) is not None:
        walked.append(node)
        factor *= value
        tensor = node.output[0]
        node = _reader(nodes, tensor)
    cap = None
    if node is not None and node.op_type == "Tanh":
        after = _reader(nodes, node.output[0])
        cap = _factor(graph, after, node.output[0])
        if cap is None:
            raise NotFusable("its soft-cap's multiplier could not be read")
        walked += [node, after]
        factor *= cap  # cap * tanh(s * scale / cap)
        tensor = after.output[0]
    layer_cap = None if layer is None else layer.logit_soft_cap
    if layer is not None and (
        (layer_cap is None) != (cap is None)
        or (cap is not None and not np.isclose(cap, layer_cap, rtol=1e-6))
    ):
        raise NotFusable(
            f"the graph's soft-cap {cap} is not the layer's logit_soft_cap {layer_cap}"
        )
    layer_scale = None if layer is None else layer.effective_scale
    if not walked:
        if layer_scale is None or np.float32(layer_scale) != 1.0:
            raise NotFusable("the scores' scale could not be read from the graph")
    elif layer_scale is not None and not np.isclose(factor, layer_scale, rtol=1e-6):
        raise NotFusable(
            f"the graph's scale {factor:g} is not the layer's {layer_scale:g}"
        )
    return factor, cap, walked, tensor


def _upstream(graph, name: str) -> set[str]:
    """The tensors `name` is computed from, across the whole graph (itself
    included); a Shape's input is not among them: only its size is read."""
    producer = {output: node for node in graph.node for output in node.output}
    found, stack = set(), [name]
    while stack:
        tensor = stack.pop()
        if tensor in found:
            continue
        found.add(tensor)
        node = producer.get(tensor)
        if node is not None and node.op_type != "Shape":
            stack.extend(input_ for input_ in node.input if input_)
    return found


def _entering(nodes) -> set[str]:
    produced = {name for node in nodes for name in node.output if name}
    return {
        name for node in nodes for name in node.input if name and name not in produced
    }


def _bias(graph, nodes, scores: str, excluded: set[str], types):
    """The bias added to `scores`, its Add and the nodes computing it under
    the scope, or (None, None, []) when the scores' next op is not such an
    Add: an addend computed from the mask (or Q, K, V) is no bias (a mask's
    additive form). The bias's nodes may leave the scope and come back
    (tf2onnx's helpers of a Slice's ends)."""
    node = _reader(nodes, scores)
    if node is None or node.op_type != "Add" or len(set(node.input)) != 2:
        return None, None, []
    (bias,) = [name for name in node.input if name != scores]
    upstream = _upstream(graph, bias)
    if upstream & (excluded | {scores}):
        return None, None, []
    if elem_type(types, bias) != TensorProto.FLOAT or _rank(types, bias) != 4:
        raise NotFusable("the bias added to its scores is not a 4-D float32 tensor")
    computing = [n for n in nodes if any(name in upstream for name in n.output)]
    return bias, node, computing


def analyse(graph, nodes, types, readers, graph_outputs, layer) -> Core:
    """Checks one core group; raises NotFusable with the reason.

    Args:
        graph: The ONNX graph.
        nodes: The nodes under one call's core scope.
        types: Tensor name -> inferred type (`graph.value_types`).
        readers: Tensor name -> the nodes reading it (`graph.consumers`).
        graph_outputs: The graph's output names.
        layer: The SelfAttention layer of the core, or None if unknown.

    Returns:
        The recognised `Core`.
    """
    if layer is not None and layer.use_sinks:
        raise NotFusable(
            "use_sinks=True: ONNX's Attention op has no sink logits (one more "
            "logit per head in the softmax's denominator)"
        )
    inside = {id(node) for node in nodes}
    produced = {name for node in nodes for name in node.output if name}
    leaving = sorted(
        name
        for name in produced
        if name in graph_outputs
        or any(id(reader) not in inside for reader in readers.get(name, ()))
    )
    outputs = [n for n in nodes if n.op_type == "MatMul" and n.output[0] in leaving]
    if len(outputs) != 1:
        raise NotFusable("the attention core has an unrecognised structure")
    (out_node,) = outputs
    output = out_node.output[0]
    matmuls = _only(nodes, "MatMul")
    softmaxes = _only(nodes, "Softmax")
    if len(matmuls) != 2 or len(softmaxes) != 1:
        raise NotFusable("the attention core has an unrecognised structure")
    (scores_node,) = [node for node in matmuls if node is not out_node]
    transposes = [node for node in nodes if scores_node.input[1] in node.output]
    if (
        len(transposes) != 1
        or transposes[0].op_type != "Transpose"
        or list(helper.get_node_attr_value(transposes[0], "perm")) != [0, 1, 3, 2]
    ):
        raise NotFusable("the keys are not transposed as expected")
    query, key, value = scores_node.input[0], transposes[0].input[0], out_node.input[1]
    if query in produced or key in produced:
        raise NotFusable(
            "query/key are cast inside the core (a half-precision compute "
            "dtype); only float32 cores are fused"
        )
    masks = sorted(
        name
        for name in _entering(nodes)
        if elem_type(types, name) == TensorProto.BOOL
        and og.constant_value(graph, name) is None
    )
    scale, cap, walked, scores = _scale_and_cap(
        graph, nodes, scores_node.output[0], layer
    )
    bias, bias_add, computing = _bias(
        graph, nodes, scores, {*masks, query, key, value}, types
    )
    if layer is not None and layer.position_bias is not None and bias is None:
        raise NotFusable(f"its position bias ({layer.position_bias!r}) was not found")
    scored = [scores_node, *transposes, *walked, *([bias_add] if bias else [])]
    kept = {id(node) for node in computing}
    replaced = [node for node in nodes if id(node) not in kept]
    if set(leaving) - {output} - {name for n in computing for name in n.output}:
        raise NotFusable(
            "its attention weights are used outside the layer (e.g. exported "
            "with attention_outputs); the fused operator does not return them"
        )
    rest = [node for node in replaced if all(node is not s for s in scored)]
    unexpected = sorted({node.op_type for node in rest} - _CORE_OPS)
    if unexpected:
        raise NotFusable(f"unexpected ops {unexpected} in the attention core")
    computed = {
        name
        for name in _entering(rest) - produced
        if og.constant_value(graph, name) is None
    }
    if computed - set(masks) != {value} or len(masks) > 1:
        raise NotFusable("unexpected inputs enter the attention core")
    if not masks and sorted(node.op_type for node in rest) != ["MatMul", "Softmax"]:
        raise NotFusable("the core transforms its scores without a mask")
    dtypes = {elem_type(types, name) for name in (query, key, value)}
    if dtypes != {TensorProto.FLOAT}:
        names = sorted(
            helper.tensor_dtype_to_np_dtype(d).name if d else "unknown" for d in dtypes
        )
        raise NotFusable(
            f"query/key/value are {'/'.join(names)}; only float32 cores are fused"
        )
    if any(_rank(types, name) != 4 for name in (query, key, value)):
        raise NotFusable("query/key/value are not (batch, heads, time, dim)")
    mask = masks[0] if masks else None
    if mask is not None and _rank(types, mask) != 4:
        raise NotFusable("the mask entering the core is not a 4-D bool tensor")
    return Core(tuple(replaced), query, key, value, mask, bias, output, scale, cap)
