"""Replaces each SelfAttention core in an ONNX graph by ONNX's Attention op.

`SelfAttention` computes its full-attention core under the name scope
`tracing.FUSABLE_CORE_SCOPE` (the contract with this pass): (B, H, T, K)
query and key, (B, H, T, V) value, a bool mask broadcastable to (B, 1, T, T)
and the layer's score modifications in, `softmax(mask(cap * tanh(Q K^T *
scale / cap) + bias))` times V out, (B, H, T, V). tf2onnx keeps TensorFlow's
op names, so after conversion every node of one call's core shares the
prefix ".../<layer scope>/fusable_attention_core/". `fuse_attention`

1. upgrades the model to opset 23 with `onnx.version_converter` (the first
   opset with Attention) and sets the lowest IR version that opset needs;
2. groups the nodes by that prefix and checks each group's structure
   (`fused_core.analyse`): one tensor leaves it, made by a MatMul whose
   second input is V; one other MatMul reads Q and Transpose(K, perm (0, 1,
   3, 2)); the scores are multiplied by scalar constants whose product is
   the layer's scale (TensorFlow drops a multiplication by 1), soft-capped
   as the layer's `logit_soft_cap` says, and plus one float32 bias (ALiBi,
   T5's relative bias, `attention_bias`, their sum) where the layer adds
   one; at most one bool tensor (the mask) and no other computed tensor
   enters; Q, K and V are float32; the layer has no sinks (ONNX's Attention
   has no sink logit);
3. replaces a group that passes by `Attention(Q, K, V, attn_mask)` with that
   scale and `softcap`, writing the group's output tensor, so the
   projections, the layer's query-mask multiply and the rest of the model are
   untouched; `attn_mask` is the mask, the bias, or both in one float tensor
   (the bias where allowed, -inf elsewhere), expanded along the query axis
   to (B or 1, H or 1, T, T) (onnxruntime rejects (B, 1, 1, T)); then
   removes the nodes left dead. The bias's own nodes stay.

A group that fails a check keeps its decomposed form, with the reason. The
layers are reported by name (`LayerFusion`) and logged on this module's
logger: "layer 'x': fused ..." (INFO) or "layer 'x': not fused (reason)"
(WARNING). Where no key is allowed (a row of -inf), onnxruntime's Attention
returns zeros, as the layer does; ONNX Attention applies the soft-cap to the
scaled scores before adding attn_mask, the layer's order. The export's
numeric check compares with Keras anyway.
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

from keras_selfattn._model_layers import every_layer
from keras_selfattn.export.formats.onnx import graph as og
from keras_selfattn.export.formats.onnx.fused_core import Core, NotFusable, analyse
from keras_selfattn.self_attention import SelfAttention
from keras_selfattn.tracing import FUSABLE_CORE_SCOPE

FUSED_OPSET = 23
logger = logging.getLogger(__name__)

_MARKER = f"/{FUSABLE_CORE_SCOPE}/"
# TensorFlow makes a name scope unique by appending "_<n>" (Keras's layer
# scopes come out as "<layer name>_1").
_UNIQUE_SUFFIX = re.compile(r"_[0-9]+$")


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
    return [layer for layer in every_layer(model) if isinstance(layer, SelfAttention)]


def layer_for(
    prefix: str, layers: dict[str, SelfAttention], marker: str = _MARKER
) -> str | None:
    """The name of the layer whose core has this node-name prefix (ending
    in `marker`, its scope's), if any."""
    scope = prefix[: -len(marker)].rsplit("/", 1)[-1]
    for candidate in (_UNIQUE_SUFFIX.sub("", scope), scope):
        if candidate in layers:
            return candidate
    return None


def scope_groups(
    graph: onnx.GraphProto, marker: str = _MARKER
) -> dict[str, list[onnx.NodeProto]]:
    """`graph`'s nodes under the name scope `marker`, by call: node-name
    prefix -> nodes."""
    groups: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        if marker in node.name:
            prefix = node.name[: node.name.index(marker) + len(marker)]
            groups.setdefault(prefix, []).append(node)
    return groups


def _replacement(core: Core, prefix: str) -> tuple[list, list]:
    """The Attention node (and its attn_mask) that computes `core.output`.

    The attn_mask: the bool mask, or the float bias, or both in one float
    tensor (the bias where allowed, -inf elsewhere: a select, so a
    non-finite bias at a masked position changes nothing; onnxruntime
    outputs zeros for a row whose every entry is -inf, as the layer does).
    It is expanded along the query axis to (B or 1, H or 1, T, T):
    onnxruntime rejects a query axis of 1.
    """
    name = f"{prefix}FusedAttention"
    nodes, initializers = [], []
    inputs = [core.query, core.key, core.value]
    attn_mask = core.bias if core.mask is None else core.mask
    if core.mask is not None and core.bias is not None:
        lowest = helper.make_tensor(f"{name}/-inf", TensorProto.FLOAT, [], [-np.inf])
        initializers.append(lowest)
        attn_mask = f"{name}/masked_bias"
        nodes.append(
            helper.make_node(
                "Where", [core.mask, core.bias, lowest.name], [attn_mask], attn_mask
            )
        )
    if attn_mask is not None:
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
            helper.make_node(
                "Expand",
                [attn_mask, f"{name}/mask_shape"],
                [f"{name}/mask"],
                f"{name}/mask",
            ),
        ]
        inputs.append(f"{name}/mask")
    attributes = {"scale": core.scale}
    if core.soft_cap is not None:
        attributes["softcap"] = core.soft_cap
    nodes.append(
        helper.make_node("Attention", inputs, [core.output], name, **attributes)
    )
    return nodes, initializers


def _replace(graph: onnx.GraphProto, cores: dict[str, Core]) -> None:
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
    cores: dict[str, Core] = {}
    fused: dict[str, int] = {}
    reasons: dict[str, str] = {}
    for prefix, nodes in scope_groups(graph).items():
        label = layer_for(prefix, layers) or prefix[: -len(_MARKER)]
        try:
            core = analyse(
                graph, nodes, types, readers, graph_outputs, layers.get(label)
            )
        except NotFusable as error:
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
