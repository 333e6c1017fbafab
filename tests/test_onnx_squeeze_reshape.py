"""`squeeze_reshape.skip_squeezes`: a `Reshape` of a `Squeeze` reads the
squeezed tensor where the result is the same (no copied dim at or after the
squeezed axes), in ONNX Runtime and against numpy; otherwise nothing
changes."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper

from keras_selfattn.export.formats.onnx import squeeze_reshape


def _model(axes, shape) -> onnx.ModelProto:
    """x (2, 1, 3, 4) -> Squeeze(axes) -> Reshape(shape) -> y."""
    graph = helper.make_graph(
        [
            helper.make_node("Squeeze", ["x", "axes"], ["squeezed"]),
            helper.make_node("Reshape", ["squeezed", "shape"], ["y"]),
        ],
        "main",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 1, 3, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [
            numpy_helper.from_array(np.asarray(axes, np.int64), "axes"),
            numpy_helper.from_array(np.asarray(shape, np.int64), "shape"),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def _run(proto: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    session = onnxruntime.InferenceSession(proto.SerializeToString())
    return session.run(None, {"x": x})[0]


X = np.arange(24, dtype=np.float32).reshape(2, 1, 3, 4)


@pytest.mark.parametrize("shape", [[0, -1, 4], [-1, 12], [2, 3, 2, 2]])
def test_a_reshape_of_a_squeeze_reads_the_squeezed_tensor(shape):
    proto = _model([1], shape)
    before = _run(proto, X)
    assert squeeze_reshape.skip_squeezes(proto) == 1
    assert [n.op_type for n in proto.graph.node] == ["Reshape"]
    assert proto.graph.node[0].input[0] == "x"
    after = _run(proto, X)
    np.testing.assert_array_equal(after, before)
    np.testing.assert_array_equal(after, X.reshape(2, 3, 4).reshape(after.shape))
    assert (
        after.shape
        == np.empty((2, 3, 4)).reshape([2 if s == 0 else s for s in shape]).shape
    )


@pytest.mark.parametrize(
    "axes, shape",
    [
        ([1], [0, 0, -1]),  # copies the squeezed tensor's dim 1 (3, not 1)
        ([-3], [0, -1, 4]),  # a negative axis: not read
    ],
)
def test_other_reshapes_of_squeezes_keep_them(axes, shape):
    proto = _model(axes, shape)
    before = proto.SerializeToString()
    assert squeeze_reshape.skip_squeezes(proto) == 0
    assert proto.SerializeToString() == before
