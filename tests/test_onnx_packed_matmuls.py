"""`packed_matmuls.pack`: the `MatMulNBits` layers that read one input
become one (their integers stacked by output row) and a `Split`, with the
same outputs bit for bit in ONNX Runtime and numpy's dequantized product;
layers that differ in anything but their output size stay as they are."""

from __future__ import annotations

import collections

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper

from keras_selfattn.export.formats.onnx import packed_matmuls

K, BLOCK = 64, 32
BLOCKS = K // BLOCK
RNG = np.random.default_rng(5)


def _layer(name: str, x: str, n: int, level: int = 0):
    """A 4-bit `MatMulNBits` of random integers; its node, initializers and
    numpy's float kernel (K, n)."""
    codes = RNG.integers(0, 16, (n, K), dtype=np.uint8)
    zeros = RNG.integers(0, 16, (n, BLOCKS), dtype=np.uint8)
    scales = RNG.uniform(0.01, 0.1, (n, BLOCKS)).astype(np.float32)
    kernel = (codes.astype(np.float32) - np.repeat(zeros, BLOCK, 1)) * np.repeat(
        scales, BLOCK, 1
    )
    blob = codes.reshape(n, BLOCKS, BLOCK)
    packed_codes = blob[..., 0::2] | (blob[..., 1::2] << 4)
    packed_zeros = zeros[:, 0::2] | (zeros[:, 1::2] << 4)
    tensors = [
        numpy_helper.from_array(packed_codes, f"{name}_codes"),
        numpy_helper.from_array(scales.reshape(-1), f"{name}_scales"),
        numpy_helper.from_array(packed_zeros, f"{name}_zeros"),
    ]
    node = helper.make_node(
        "MatMulNBits",
        [x, *(t.name for t in tensors)],
        [name],
        name,
        domain="com.microsoft",
        K=K,
        N=n,
        bits=4,
        block_size=BLOCK,
        accuracy_level=level,
    )
    return node, tensors, kernel.T


def _model(layers, inputs=("x", "other")) -> onnx.ModelProto:
    graph = helper.make_graph(
        [node for node, _, _ in layers],
        "main",
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, [3, K]) for x in inputs],
        [
            helper.make_tensor_value_info(node.output[0], TensorProto.FLOAT, [3, None])
            for node, _, _ in layers
        ],
        [tensor for _, tensors, _ in layers for tensor in tensors],
    )
    return helper.make_model(
        graph,
        opset_imports=[
            helper.make_opsetid("", 21),
            helper.make_opsetid("com.microsoft", 1),
        ],
    )


def _run(proto: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    session = onnxruntime.InferenceSession(
        proto.SerializeToString(), providers=["CPUExecutionProvider"]
    )
    return session.run(None, feeds)


@pytest.mark.parametrize("level", [0, 4])
def test_layers_of_one_input_become_one_with_the_same_outputs(level):
    layers = [
        _layer("query", "x", 32, level),
        _layer("key", "x", 16, level),
        _layer("value", "x", 16, level),
        _layer("elsewhere", "other", 16, level),  # another input
        _layer("rounding", "x", 16, 4 - level),  # another accuracy level
    ]
    proto = _model(layers)
    feeds = {x: RNG.standard_normal((3, K)).astype(np.float32) for x in ("x", "other")}
    before = _run(proto, feeds)
    assert packed_matmuls.pack(proto) == 1
    onnx.checker.check_model(proto)
    ops = collections.Counter(node.op_type for node in proto.graph.node)
    assert ops == {"MatMulNBits": 3, "Split": 1, "Constant": 1}, ops
    # The three layers' integers are stored once, stacked.
    names = {t.name for t in proto.graph.initializer}
    assert not {"query_codes", "key_codes", "value_codes"} & names, names
    after = _run(proto, feeds)
    for old, new in zip(before, after, strict=True):
        np.testing.assert_array_equal(new, old)
    if level == 0:  # float inputs: numpy's product of the dequantized kernel
        for (node, _, kernel), out in zip(layers[:4], after[:4], strict=True):
            x = feeds[node.input[0]].astype(np.float64)
            np.testing.assert_allclose(out, x @ kernel, rtol=1e-4, atol=1e-4)


def test_a_lone_layer_is_left_alone():
    proto = _model([_layer("query", "x", 32), _layer("key", "other", 16)])
    before = proto.SerializeToString()
    assert packed_matmuls.pack(proto) == 0
    assert proto.SerializeToString() == before
