"""The ONNX Loop passes (`loop_invariant`, `loop_shapes`, `loop_select`) on a
hand-written loop: the same outputs as numpy, the work moved where the
passes say."""

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
onnxruntime = pytest.importorskip("onnxruntime")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from keras_selfattn.export.formats.onnx import loop_invariant  # noqa: E402

STEPS = 3
WEIGHT = np.array(
    [[0.5, -1.0, 2.0, 0.25], [1.5, 0.5, -0.5, 1.0], [-1.0, 2.0, 0.5, -0.25]],
    np.float32,
)


def _loop_model() -> onnx.ModelProto:
    """x <- tanh(x @ W + W's column sums) per step (reshaped to x's own
    shape on the way), W passed through the
    loop as tf2onnx writes captured tensors; each step emits
    where(temperature > 0, the top-2 indices' sum, argmin(x)) as tf2onnx
    writes an integer select: Add(Mul(Cast(c), a), Mul(b, Cast(Not(c))))."""
    make = helper.make_node
    body_nodes = [
        make("Identity", ["cond_in"], ["cond_out"]),
        make("Identity", ["w_in"], ["w_out"]),
        make("Identity", ["c_in"], ["c_out"]),
        make("ReduceSum", ["w_in", "axes0"], ["colsum"], keepdims=1),
        make("MatMul", ["x_in", "w_in"], ["xw"]),
        make("Add", ["xw", "colsum"], ["pre"]),
        make("Shape", ["x_in"], ["x_shape"]),
        make("Reshape", ["pre", "x_shape"], ["pre_shaped"]),
        make("Tanh", ["pre_shaped"], ["x_out"]),
        make("Cast", ["c_in"], ["c_int"], to=TensorProto.INT32),
        make("Not", ["c_in"], ["not_c"]),
        make("Cast", ["not_c"], ["not_c_int"], to=TensorProto.INT32),
        make("TopK", ["x_out", "two"], ["top_values", "top_indices"]),
        make("ReduceSum", ["top_indices", "axes1"], ["top_sum"], keepdims=0),
        make("Cast", ["top_sum"], ["sampled"], to=TensorProto.INT32),
        make("ArgMin", ["x_out"], ["low"], axis=1, keepdims=0),
        make("Cast", ["low"], ["greedy"], to=TensorProto.INT32),
        make("Mul", ["c_int", "sampled"], ["picked_sampled"]),
        make("Mul", ["greedy", "not_c_int"], ["picked_greedy"]),
        make("Add", ["picked_sampled", "picked_greedy"], ["token"]),
    ]
    body = helper.make_graph(
        body_nodes,
        "body",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
            helper.make_tensor_value_info("x_in", TensorProto.FLOAT, ["batch", 4]),
            helper.make_tensor_value_info("w_in", TensorProto.FLOAT, [4, 4]),
            helper.make_tensor_value_info("c_in", TensorProto.BOOL, []),
        ],
        [
            helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
            helper.make_tensor_value_info("x_out", TensorProto.FLOAT, ["batch", 4]),
            helper.make_tensor_value_info("w_out", TensorProto.FLOAT, [4, 4]),
            helper.make_tensor_value_info("c_out", TensorProto.BOOL, []),
            helper.make_tensor_value_info("token", TensorProto.INT32, ["batch"]),
        ],
        [
            numpy_helper.from_array(np.array([0], np.int64), "axes0"),
            numpy_helper.from_array(np.array([1], np.int64), "axes1"),
            numpy_helper.from_array(np.array([2], np.int64), "two"),
        ],
    )
    weight = np.concatenate([WEIGHT, WEIGHT[:1] * 0.5])
    nodes = [
        make("Greater", ["temperature", "zero"], ["c"]),
        make(
            "Loop",
            ["steps", "true", "x0", "w", "c"],
            ["x_final", "w_final", "c_final", "tokens"],
            body=body,
        ),
    ]
    graph = helper.make_graph(
        nodes,
        "loop",
        [
            helper.make_tensor_value_info("x0", TensorProto.FLOAT, ["batch", 4]),
            helper.make_tensor_value_info("temperature", TensorProto.FLOAT, []),
        ],
        [
            helper.make_tensor_value_info("x_final", TensorProto.FLOAT, ["batch", 4]),
            helper.make_tensor_value_info(
                "tokens", TensorProto.INT32, [STEPS, "batch"]
            ),
        ],
        [
            numpy_helper.from_array(weight, "w"),
            numpy_helper.from_array(np.array(STEPS, np.int64), "steps"),
            numpy_helper.from_array(np.array(True), "true"),
            numpy_helper.from_array(np.array(0.0, np.float32), "zero"),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _reference(x0, temperature):
    weight = np.concatenate([WEIGHT, WEIGHT[:1] * 0.5])
    x, tokens = x0, []
    for _ in range(STEPS):
        x = np.tanh(x @ weight + weight.sum(0, keepdims=True))
        if temperature > 0:
            tokens.append(np.argsort(-x, kind="stable")[:, :2].sum(-1))
        else:
            tokens.append(np.argmin(x, 1))
    return x, np.stack(tokens).astype(np.int32)


def _run(model, x0, temperature):
    session = onnxruntime.InferenceSession(
        model.SerializeToString(), providers=["CPUExecutionProvider"]
    )
    feed = {"x0": x0, "temperature": np.array(temperature, np.float32)}
    return session.run(["x_final", "tokens"], feed)


@pytest.fixture(scope="module")
def models():
    original = _loop_model()
    optimized = _loop_model()
    loop_invariant.optimize_loops(optimized)
    onnx.checker.check_model(optimized, full_check=True)
    return original, optimized


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_same_outputs_as_numpy(models, temperature):
    x0 = np.random.default_rng(3).standard_normal((2, 4)).astype(np.float32)
    want_x, want_tokens = _reference(x0, temperature)
    for model in models:
        x, tokens = _run(model, x0, temperature)
        np.testing.assert_allclose(x, want_x, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(tokens, want_tokens)


def test_work_moved_out_of_the_body(models):
    _, optimized = models
    (loop,) = [node for node in optimized.graph.node if node.op_type == "Loop"]
    body = next(a.g for a in loop.attribute if a.name == "body")
    # The weight and the condition read from outside: only x is carried.
    assert [info.name for info in body.input] == ["i", "cond_in", "x_in"]
    assert len(loop.input) == 3
    ops = [node.op_type for node in body.node]
    # W's column sums, the casts of c and x's shape (batch, 4): once,
    # before the loop.
    assert "ReduceSum" not in ops and "Not" not in ops and "Shape" not in ops
    assert "ReduceSum" in [node.op_type for node in optimized.graph.node]
    # The sampling branch sits in an If on c; the select is gone.
    (branch,) = [node for node in body.node if node.op_type == "If"]
    assert list(branch.input) == ["c"]
    then = next(a.g for a in branch.attribute if a.name == "then_branch")
    assert "TopK" in [node.op_type for node in then.node]
    assert "TopK" not in ops and "Mul" not in ops
