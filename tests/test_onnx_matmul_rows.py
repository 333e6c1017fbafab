"""`matmul_rows.read_rows_in_place`: a matmul reads its `(B, T, K)` input
itself where tf2onnx wrote a reshape to `(B * T, K)` rows in front of it,
only where that reshape is known to merge leading axes and only readers
that reshape the product follow; ONNX Runtime computes what it did, and
numpy's product agrees."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper

from keras_selfattn.export.formats.onnx import matmul_rows

K, N = 8, 6


def _constant(name: str, value, dtype=np.float32) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(value, dtype), name)


def _model(source_nodes, source: str, readers) -> onnx.ModelProto:
    """`x` (B, T, 4, 2) -> `source_nodes` -> `source` -> Reshape(-1, K) ->
    MatMul -> `readers` (which write "y")."""
    nodes = [
        *source_nodes,
        helper.make_node("Reshape", [source, "rows_shape"], ["rows"]),
        helper.make_node("MatMul", ["rows", "weight"], ["product"]),
        *readers,
    ]
    rng = np.random.default_rng(0)
    graph = helper.make_graph(
        nodes,
        "main",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "T", 4, 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, "S", N])],
        [
            _constant("rows_shape", [-1, K], np.int64),
            _constant("weight", rng.standard_normal((K, N))),
            _constant("scale", rng.standard_normal(K)),
            _constant("flat_shape", [0, 0, K], np.int64),
            _constant("heads_shape", [0, 0, 4, 2], np.int64),
            _constant("out_shape", [2, -1, N], np.int64),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])


def _flat_normed():
    """x flattened to (B, T, K), then RMS-normalized with a (K,) scale."""
    return [
        helper.make_node("Reshape", ["x", "flat_shape"], ["flat"]),
        helper.make_node("RMSNormalization", ["flat", "scale"], ["normed"]),
    ]


def _run(proto: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    session = onnxruntime.InferenceSession(proto.SerializeToString())
    return session.run(None, {"x": x})[0]


def _matmul_input(proto: onnx.ModelProto) -> str:
    return next(n.input[0] for n in proto.graph.node if n.op_type == "MatMul")


def test_a_matmul_of_normalized_rows_reads_them_in_place():
    proto = _model(
        _flat_normed(),
        "normed",
        [helper.make_node("Reshape", ["product", "out_shape"], ["y"])],
    )
    x = np.random.default_rng(1).standard_normal((2, 3, 4, 2)).astype(np.float32)
    before = _run(proto, x)
    assert matmul_rows.read_rows_in_place(proto) == 1
    onnx.checker.check_model(proto, full_check=True)
    assert _matmul_input(proto) == "normed"
    assert "Reshape" in {n.op_type for n in proto.graph.node}  # the one after
    assert "rows" not in {o for n in proto.graph.node for o in n.output}
    after = _run(proto, x)
    np.testing.assert_array_equal(after, before)
    flat = x.reshape(2, 3, K)
    normed = flat / np.sqrt(np.mean(flat**2, -1, keepdims=True) + 1e-5)
    values = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
    weight, scale = values["weight"], values["scale"]
    expected = ((normed * scale).reshape(-1, K) @ weight).reshape(2, -1, N)
    np.testing.assert_allclose(after, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "source_nodes, source",
    [
        # (B, T, 4, 2) reshaped to rows of K = 8: the last dim is 2, not K.
        ([helper.make_node("Reshape", ["x", "heads_shape"], ["heads"])], "heads"),
        # An Identity of the input: its last dim is not known here.
        ([helper.make_node("Identity", ["x"], ["same"])], "same"),
    ],
    ids=["heads", "unknown"],
)
def test_rows_of_another_last_dim_are_not_read_in_place(source_nodes, source):
    proto = _model(
        source_nodes,
        source,
        [helper.make_node("Reshape", ["product", "out_shape"], ["y"])],
    )
    assert matmul_rows.read_rows_in_place(proto) == 0
    assert _matmul_input(proto) == "rows"


def test_a_product_read_by_other_ops_keeps_its_rows():
    # An Add would broadcast (B, T, N) where it added (B * T, N) rows.
    proto = _model(
        _flat_normed(),
        "normed",
        [
            helper.make_node("Reshape", ["product", "out_shape"], ["shaped"]),
            helper.make_node("Add", ["product", "product"], ["doubled"]),
            helper.make_node("ReduceSum", ["doubled"], ["total"], keepdims=0),
            helper.make_node("Add", ["shaped", "total"], ["y"]),
        ],
    )
    assert matmul_rows.read_rows_in_place(proto) == 0
    assert _matmul_input(proto) == "rows"
