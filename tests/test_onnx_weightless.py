"""The ONNX conversion's graphs hold no weight: TensorFlow's GraphDef reads
each weight from a placeholder of its shape (nothing frozen into constants),
and the ONNX file stores each weight once, as an initializer."""

from __future__ import annotations

import keras
import numpy as np
import pytest

from keras_selfattn import SelfAttention

onnx = pytest.importorskip("onnx")
pytest.importorskip("tf2onnx")

pytestmark = pytest.mark.tensorflow_only("tf2onnx converts TensorFlow graphs")

VOCABULARY, FEATURES = 50, 16
# TensorFlow captures eager tensors of at most this many elements as
# constants (`func_graph`'s threshold): biases, norms' scales.
CAPTURED_AS_CONSTANT = 128


@pytest.fixture(scope="module")
def model() -> keras.Model:
    keras.utils.set_random_seed(0)
    tokens = keras.Input((None,), dtype="int32", name="tokens")
    h = keras.layers.Embedding(VOCABULARY, FEATURES)(tokens)
    h = SelfAttention(num_heads=2, key_dim=8, causal=True)(h)
    logits = keras.layers.Dense(VOCABULARY, name="logits")(h)
    return keras.Model(tokens, logits)


def _large_weights(model: keras.Model) -> list[np.ndarray]:
    return [
        np.asarray(w) for w in model.weights if np.prod(w.shape) > CAPTURED_AS_CONSTANT
    ]


def test_graph_def_reads_weights_from_placeholders(model):
    from keras_selfattn.export.formats.onnx import conversion
    from keras_selfattn.export.forward.graph import build_endpoint

    target = build_endpoint(model).target()
    concrete = conversion.traced(target)
    inputs = [tensor.name for tensor in concrete.inputs]
    outputs = [tensor.name for tensor in concrete.outputs]
    graph_def = conversion.graph_def(concrete, inputs, outputs)
    nodes = list(graph_def.node)
    nodes += [node for f in graph_def.library.function for node in f.node_def]
    constants = [
        int(np.prod([d.size for d in node.attr["value"].tensor.tensor_shape.dim]))
        for node in nodes
        if node.op == "Const"
    ]
    assert max(constants) <= CAPTURED_AS_CONSTANT
    placeholders = sorted(
        tuple(d.size for d in node.attr["shape"].shape.dim)
        for node in graph_def.node
        if node.op == "Placeholder" and node.name != "tokens"
    )
    assert placeholders == sorted(w.shape for w in _large_weights(model))


@pytest.mark.slow  # a generator's export (about 20 s)
def test_onnx_generator_stores_each_weight_once(model, tmp_path):
    from keras_selfattn.export import export_generator

    path = export_generator(
        model, tmp_path / "lm.onnx", "onnx", max_length=8, check=False
    )
    proto = onnx.load(path)
    stored = [
        onnx.numpy_helper.to_array(tensor).tobytes()
        for tensor in proto.graph.initializer
    ]
    for weight in _large_weights(model):
        assert stored.count(weight.tobytes()) == 1
    large = [t for t in stored if len(t) > 4 * CAPTURED_AS_CONSTANT]
    assert len(large) == len(_large_weights(model))
