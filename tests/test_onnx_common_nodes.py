"""`common_nodes.merge`: nodes computing the same value become one, their
constants compared by value, in the main graph and in `Loop` bodies (what a
generator's layers compute again each), and the graph computes what it did
(ONNX Runtime, before and after)."""

from __future__ import annotations

import collections

import numpy as np
import onnx
import onnxruntime
from onnx import TensorProto, helper, numpy_helper

from keras_selfattn.export.formats.onnx import common_nodes


def _constant(name: str, value) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(value, np.float32), name)


def _run(proto: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    session = onnxruntime.InferenceSession(proto.SerializeToString())
    return session.run(None, feeds)


def _ops(graph: onnx.GraphProto) -> collections.Counter:
    return collections.Counter(node.op_type for node in graph.node)


def test_equal_nodes_on_equal_constants_merge_in_the_main_graph():
    nodes = [
        # The same sum twice, its constants equal in value, not in name.
        helper.make_node("Add", ["x", "one_a"], ["a"]),
        helper.make_node("Add", ["x", "one_b"], ["b"]),
        helper.make_node("Add", ["x", "two"], ["c"]),  # another value: kept
        helper.make_node("Mul", ["a", "x"], ["y1"]),
        helper.make_node("Mul", ["b", "x"], ["y2"]),  # a graph output: kept
        helper.make_node("Mul", ["c", "x"], ["y3"]),
        # Random ops give other values each: never merged.
        helper.make_node("RandomUniformLike", ["x"], ["r1"], seed=1.0),
        helper.make_node("RandomUniformLike", ["x"], ["r2"], seed=1.0),
        helper.make_node("Add", ["r1", "r2"], ["y4"]),
    ]
    outputs = [
        helper.make_tensor_value_info(name, TensorProto.FLOAT, [3])
        for name in ("y1", "y2", "y3", "y4")
    ]
    graph = helper.make_graph(
        nodes,
        "main",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
        outputs,
        [
            _constant("one_a", [1, 1, 1]),
            _constant("one_b", [1, 1, 1]),
            _constant("two", [2, 2, 2]),
        ],
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    x = np.array([1.0, -2.0, 3.0], np.float32)
    before = _run(proto, {"x": x})
    assert common_nodes.merge(proto) == 1
    onnx.checker.check_model(proto, full_check=True)
    assert _ops(proto.graph) == {"Add": 3, "Mul": 3, "RandomUniformLike": 2}
    assert {t.name for t in proto.graph.initializer} == {"one_a", "two"}
    after = _run(proto, {"x": x})
    for old, new in zip(before[:3], after[:3], strict=True):
        np.testing.assert_array_equal(old, new)
    np.testing.assert_array_equal(after[0], (x + 1) * x)
    np.testing.assert_array_equal(after[1], (x + 1) * x)
    np.testing.assert_array_equal(after[2], (x + 2) * x)


def test_a_loop_bodys_repeated_nodes_merge_and_its_branches_read_the_kept_one():
    # Each "layer" of the body computes the step's offset again (from the
    # iteration number and an outer constant equal to the other's) and an
    # `If` branch reads the second copy from the outer scope.
    then_branch = helper.make_graph(
        [helper.make_node("Identity", ["offset_b"], ["picked"])],
        "then",
        [],
        [helper.make_tensor_value_info("picked", TensorProto.FLOAT, [])],
    )
    else_branch = helper.make_graph(
        [helper.make_node("Neg", ["offset_b"], ["negated"])],
        "else",
        [],
        [helper.make_tensor_value_info("negated", TensorProto.FLOAT, [])],
    )
    body = helper.make_graph(
        [
            helper.make_node("Cast", ["i"], ["i_float"], to=TensorProto.FLOAT),
            helper.make_node("Mul", ["i_float", "scale_a"], ["offset_a"]),
            helper.make_node("Cast", ["i"], ["i_float_b"], to=TensorProto.FLOAT),
            helper.make_node("Mul", ["i_float_b", "scale_b"], ["offset_b"]),
            helper.make_node("Add", ["total", "offset_a"], ["partial"]),
            helper.make_node(
                "If",
                ["flag"],
                ["branch"],
                then_branch=then_branch,
                else_branch=else_branch,
            ),
            helper.make_node("Add", ["partial", "branch"], ["total_out"]),
            helper.make_node("Identity", ["cond"], ["cond_out"]),
        ],
        "body",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
            helper.make_tensor_value_info("total", TensorProto.FLOAT, []),
        ],
        [
            helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
            helper.make_tensor_value_info("total_out", TensorProto.FLOAT, []),
        ],
    )
    graph = helper.make_graph(
        [helper.make_node("Loop", ["steps", "", "start"], ["total"], body=body)],
        "main",
        [
            helper.make_tensor_value_info("steps", TensorProto.INT64, []),
            helper.make_tensor_value_info("start", TensorProto.FLOAT, []),
            helper.make_tensor_value_info("flag", TensorProto.BOOL, []),
        ],
        [helper.make_tensor_value_info("total", TensorProto.FLOAT, [])],
        [_constant("scale_a", 0.5), _constant("scale_b", 0.5)],
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    feeds = {
        "steps": np.asarray(4, np.int64),
        "start": np.asarray(1.0, np.float32),
    }
    results = {}
    for flag in (True, False):
        results[flag] = _run(proto, {**feeds, "flag": np.asarray(flag)})[0]
    assert common_nodes.merge(proto) == 2
    onnx.checker.check_model(proto, full_check=True)
    merged_body = proto.graph.node[0].attribute[0].g
    assert _ops(merged_body)["Cast"] == 1 and _ops(merged_body)["Mul"] == 1
    assert [t.name for t in proto.graph.initializer] == ["scale_a"]
    # Offsets 0, 0.5, 1, 1.5: twice each (flag), or once minus once.
    assert results[True] == np.float32(1 + 2 * 3.0)
    assert results[False] == np.float32(1)
    for flag in (True, False):
        after = _run(proto, {**feeds, "flag": np.asarray(flag)})[0]
        np.testing.assert_array_equal(after, results[flag])
