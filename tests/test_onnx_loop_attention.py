"""The decoding step's attention as ONNX's Attention op in a `Loop` body
(`loop_attention`, `step_core`): a hand-written single-query core under
`tracing.FUSABLE_STEP_SCOPE` (grouped heads, a bool key mask, the cache
batch-first) becomes transposes and one Attention node with numpy's
numbers; a core computing something else than its layer's attention, or
a layer with sinks, keeps its form, with the reason. The keras-hub
generators' fused steps: tests/test_onnx_generator_fusion.py."""

from __future__ import annotations

import collections

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
onnxruntime = pytest.importorskip("onnxruntime")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from keras_selfattn import SelfAttention  # noqa: E402
from keras_selfattn.export.formats.onnx import fused, loop_attention  # noqa: E402
from keras_selfattn.tracing import FUSABLE_STEP_SCOPE  # noqa: E402

BATCH, KEYS, HEADS, KV_HEADS, DEPTH = 2, 6, 4, 2, 8
GROUPS = HEADS // KV_HEADS
STEPS_IN_LOOP = 2
PREFIX = f"step/self_attention/{FUSABLE_STEP_SCOPE}/"


def _layer(**options) -> SelfAttention:
    layer = SelfAttention(
        num_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        key_dim=DEPTH,
        name="self_attention",
        **options,
    )
    layer.build((None, None, HEADS * DEPTH))
    return layer


