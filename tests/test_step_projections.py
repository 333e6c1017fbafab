"""A generation loop step's projections in a TensorFlow graph without XLA
(one new position, the caches time-major): one 2-D MatMul each, not
oneDNN's Einsum (which streamed the kernel at about 0.7x MatMul's speed
on a CPU), with numpy's numbers; the loop's body (the SavedModel
generator's, XLA off) holds no Einsum; other calls keep the einsum."""

from __future__ import annotations

import contextlib

import keras
import numpy as np
import pytest

from keras_selfattn import SelfAttention, decoding
from keras_selfattn.attention import cache as cache_lib
from keras_selfattn.attention import heads as heads_lib
from tests.backend import BACKEND
from tests.test_cache_objects import traced_loop

pytestmark = pytest.mark.skipif(
    BACKEND != "tensorflow", reason="TensorFlow graphs' projections"
)

RNG = np.random.default_rng(5)


def _layer():
    layer = SelfAttention(
        num_heads=4,
        key_dim=8,
        num_key_value_heads=2,
        causal=True,
        output_dim=12,
        use_bias=True,
    )
    layer(RNG.normal(size=(2, 3, 16)).astype("float32"))
    for weight in layer.weights:  # biases not zero: they are checked too
        weight.assign(RNG.normal(size=weight.shape).astype("float32"))
    return layer


def _loop_scope(time_major: bool) -> decoding.Scope:
    """A decoding scope holding one cache of the loop's steps' class."""
    cache_class = cache_lib.TimeMajorCache if time_major else cache_lib.CheckedCache
    return decoding.Scope(
        caches={"att": cache_class(np.zeros((2, 4, 1, 2, 8), "float32"))},
        keys={},
        index=0,
        padding=None,
        make_positions=lambda: None,
    )


@pytest.mark.parametrize("layout", [heads_lib.TIME_FIRST, heads_lib.HEADS_FIRST])
def test_loop_step_projections_have_numpy_s_numbers(layout):
    import tensorflow as tf

    from keras_selfattn import _projection_ops

    layer = _layer()
    x = RNG.normal(size=(3, 1, 16)).astype("float32")
    merged = RNG.normal(size=(3, 1, 32)).astype("float32")  # 4 heads of 8
    op_types = set()

    def run(function, x):
        with decoding.decoding(_loop_scope(time_major=True)):
            graph = tf.function(function).get_concrete_function(
                tf.TensorSpec((None, *x.shape[1:]), "float32")
            )
        op_types.update(node.op for node in graph.graph.as_graph_def().node)
        return graph(tf.constant(x)).numpy()

    query = run(lambda t: _projection_ops.heads(layer, t, "query", 4, layout, False), x)
    output = run(lambda t: _projection_ops.project(layer, t, "output", False), merged)
    kernel, bias = (w.numpy() for w in layer.query_dense.weights)
    expected = (x[:, 0] @ kernel + bias).reshape(3, 1, 4, 8)
    if layout == heads_lib.HEADS_FIRST:
        expected = expected.transpose(0, 2, 1, 3)
    np.testing.assert_allclose(query, expected, rtol=1e-5, atol=1e-5)
    kernel, bias = (w.numpy() for w in layer.output_dense.weights)
    expected = (merged[:, 0] @ kernel + bias)[:, None]
    np.testing.assert_allclose(output, expected, rtol=1e-5, atol=1e-5)
    assert "MatMul" in op_types and "Einsum" not in op_types


@pytest.mark.parametrize("scope", [None, "batch_major"])
def test_other_one_position_calls_keep_the_einsum(scope):
    """Outside a loop step with time-major caches (a user's cached call, an
    exported decoding step, the ONNX and XLA loops) a projection of one
    position stays one einsum."""
    import tensorflow as tf

    from keras_selfattn import _projection_ops

    layer = _layer()
    context = decoding.decoding(_loop_scope(time_major=False)) if scope else None
    with context or contextlib.nullcontext():
        graph = tf.function(
            lambda t: _projection_ops.heads(
                layer, t, "key", 2, heads_lib.TIME_FIRST, False
            )
        ).get_concrete_function(tf.TensorSpec((None, 1, 16), "float32"))
    op_types = [node.op for node in graph.graph.as_graph_def().node]
    assert op_types.count("Einsum") == 1 and "MatMul" not in op_types


def test_the_loop_body_projects_with_matmuls():
    """The generation loop as the SavedModel generator traces it (a
    TensorFlow graph without XLA): the prompt's projections are einsums,
    the steps' (one position each) MatMuls."""
    tokens = keras.Input((None,), dtype="int32", name="tokens")
    hidden = keras.layers.Embedding(11, 16)(tokens)
    hidden = SelfAttention(num_heads=2, causal=True, output_dim=16)(hidden)
    model = keras.Model(tokens, keras.layers.Dense(11)(hidden))
    graph = traced_loop(model).graph.as_graph_def()
    outside = {node.op for node in graph.node}
    bodies = [f for f in graph.library.function if "body" in f.signature.name]
    assert len(bodies) == 1
    inside = {node.op for node in bodies[0].node_def}
    assert "Einsum" in outside
    assert "Einsum" not in inside and "MatMul" in inside
