"""A generator's decoding-step attention as ONNX's Attention op, in its `Loop`.

Each step of a generator's `Loop` computes every SelfAttention layer's
attention of one new position over the cache on the single-query path,
under the name scope `tracing.FUSABLE_STEP_SCOPE` (the contract with this
pass); tf2onnx keeps TensorFlow's op names, so every node of one call's
step core shares the prefix ".../<layer scope>/fusable_step_core/".
`fuse_loop_attention` groups each `Loop` body's nodes by that prefix,
checks each group (`step_core.analyse`: its inputs, its ops, and what it
computes on random inputs, against the layer's attention) and replaces a
group that passes by ONNX's Attention op (scale, softcap; the key/value
heads shared by their query heads' group, `step_core.replacement`): for a
batch-major cache, of reshapes of the query, the keys and the values to
(B, time, heads * D) and the mask transposed; for a time-major one, of
transposes to (B, heads, time, D). About 5 kernels per layer and token
where tf2onnx's form runs about 30.
A group that fails a check keeps its decomposed form; each
layer's outcome is logged on this module's logger at INFO ("layer 'x':
fused ..." or "layer 'x': not fused (reason)") and returned as
`fused.LayerFusion`s.

The numbers are the decomposed step's up to float32 rounding (Attention
sums in its own order); the generator export's check compares the
generator's tokens with Keras's `generate`.
"""

from __future__ import annotations

import logging

import keras
import onnx

from keras_selfattn._model_layers import every_layer
from keras_selfattn.export.formats.onnx import fused, step_core
from keras_selfattn.export.formats.onnx import graph as og
from keras_selfattn.export.formats.onnx.fused_core import NotFusable
from keras_selfattn.self_attention import SelfAttention
from keras_selfattn.tracing import FUSABLE_STEP_SCOPE

logger = logging.getLogger(__name__)

_MARKER = f"/{FUSABLE_STEP_SCOPE}/"


def _elem_types(proto: onnx.ModelProto) -> dict[str, int]:
    """Tensor name -> element type, in the main graph and its `Loop` bodies
    (onnx's shape inference on a copy)."""
    inferred = onnx.shape_inference.infer_shapes(proto).graph
    infos = [*inferred.input, *inferred.output, *inferred.value_info]
    for node in inferred.node:
        if node.op_type == "Loop":
            body = next(a.g for a in node.attribute if a.name == "body")
            infos += [*body.input, *body.output, *body.value_info]
    types = {info.name: info.type.tensor_type.elem_type for info in infos}
    types.update((i.name, i.data_type) for i in inferred.initializer)
    return types


def _fuse_body(body, outer, proto, layers, types, counts, reasons) -> None:
    """Replaces `body`'s recognised step cores; counts them by layer."""
    constants = og.ScopedConstants([body, outer])
    readers = og.consumers(body)
    cores = {}
    for prefix, nodes in fused.scope_groups(body, _MARKER).items():
        label = fused.layer_for(prefix, layers, _MARKER) or prefix[: -len(_MARKER)]
        layer = layers.get(label)
        try:
            cores[prefix] = step_core.analyse(
                body, nodes, constants, types, readers, proto.opset_import, layer
            )
        except NotFusable as error:
            reasons[label] = str(error)
            continue
        counts[label] = counts.get(label, 0) + 1
    if not cores:
        return
    og.remove_nodes(body, [node for core in cores.values() for node in core.nodes])
    for prefix, core in cores.items():
        body.node.extend(step_core.replacement(core, f"{prefix}FusedAttention"))
    og.prune_dead(body)
    og.topological_sort(body)


def fuse_loop_attention(
    proto: onnx.ModelProto, model: keras.Model
) -> tuple[fused.LayerFusion, ...]:
    """Fuses every recognised step core of `proto`'s `Loop` bodies.

    Args:
        proto: A generator at opset 23 (`fused.upgrade`); changed in place.
        model: What was converted; its SelfAttention layers give each
            core's heads, sizes, scale and soft-cap.

    Returns:
        One `fused.LayerFusion` per layer with a step core in a `Loop`
        body, each also logged (INFO).

    Example:

    >>> fusions = fuse_loop_attention(proto, model)  # doctest: +SKIP
    >>> [f.message() for f in fusions]  # doctest: +SKIP
    ["layer 'self_attention': fused into 4 ONNX Attention nodes (one per call)"]
    """
    layers = {
        layer.name: layer
        for layer in every_layer(model)
        if isinstance(layer, SelfAttention)
    }
    types = _elem_types(proto)
    counts: dict[str, int] = {}
    reasons: dict[str, str] = {}
    for node in proto.graph.node:
        if node.op_type == "Loop":
            body = next(a.g for a in node.attribute if a.name == "body")
            _fuse_body(body, proto.graph, proto, layers, types, counts, reasons)
    results = tuple(
        fused.LayerFusion(label, counts.get(label, 0), reasons.get(label))
        for label in sorted(set(counts) | set(reasons))
    )
    for result in results:
        logger.info(result.message())
    return results