def _model(scale: float) -> onnx.ModelProto:
    """`final` = STEPS_IN_LOOP x the attention of query (B, 1, H, D) over
    key/value (B, T, H_kv, D) under `mask` (B, T, 1, 1), summed by a Loop
    whose body computes it as the single-query path's products and sums
    (scores scaled by `scale`), read back by a Reshape to (B, H * D)."""
    make = helper.make_node

    def core(op, inputs, name, **attributes):
        return make(op, inputs, [PREFIX + name], PREFIX + name, **attributes)

    p = PREFIX
    nodes = [
        core("Reshape", ["query", "grouped_shape"], "grouped"),  # (B,1,Hkv,G,D)
        core("Unsqueeze", ["key", "axis_3"], "keys"),  # (B, T, Hkv, 1, D)
        core("Mul", [p + "grouped", p + "keys"], "products"),
        core("ReduceSum", [p + "products", "axis_last"], "raw", keepdims=0),
        core("Mul", [p + "raw", "scale"], "scores"),  # (B, T, Hkv, G)
        core("Where", ["mask", p + "scores", "lowest"], "masked"),
        core("ReduceMax", [p + "masked", "axis_1"], "top"),
        core("Sub", [p + "masked", p + "top"], "centred"),
        core("Exp", [p + "centred"], "exp"),
        core("ReduceSum", [p + "exp", "axis_1"], "total"),
        core("Div", [p + "exp", p + "total"], "weights"),
        core("Unsqueeze", [p + "weights", "axis_4"], "weights5"),
        core("Unsqueeze", ["value", "axis_3"], "values"),  # (B, T, Hkv, 1, D)
        core("Mul", [p + "weights5", p + "values"], "weighted"),
        core("ReduceSum", [p + "weighted", "axis_1"], "heads", keepdims=0),
    ]
    info = helper.make_tensor_value_info
    body = helper.make_graph(
        [
            helper.make_node("Identity", ["cond_in"], ["cond_out"]),
            *nodes,
            make("Reshape", [p + "heads", "flat_shape"], ["flat"]),
            make("Add", ["acc_in", "flat"], ["acc_out"]),
        ],
        "body",
        [
            info("i", TensorProto.INT64, []),
            info("cond_in", TensorProto.BOOL, []),
            info("acc_in", TensorProto.FLOAT, None),
        ],
        [
            info("cond_out", TensorProto.BOOL, []),
            info("acc_out", TensorProto.FLOAT, None),
        ],
    )
    constants = {
        "grouped_shape": np.array([-1, 1, KV_HEADS, GROUPS, DEPTH], np.int64),
        "flat_shape": np.array([-1, HEADS * DEPTH], np.int64),
        "axis_1": np.array([1], np.int64),
        "axis_3": np.array([3], np.int64),
        "axis_4": np.array([4], np.int64),
        "axis_last": np.array([-1], np.int64),
        "scale": np.array(scale, np.float32),
        "lowest": np.array(np.finfo(np.float32).min, np.float32),
        "zeros": np.zeros((BATCH, HEADS * DEPTH), np.float32),
        "steps": np.array(STEPS_IN_LOOP, np.int64),
        "true": np.array(True),
    }
    graph = helper.make_graph(
        [make("Loop", ["steps", "true", "zeros"], ["final"], body=body)],
        "step",
        [
            info("query", TensorProto.FLOAT, ["batch", 1, HEADS, DEPTH]),
            info("key", TensorProto.FLOAT, ["batch", "time", KV_HEADS, DEPTH]),
            info("value", TensorProto.FLOAT, ["batch", "time", KV_HEADS, DEPTH]),
            info("mask", TensorProto.BOOL, ["batch", "time", 1, 1]),
        ],
        [info("final", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(v, k) for k, v in constants.items()],
    )
    return fused.upgrade(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    )


def _inputs() -> dict:
    rng = np.random.default_rng(3)
    mask = rng.random((BATCH, KEYS)) < 0.5
    mask[:, -1] = True
    return {
        "query": rng.standard_normal((BATCH, 1, HEADS, DEPTH)).astype(np.float32),
        "key": rng.standard_normal((BATCH, KEYS, KV_HEADS, DEPTH)).astype(np.float32),
        "value": rng.standard_normal((BATCH, KEYS, KV_HEADS, DEPTH)).astype(np.float32),
        "mask": mask[:, :, None, None],
    }


def _expected(feed: dict, scale: float) -> np.ndarray:
    """numpy: query head h attends key/value head h // GROUPS."""
    query = feed["query"][:, 0].astype(np.float64)  # (B, H, D)
    key = np.repeat(feed["key"], GROUPS, axis=2)  # (B, T, H, D)
    value = np.repeat(feed["value"], GROUPS, axis=2)
    scores = np.einsum("bhd,bthd->bht", query, key) * scale
    scores = np.where(feed["mask"][:, None, :, 0, 0], scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    heads = np.einsum("bht,bthd->bhd", weights, value)
    return STEPS_IN_LOOP * heads.reshape(BATCH, HEADS * DEPTH)


def _body_ops(proto) -> collections.Counter:
    (loop,) = proto.graph.node
    return collections.Counter(node.op_type for node in loop.attribute[0].g.node)


def _run(proto, feed) -> np.ndarray:
    session = onnxruntime.InferenceSession(
        proto.SerializeToString(), providers=["CPUExecutionProvider"]
    )
    return session.run(None, feed)[0]


def test_a_step_core_becomes_attention_with_numpy_s_numbers():
    scale = 1 / np.sqrt(DEPTH)
    proto = _model(scale)
    feed = _inputs()
    np.testing.assert_allclose(_run(proto, feed), _expected(feed, scale), atol=1e-5)
    (result,) = loop_attention.fuse_loop_attention(proto, _layer())
    assert (result.layer, result.fused, result.reason) == ("self_attention", 1, None)
    ops = _body_ops(proto)
    # Batch-major keys and values: reshaped to Attention's 3-D inputs (no
    # copy of the cache), only the mask transposed.
    assert ops["Attention"] == 1 and ops["Transpose"] == 1, ops
    assert ops["Exp"] == ops["ReduceSum"] == 0, ops
    body = proto.graph.node[0].attribute[0].g
    (attention,) = [n for n in body.node if n.op_type == "Attention"]
    heads = {a.name: a.i for a in attention.attribute if a.type == a.INT}
    assert heads == {"q_num_heads": HEADS, "kv_num_heads": KV_HEADS}, heads
    np.testing.assert_allclose(
        _run(proto, feed), _expected(feed, scale), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize(
    "layer, reason",
    [
        (lambda: _layer(scale=0.5), "does not compute the layer's attention"),
        (lambda: _layer(use_sinks=True), "sink"),
    ],
    ids=["another_scale", "sinks"],
)
def test_a_core_that_is_not_the_layer_s_attention_is_left_alone(layer, reason):
    proto = _model(1 / np.sqrt(DEPTH))  # the layer's scale would be 0.5
    before = proto.SerializeToString()
    (result,) = loop_attention.fuse_loop_attention(proto, layer())
    assert result.fused == 0 and reason in result.reason, result
    assert proto.SerializeToString() == before
