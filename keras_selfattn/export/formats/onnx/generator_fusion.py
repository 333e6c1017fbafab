"""Fewer kernels per token in an ONNX generator: opset 23's fused ops.

A generator (a graph with a `Loop` over the new tokens) runs every kernel
of its loop body once per token, each a wait on ONNX Runtime's thread
pool. `fuse_generator`

1. upgrades the model to opset 23 (`fused.upgrade`), on a copy without its
   large weights (`loop_select.light_copy`: onnx's converter and shape
   inference serialize the model, 2 GiB at most), whose nodes then replace
   the model's own;
2. replaces the prompt pass's SelfAttention cores by ONNX's Attention op
   (`fused.fuse_attention`, the forward export's `fuse_attention=True`),
   quietly: a core it does not recognise keeps its form;
3. replaces the loop body's decoding-step attention (the single-query
   path's cores under `tracing.FUSABLE_STEP_SCOPE`) by transposes of the
   query, the cache's keys and values and the mask and ONNX's Attention op
   (`loop_attention`): about 30 kernels per layer and token become 5;
   a core it does not recognise keeps its form, with the reason logged;
4. replaces every RMS norm chain, in the prompt pass and in the loop body,
   by RMSNormalization (`fused_norm`): about 7 kernels per norm become 1.

The numbers are the decomposed graph's up to float32 rounding; the
export's check compares the generator's tokens with Keras's `generate` in
a fresh ONNX Runtime process. Where the installed onnx cannot write opset 23
or the installed ONNX Runtime cannot run it (`runs_fused_ops`), or onnx's
converter cannot upgrade one of the model's ops, the generator keeps its
opset and decomposed ops; a fused file needs
an ONNX Runtime that runs opset 23's RMSNormalization and Attention.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator

import keras
import onnx

from keras_selfattn.export.formats.onnx import (
    fused,
    fused_norm,
    loop_attention,
    loop_select,
)
from keras_selfattn.export.formats.onnx import graph as og


@functools.cache
def runs_fused_ops() -> bool:
    """Whether the installed onnx writes opset 23 and the installed ONNX
    Runtime runs its RMSNormalization and Attention on the CPU."""
    if onnx.defs.onnx_opset_version() < fused.FUSED_OPSET:
        return False
    try:
        import onnxruntime
    except ImportError:
        return False
    make, info = onnx.helper.make_node, onnx.helper.make_tensor_value_info
    floats = onnx.TensorProto.FLOAT
    graph = onnx.helper.make_graph(
        [
            make("RMSNormalization", ["x", "scale"], ["normed"]),
            make("Attention", ["normed", "normed", "normed"], ["y"]),
        ],
        "probe",
        [info("x", floats, [1, 1, 1, 2]), info("scale", floats, [2])],
        [info("y", floats, [1, 1, 1, 2])],
    )
    model = onnx.helper.make_model(
        graph, opset_imports=[onnx.helper.make_opsetid("", fused.FUSED_OPSET)]
    )
    model.ir_version = onnx.helper.find_min_ir_version_for(model.opset_import, True)
    try:
        onnxruntime.InferenceSession(
            model.SerializeToString(), providers=["CPUExecutionProvider"]
        )
    except Exception:  # noqa: BLE001 - any failure: the runtime cannot run it
        return False
    return True


@contextlib.contextmanager
def _quiet(logger: logging.Logger) -> Iterator[None]:
    """`logger` silent below ERROR while active."""
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def fuse_generator(proto: onnx.ModelProto, model: keras.Model) -> onnx.ModelProto:
    """The generator `proto` with opset 23's fused ops (module docstring).

    Args:
        proto: A converted generator (opset 13 to 23), after
            `loop_invariant.optimize_loops`.
        model: What was converted (its SelfAttention layers' scales).

    Returns:
        `proto`, changed in place (opset 23); unchanged where
        `runs_fused_ops()` is False or onnx cannot convert the model to
        opset 23 (an int8 generator's BitwiseAnd).

    Example:

    >>> proto = fuse_generator(proto, model)  # doctest: +SKIP
    >>> sum(n.op_type == "RMSNormalization" for n in proto.graph.node)  # doctest: +SKIP
    9
    """
    if not runs_fused_ops():
        return proto
    try:
        light = fused.upgrade(loop_select.light_copy(proto))
    except RuntimeError:  # onnx's converter lacks an op's adapter (BitwiseAnd)
        return proto
    with _quiet(fused.logger):
        light, _ = fused.fuse_attention(light, model)
    loop_attention.fuse_loop_attention(light, model)
    fused_norm.fuse_rms_norms(light, og.value_types(light))
    _graft(proto, light)
    return proto


def _graft(proto: onnx.ModelProto, light: onnx.ModelProto) -> None:
    """`light`'s nodes, small initializers and opset into `proto`, whose
    large initializers (`light`'s inputs) stay where they are."""
    graph = proto.graph
    kept = {info.name for info in light.graph.input}
    for index in reversed(range(len(graph.initializer))):
        if graph.initializer[index].name not in kept:
            del graph.initializer[index]
    graph.initializer.extend(light.graph.initializer)
    del graph.node[:]
    graph.node.extend(light.graph.node)
    del proto.opset_import[:]
    proto.opset_import.extend(light.opset_import)
    proto.ir_version = light.ir_version
    og.prune_dead(graph)
