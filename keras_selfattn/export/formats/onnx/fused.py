"""Replaces each SelfAttention core in an ONNX graph by ONNX's Attention op.

`SelfAttention` computes its full-attention core under the name scope
`fusable_core.FUSABLE_CORE_SCOPE` (the contract with this pass): (B, H, T, K)
query and key, (B, H, T, V) value and a bool mask broadcastable to
(B, 1, T, T) in, `softmax(Q K^T * scale)` with masked keys at weight 0 times
V out, (B, H, T, V). tf2onnx keeps TensorFlow's
op names, so after conversion every node of one call's core shares the
prefix ".../<layer scope>/fusable_attention_core/". `fuse_attention`

1. upgrades the model to opset 23 with `onnx.version_converter` (the first
   opset with Attention) and sets the lowest IR version that opset needs;
2. groups the nodes by that prefix and checks each group's structure: one
   tensor leaves it, made by a MatMul whose second input is V; one other
   MatMul reads Q and Transpose(K, perm (0, 1, 3, 2)); the scores are
   multiplied by a scalar constant equal to the layer's scale (TensorFlow
   drops a multiplication by 1); at most one bool tensor (the mask) and no
   other computed tensor enters; Q, K and V are float32;
3. replaces a group that passes by `Attention(Q, K, V, mask)` with that
   scale, the mask expanded along the query axis to (B, 1, T, T) (onnxruntime
   rejects (B, 1, 1, T)), writing the group's output tensor, so the
   projections, the layer's query-mask multiply and the rest of the model are
   untouched; then removes the nodes left dead.

A group that fails a check keeps its decomposed form, with the reason. The
layers are reported by name (`LayerFusion`) and logged on this module's
logger: "layer 'x': fused ..." (INFO) or "layer 'x': not fused (reason)"
(WARNING). Where no key is allowed, onnxruntime's Attention returns zeros,
as the layer does; the export's numeric check compares with Keras anyway.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
from collections.abc import Iterator

import keras
import numpy as np
import onnx
from onnx import TensorProto, helper, version_converter

from keras_selfattn.export.formats.onnx import graph as og
from keras_selfattn.fusable_core import FUSABLE_CORE_SCOPE
from keras_selfattn.self_attention import SelfAttention

FUSED_OPSET = 23
logger = logging.getLogger(__name__)

_MARKER = f"/{FUSABLE_CORE_SCOPE}/"
# TensorFlow makes a name scope unique by appending "_<n>" (Keras's layer
# scopes come out as "<layer name>_1").
_UNIQUE_SUFFIX = re.compile(r"_[0-9]+$")
# Ops the core may convert to; anything else (say, dropout's random ops) is
# not the computation Attention performs.
_CORE_OPS = frozenset(
    {"MatMul", "Transpose", "Mul", "Add", "Sub", "Softmax", "Where", "Not", "Cast"}
)

# The whole core of a layer without any mask, as tf2onnx converts it (without
# the Mul when the scale is 1).
_UNMASKED_OPS = (
    sorted(["Transpose", "MatMul", "Mul", "Softmax", "MatMul"]),
    sorted(["Transpose", "MatMul", "Softmax", "MatMul"]),
)


@dataclasses.dataclass(frozen=True)
class LayerFusion:
    """What `fuse_attention` did with one SelfAttention layer.

    Attributes:
        layer: The layer's name (or the core's scope if no layer matches).
        fused: How many of its calls became one Attention node each.
        reason: Why (some of) its calls kept the decomposed form, or None.
    """

    layer: str
    fused: int
    reason: str | None

    def message(self) -> str:
        """The log line, e.g. "layer 'attention': not fused (reason)"."""
        if self.reason is None:
            nodes = (
                "one ONNX Attention node"
                if self.fused == 1
                else (f"{self.fused} ONNX Attention nodes (one per call)")
            )
            return f"layer {self.layer!r}: fused into {nodes}"
        if self.fused:
            return (
                f"layer {self.layer!r}: {self.fused} call(s) fused, others not "
                f"fused ({self.reason})"
            )
        return f"layer {self.layer!r}: not fused ({self.reason})"


@dataclasses.dataclass(frozen=True)
class _Core:
    """One recognised attention core, ready to replace."""

    nodes: tuple[onnx.NodeProto, ...]
    query: str
    key: str
    value: str
    mask: str | None
    output: str
    scale: float


class _NotFusable(Exception):
    """A core that must keep its decomposed form; the message is the reason."""


def upgrade(proto: onnx.ModelProto) -> onnx.ModelProto:
    """`proto` converted to opset `FUSED_OPSET`, with the lowest IR version
    that opset allows (onnx writes a newer one than onnxruntime reads)."""
    upgraded = version_converter.convert_version(proto, FUSED_OPSET)
    upgraded.ir_version = helper.find_min_ir_version_for(
        list(upgraded.opset_import), True
    )
    return upgraded


def _attention_layers(model: keras.Model) -> list[SelfAttention]:
    """The SelfAttention layers among `model`'s tracked layers, at any depth
    (an exported endpoint wraps those whose weights it returns)."""
    found, stack = [], list(model._layers)
    while stack:
        layer = stack.pop(0)
        if isinstance(layer, SelfAttention):
            if layer not in found:
                found.append(layer)
            continue
        stack.extend(layer._layers)
    return found


def _layer_for(prefix: str, layers: dict[str, SelfAttention]) -> str | None:
    """The name of the layer whose core has this node-name prefix, if any."""
    scope = prefix[: -len(_MARKER)].rsplit("/", 1)[-1]
    for candidate in (_UNIQUE_SUFFIX.sub("", scope), scope):
        if candidate in layers:
            return candidate
    return None


def _groups(graph: onnx.GraphProto) -> dict[str, list[onnx.NodeProto]]:
    groups: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        if _MARKER in node.name:
            prefix = node.name[: node.name.index(_MARKER) + len(_MARKER)]
            groups.setdefault(prefix, []).append(node)
    return groups


def _elem_type(types: dict[str, onnx.TypeProto], name: str) -> int | None:
    tensor_type = types.get(name)
    if tensor_type is None or not tensor_type.HasField("tensor_type"):
        return None
    return tensor_type.tensor_type.elem_type


def _rank(types: dict[str, onnx.TypeProto], name: str) -> int | None:
    tensor_type = types.get(name)
    if tensor_type is None or not tensor_type.tensor_type.HasField("shape"):
        return None
    return len(tensor_type.tensor_type.shape.dim)


def _only(nodes: list[onnx.NodeProto], op_type: str) -> list[onnx.NodeProto]:
    return [node for node in nodes if node.op_type == op_type]


def _scale(graph, nodes, scores: str, layer_scale: float | None) -> float:
    """The multiplier of the raw scores, checked against the layer's.

    TensorFlow drops a multiplication by 1.0, so a core whose scores go on
    unscaled has scale 1, accepted only when the layer says so.
    """
    readers = [node for node in nodes if scores in node.input]
    value = None
    if len(readers) == 1 and readers[0].op_type == "Mul":
        others = [name for name in readers[0].input if name != scores]
        if len(others) == 1:
            value = og.constant_value(graph, others[0])
    if value is None:
        if layer_scale is not None and np.float32(layer_scale) == 1.0:
            return 1.0
        raise _NotFusable("the scores' scale could not be read from the graph")
    if np.size(value) != 1:
        raise _NotFusable("the scores' scale is not a scalar constant")
    scale = float(np.asarray(value).reshape(()))
    if layer_scale is not None and not np.isclose(scale, layer_scale, rtol=1e-6):
        raise _NotFusable(
            f"the graph's scale {scale:g} is not the layer's {layer_scale:g}"
        )
    return scale


def _analyse(graph, nodes, types, readers, graph_outputs, layer_scale) -> _Core:
    """Checks one core group; raises _NotFusable with the reason."""
    unexpected = sorted({n.op_type for n in nodes} - _CORE_OPS)
    if unexpected:
        raise _NotFusable(f"unexpected ops {unexpected} in the attention core")
    inside = {id(node) for node in nodes}
    produced = {name for node in nodes for name in node.output if name}
    leaving = sorted(
        name
        for name in produced
        if name in graph_outputs
        or any(id(reader) not in inside for reader in readers.get(name, ()))
    )
    if len(leaving) != 1:
        raise _NotFusable(
            "its attention weights are used outside the layer (e.g. exported "
            "with attention_outputs); the fused operator does not return them"
        )
    (output,) = leaving
    (out_node,) = [node for node in nodes if output in node.output]
    matmuls = _only(nodes, "MatMul")
    softmaxes = _only(nodes, "Softmax")
    if out_node.op_type != "MatMul" or len(matmuls) != 2 or len(softmaxes) != 1:
        raise _NotFusable("the attention core has an unrecognised structure")
    (scores_node,) = [node for node in matmuls if node is not out_node]
    transposes = [node for node in nodes if scores_node.input[1] in node.output]
    if (
        len(transposes) != 1
        or transposes[0].op_type != "Transpose"
        or list(helper.get_node_attr_value(transposes[0], "perm")) != [0, 1, 3, 2]
    ):
        raise _NotFusable("the keys are not transposed as expected")
    query, key, value = scores_node.input[0], transposes[0].input[0], out_node.input[1]
    if query in produced or key in produced:
        raise _NotFusable(
            "query/key are cast inside the core (a half-precision compute "
            "dtype); only float32 cores are fused"
        )
    entering = {
        name for node in nodes for name in node.input if name and name not in produced
    }
    masks = sorted(
        name for name in entering if _elem_type(types, name) == TensorProto.BOOL
    )
    computed = {name for name in entering if og.constant_value(graph, name) is None}
    if computed - set(masks) != {query, key, value} or len(masks) > 1:
        raise _NotFusable("unexpected inputs enter the attention core")
    if not masks and sorted(node.op_type for node in nodes) not in _UNMASKED_OPS:
        raise _NotFusable("the core transforms its scores without a mask")
    dtypes = {_elem_type(types, name) for name in (query, key, value)}
    if dtypes != {TensorProto.FLOAT}:
        names = sorted(
            helper.tensor_dtype_to_np_dtype(d).name if d else "unknown" for d in dtypes
        )
        raise _NotFusable(
            f"query/key/value are {'/'.join(names)}; only float32 cores are fused"
        )
    if any(_rank(types, name) != 4 for name in (query, key, value)):
        raise _NotFusable("query/key/value are not (batch, heads, time, dim)")
    mask = masks[0] if masks else None
    if mask is not None and (
        _elem_type(types, mask) != TensorProto.BOOL or _rank(types, mask) != 4
    ):
        raise _NotFusable("the mask entering the core is not a 4-D bool tensor")
    scale = _scale(graph, nodes, scores_node.output[0], layer_scale)
    return _Core(tuple(nodes), query, key, value, mask, output, scale)


def _replacement(core: _Core, prefix: str) -> tuple[list, list]:
    """The Attention node (and mask expansion) that computes `core.output`."""
    name = f"{prefix}FusedAttention"
    nodes, initializers = [], []
    inputs = [core.query, core.key, core.value]
    if core.mask is not None:
        ones = helper.make_tensor(f"{name}/ones", TensorProto.INT64, [2], [1, 1])
        one = helper.make_tensor(f"{name}/one", TensorProto.INT64, [1], [1])
        initializers += [ones, one]
        nodes += [
            helper.make_node(
                "Shape", [core.query], [f"{name}/time"], f"{name}/time", start=2, end=3
            ),
            helper.make_node(
                "Concat",
                [ones.name, f"{name}/time", one.name],
                [f"{name}/mask_shape"],
                f"{name}/mask_shape",
                axis=0,
            ),
            # (B or 1, 1, 1 or T, T) -> (B or 1, 1, T, T): the CPU kernel
            # needs the query axis.
            helper.make_node(
                "Expand",
                [core.mask, f"{name}/mask_shape"],
                [f"{name}/mask"],
                f"{name}/mask",
            ),
        ]
        inputs.append(f"{name}/mask")
    nodes.append(
        helper.make_node("Attention", inputs, [core.output], name, scale=core.scale)
    )
    return nodes, initializers


def _replace(graph: onnx.GraphProto, cores: dict[str, _Core]) -> None:
    """Swaps every core for its Attention node (one pass: the node protos
    of `cores` are the graph's own until the graph's node list is rebuilt)."""
    og.remove_nodes(graph, [node for core in cores.values() for node in core.nodes])
    for prefix, core in cores.items():
        nodes, initializers = _replacement(core, prefix)
        graph.node.extend(nodes)
        graph.initializer.extend(initializers)
    og.prune_dead(graph)
    og.topological_sort(graph)


def fuse_attention(
    proto: onnx.ModelProto, model: keras.Model
) -> tuple[onnx.ModelProto, tuple[LayerFusion, ...]]:
    """Upgrades `proto` to opset 23 and fuses every recognised attention core.

    Args:
        proto: The tf2onnx conversion of `model` (opset 13 to 18).
        model: What was converted; its SelfAttention layers are reported by
            name.

    Returns:
        The new model (opset 23, IR version 11) and one `LayerFusion` per
        SelfAttention layer (plus one per unmatched core), each also logged.

    Example:

    >>> proto, fusions = fuse_attention(proto, model)  # doctest: +SKIP
    >>> [f.message() for f in fusions]  # doctest: +SKIP
    ["layer 'attention': fused into one ONNX Attention node"]
    """
    proto = upgrade(proto)
    graph = proto.graph
    layers = {layer.name: layer for layer in _attention_layers(model)}
    types = og.value_types(proto)
    readers = og.consumers(graph)
    graph_outputs = {info.name for info in graph.output}
    cores: dict[str, _Core] = {}
    fused: dict[str, int] = {}
    reasons: dict[str, str] = {}
    for prefix, nodes in _groups(graph).items():
        label = _layer_for(prefix, layers) or prefix[: -len(_MARKER)]
        try:
            layer_scale = layers[label].effective_scale if label in layers else None
            core = _analyse(graph, nodes, types, readers, graph_outputs, layer_scale)
        except _NotFusable as error:
            reasons[label] = str(error)
            continue
        cores[prefix] = core
        fused[label] = fused.get(label, 0) + 1
    _replace(graph, cores)
    for name, layer in layers.items():
        if name not in fused and name not in reasons:
            reasons[name] = (
                f"chunk_size={layer.chunk_size}: it computes attention in query "
                "blocks to bound memory, which one Attention node would not"
                if layer.chunk_size is not None
                else "its attention core was not found in the converted graph"
            )
    results = tuple(
        LayerFusion(label, fused.get(label, 0), reasons.get(label))
        for label in list(layers) + sorted((set(fused) | set(reasons)) - set(layers))
    )
    for result in results:
        level = logging.INFO if result.reason is None else logging.WARNING
        logger.log(level, result.message())
    return proto, results


class _Collector(logging.Handler):
    def __init__(self, lines: list[str]):
        super().__init__(logging.INFO)
        self.lines = lines

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@contextlib.contextmanager
def collect_log() -> Iterator[list[str]]:
    """Collects this module's log lines (fused / not fused) while active.

    Example:

    >>> with collect_log() as lines:  # doctest: +SKIP
    ...     export_onnx(model, "model.onnx", fuse_attention=True)
    >>> print("\\n".join(lines))  # doctest: +SKIP
    layer 'attention': fused into one ONNX Attention node
    """
    lines: list[str] = []
    handler = _Collector(lines)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
