"""`shape_probes.body_shapes` on hand-written loops: a cache written as
`format.dynamic_update_slice` writes it and read up to the step, a size
clamped by a constant, a state that grows. The shapes it claims are
checked against the semantics of the ops (and the loop runs in
onnxruntime); what it cannot prove it leaves out."""

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
onnxruntime = pytest.importorskip("onnxruntime")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from keras_selfattn.export.formats.onnx import shape_probes  # noqa: E402

LENGTH, WIDTH, STEPS = 6, 2, 3


def _const(name, values):
    return numpy_helper.from_array(np.array(values, np.int64), name)


def _cache_write(update, operand, start, out):
    """`tf2onnx_handlers.dynamic_update_slice`'s nodes: `update` written
    into `operand` at `start` (int64 [rank]) by a ScatterND over the first
    two axes (the last one the update spans whole)."""
    make = helper.make_node
    one = helper.make_tensor("one", TensorProto.INT64, [1], [1])
    columns = []
    nodes = [
        make("Shape", [operand], [f"{out}_operand_shape"]),
        make("Shape", [update], [f"{out}_update_shape"]),
        make("Sub", [f"{out}_operand_shape", f"{out}_update_shape"], [f"{out}_limit"]),
        make("Min", [start, f"{out}_limit"], [f"{out}_low"]),
        make("Max", [f"{out}_low", "zero1"], [f"{out}_start"]),
        make("Slice", [f"{out}_update_shape", "zero1", "two1"], [f"{out}_leading"]),
        make("ConstantOfShape", [f"{out}_leading"], [f"{out}_ones"], value=one),
    ]
    for axis, (at, past) in enumerate([("zero1", "one1"), ("one1", "two1")]):
        column = f"{out}_column{axis}"
        nodes += [
            make(
                "CumSum",
                [f"{out}_ones", f"axis{axis}"],
                [f"{column}_count"],
                exclusive=1,
            ),
            make("Slice", [f"{out}_start", at, past], [f"{column}_first"]),
            make("Add", [f"{column}_count", f"{column}_first"], [f"{column}_sum"]),
            make("Unsqueeze", [f"{column}_sum", "minus1"], [column]),
        ]
        columns.append(column)
    return nodes + [
        make("Concat", columns, [f"{out}_grid"], axis=-1),
        make("ScatterND", [operand, f"{out}_grid", update], [out]),
    ]


def _model(grow: bool = False) -> onnx.ModelProto:
    """Each step writes x (batch, 1, WIDTH) into the cache (batch, LENGTH,
    WIDTH) at the step, sums the cache up to the step over its length
    ("summed", (batch, WIDTH)) and takes x's first 4 and first 2 rows
    ("clamped", "pair": min(batch, 4) and min(batch, 2) rows); with `grow`,
    the cache gains a row each step instead."""
    make = helper.make_node
    nodes = [
        make("Identity", ["cond_in"], ["cond_out"]),
        make("Identity", ["x_in"], ["x_out"]),
        make("Reshape", ["i", "one1"], ["i1"]),
        make("Concat", ["zero1", "i1", "zero1"], ["start"], axis=0),
    ]
    if grow:
        nodes.append(make("Concat", ["cache_in", "x_in"], ["cache_out"], axis=1))
    else:
        nodes += _cache_write("x_in", "cache_in", "start", "cache_out")
    nodes += [
        make("Add", ["i1", "one1"], ["stop"]),
        make("Slice", ["cache_out", "zero1", "stop", "one1"], ["seen"]),
        make("ReduceSum", ["seen", "one1"], ["summed"], keepdims=0),
        make("Shape", ["summed"], ["summed_shape"]),
        make("Shape", ["seen"], ["seen_shape"]),
        make("Slice", ["x_in", "zero1", "four1", "zero1"], ["clamped"]),
        make("Shape", ["clamped"], ["clamped_shape"]),
        make("Slice", ["x_in", "zero1", "two1", "zero1"], ["pair"]),
        make("Shape", ["pair"], ["pair_shape"]),
    ]
    state = ["batch", "grown" if grow else LENGTH, WIDTH]
    body = helper.make_graph(
        nodes,
        "body",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
            helper.make_tensor_value_info(
                "x_in", TensorProto.FLOAT, ["batch", 1, WIDTH]
            ),
            helper.make_tensor_value_info("cache_in", TensorProto.FLOAT, state),
        ],
        [
            helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
            helper.make_tensor_value_info("x_out", TensorProto.FLOAT, None),
            helper.make_tensor_value_info("cache_out", TensorProto.FLOAT, None),
            helper.make_tensor_value_info("summed", TensorProto.FLOAT, None),
        ],
        [
            _const("one1", [1]),
            _const("zero1", [0]),
            _const("four1", [4]),
            _const("two1", [2]),
            _const("axis0", 0),
            _const("axis1", 1),
            _const("minus1", [-1]),
        ],
    )
    graph = helper.make_graph(
        [
            make("Shape", ["x"], ["x_shape"]),
            make("Slice", ["x_shape", "zero1", "one1"], ["batch_size"]),
            make("Concat", ["batch_size", "length_width"], ["cache_shape"], axis=0),
            make("ConstantOfShape", ["cache_shape"], ["cache0"]),
            make(
                "Loop",
                ["steps", "true", "x", "cache0"],
                ["x_final", "cache_final", "sums"],
                body=body,
            ),
        ],
        "loop",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 1, WIDTH])],
        [helper.make_tensor_value_info("sums", TensorProto.FLOAT, None)],
        [
            _const("steps", STEPS),
            numpy_helper.from_array(np.array(True), "true"),
            _const("one1", [1]),
            _const("zero1", [0]),
            _const("length_width", [LENGTH, WIDTH]),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _shapes(model):
    (loop,) = [node for node in model.graph.node if node.op_type == "Loop"]
    return shape_probes.body_shapes(model, loop)


def test_the_loop_runs_as_written():
    """The hand-written cache write is what its docstring says: a running
    sum of the rows written so far."""
    model = _model()
    session = onnxruntime.InferenceSession(
        model.SerializeToString(), providers=["CPUExecutionProvider"]
    )
    x = np.random.default_rng(0).standard_normal((3, 1, WIDTH)).astype(np.float32)
    (sums,) = session.run(None, {"x": x})
    want = np.stack([(step + 1) * x[:, 0] for step in range(STEPS)])
    np.testing.assert_allclose(sums, want, rtol=1e-6)


def test_shapes_through_the_cache_write_and_the_read_up_to_the_step():
    shapes = _shapes(_model())
    assert shapes["cache_out"] == ["batch", LENGTH, WIDTH]
    assert shapes["summed"] == ["batch", WIDTH]
    assert shapes["x_in"] == ["batch", 1, WIDTH]


def test_what_it_cannot_prove_is_left_out():
    shapes = _shapes(_model())
    assert "seen" not in shapes  # its length is the step's
    assert "clamped" not in shapes  # min(batch, 4): no size, not the batch
    assert "pair" not in shapes  # min(batch, 2): 2 at every probe's size but 1


def test_a_state_that_changes_shape_gives_nothing():
    assert _shapes(_model(grow=True)) == {}
