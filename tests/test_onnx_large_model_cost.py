"""What a large ONNX export costs: the check's session maps a float model's
external weights without prepacked copies (`keras_selfattn_runtimes.onnx`),
and tf2onnx's optimizers run without a copy of the graph each
(`conversion.optimize`), falling back to tf2onnx's own way if one fails."""

from __future__ import annotations

import numpy as np
import pytest

from keras_selfattn_runtimes import onnx as onnx_runtime

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

FEATURES = 64  # a 64 x 64 float weight: 16 KiB, external data
PREPACKING_OFF = "session.disable_prepacking"


def _matmul_model(path: str, integer: bool, external: bool) -> np.ndarray:
    """Writes y = x @ w (float, or MatMulInteger on int8 codes) at `path`;
    returns w."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    if integer:
        weight = rng.integers(-127, 128, (FEATURES, FEATURES)).astype(np.int8)
        node = helper.make_node("MatMulInteger", ["x", "w"], ["y"])
        x_type, y_type = TensorProto.UINT8, TensorProto.INT32
    else:
        weight = rng.standard_normal((FEATURES, FEATURES)).astype(np.float32)
        node = helper.make_node("MatMul", ["x", "w"], ["y"])
        x_type = y_type = TensorProto.FLOAT
    graph = helper.make_graph(
        [node],
        "matmul",
        [helper.make_tensor_value_info("x", x_type, [2, FEATURES])],
        [helper.make_tensor_value_info("y", y_type, [2, FEATURES])],
        [numpy_helper.from_array(weight, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save_model(
        model,
        path,
        save_as_external_data=external,
        all_tensors_to_one_file=True,
        location="matmul.onnx.data",
        size_threshold=1024,
    )
    return weight


def _prepacking_off(loaded) -> bool:
    options = loaded._session.get_session_options()
    try:
        return options.get_session_config_entry(PREPACKING_OFF) == "1"
    except RuntimeError:  # ONNX Runtime's default: no entry
        return False


@pytest.mark.parametrize(
    "integer, external, off",
    [(False, True, True), (False, False, False), (True, True, False)],
    ids=["float-external", "float-inline", "integer-external"],
)
def test_check_session_prepacks_only_where_it_computes_otherwise(
    tmp_path, integer, external, off
):
    path = str(tmp_path / "matmul.onnx")
    weight = _matmul_model(path, integer, external)
    assert (tmp_path / "matmul.onnx.data").exists() == external
    loaded = onnx_runtime.load(path, "serving_default")
    assert _prepacking_off(loaded) == off
    rng = np.random.default_rng(1)
    if integer:
        # Under 128: AVX2's u8 x s8 kernel adds pairs of products in int16,
        # which saturates past 32767 (255 * 127 twice); AVX-512 VNNI's does
        # not. This test is about prepacking, not that machine's rounding.
        x = rng.integers(0, 128, (2, FEATURES)).astype(np.uint8)
        want = x.astype(np.int64) @ weight.astype(np.int64)
        np.testing.assert_array_equal(loaded({"x": x})["y"], want)
    else:
        x = rng.standard_normal((2, FEATURES)).astype(np.float32)
        want = x.astype(np.float64) @ weight.astype(np.float64)
        np.testing.assert_allclose(loaded({"x": x})["y"], want, rtol=1e-4, atol=1e-4)


def test_prepacking_asked_for_is_kept(tmp_path):
    path = str(tmp_path / "matmul.onnx")
    _matmul_model(path, integer=False, external=True)
    loaded = onnx_runtime.load(path, "serving_default", prepacking=True)
    assert not _prepacking_off(loaded)


class _Node:
    def __init__(self, op_type: str, bodies: dict | None = None):
        self.type, self._bodies = op_type, bodies

    def get_body_graphs(self):
        return self._bodies


class _Graph:
    """What `optimize` reads of a tf2onnx graph: its nodes, their bodies."""

    def __init__(self, name: str, nodes: list):
        self.name, self._nodes = name, nodes

    def get_nodes(self):
        return self._nodes


@pytest.mark.tensorflow_only("tf2onnx's optimizers")
def test_optimizers_fall_back_to_tf2onnx_catching_errors(monkeypatch):
    pytest.importorskip("tf2onnx")
    from tf2onnx import optimizer

    from keras_selfattn.export.formats.onnx import conversion

    calls = []

    def optimize_graph(graph, catch_errors=True, optimizers=None):
        calls.append((graph.name, catch_errors, sorted(optimizers)))
        if not catch_errors and graph.name == "first":
            raise RuntimeError("an optimizer failed")
        return graph.name

    monkeypatch.setattr(optimizer, "optimize_graph", optimize_graph)
    every = sorted(optimizer._get_optimizers())
    einsum = _Graph("", [_Node("Loop", {"body": _Graph("", [_Node("Einsum")])})])
    graphs = iter([_Graph("first", einsum.get_nodes()), _Graph("second", [])])
    assert conversion.optimize(lambda: next(graphs)) == "second"
    used = [name for name in every if name not in conversion._OPTIMIZED_OPS]
    used = sorted([*used, "einsum_optimizer"])  # the Loop body's Einsum
    assert calls == [("first", False, used), ("second", True, used)]
    calls.clear()
    graphs = iter([_Graph("third", [_Node("MatMul"), _Node("DequantizeLinear")])])
    assert conversion.optimize(lambda: next(graphs)) == "third"
    used = [name for name in every if name not in conversion._OPTIMIZED_OPS]
    used = sorted([*used, "const_dequantize_optimizer", "q_dq_optimizer"])
    assert calls == [("third", False, used)]


def _loop_graph():
    """tf2onnx's graph of a function with a loop, its body given a node that
    reads a value of the main graph (an implicit input of the `Loop`), and
    each graph a dead node."""
    tf = pytest.importorskip("tensorflow")
    pytest.importorskip("tf2onnx")
    from tf2onnx import tf_loader, tfonnx

    @tf.function(input_signature=[tf.TensorSpec([2], tf.float32, name="x")])
    def function(x):
        outside = x * 3.0

        def body(i, a, b):
            return i + 1, a + outside, b * a

        _, a, b = tf.while_loop(lambda i, a, b: i < 3, body, [0, x, x])
        return {"a": tf.identity(a, name="a"), "b": tf.identity(b, name="b")}

    concrete = function.get_concrete_function()
    inputs = ["x:0"]
    outputs = [t.name for t in concrete.outputs]
    graph_def = tf_loader.from_function(concrete, inputs, outputs)
    with tf.Graph().as_default() as tf_graph:
        tf.import_graph_def(graph_def, name="")
        graph = tfonnx.process_tf_graph(
            tf_graph, input_names=inputs, output_names=outputs, opset=17
        )
    (loop,) = [node for node in graph.get_nodes() if node.type == "Loop"]
    (body,) = loop.get_body_graphs().values()
    outer = graph.make_node("Sin", [graph.inputs[0].output[0]])
    read = body.make_node("Add", [body.outputs[-1], outer.output[0]])
    body.outputs = [*body.outputs[:-1], read.output[0]]
    graph.make_node("Neg", [graph.inputs[0].output[0]])
    body.make_node("Neg", [body.outputs[-1]])
    return graph


def _kept(graph) -> dict:
    """{node name: {body name: `_kept` of the body}} of `graph`'s nodes."""
    return {
        node.name: {
            name: _kept(body) for name, body in (node.get_body_graphs() or {}).items()
        }
        for node in graph.get_nodes()
    }


def _types(graph) -> list[str]:
    """The op types of `graph`'s nodes and of their bodies' nodes."""
    types = []
    for node in graph.get_nodes():
        types.append(node.type)
        for body in (node.get_body_graphs() or {}).values():
            types += _types(body)
    return types


@pytest.mark.tensorflow_only("tf2onnx's graphs")
def test_pruning_keeps_what_tf2onnx_keeps():
    import copy

    from keras_selfattn.export.formats.onnx import conversion

    graph = _loop_graph()
    theirs, ours = copy.deepcopy(graph), copy.deepcopy(graph)
    theirs.delete_unused_nodes(theirs.outputs)
    conversion._prune(ours)
    assert _kept(ours) == _kept(theirs)
    assert _types(graph).count("Neg") == 2
    assert "Neg" not in _types(ours)
    # The main graph's value only the body reads (an implicit input).
    assert "Sin" in _types(ours)
    # tf2onnx orders the kept nodes by chance; here they keep the graph's.
    order = [node.name for node in graph.get_nodes()]
    kept = [node.name for node in ours.get_nodes()]
    assert kept == [name for name in order if name in kept]


@pytest.mark.tensorflow_only("tf2onnx's optimizers")
def test_optimizers_pruning_once_compute_what_tf2onnx_computes():
    import copy

    ort = pytest.importorskip("onnxruntime")
    from tf2onnx import optimizer

    from keras_selfattn.export.formats.onnx import conversion

    graph = _loop_graph()
    factories = optimizer._get_optimizers()
    theirs = optimizer.optimize_graph(copy.deepcopy(graph), catch_errors=False)
    ours = optimizer.optimize_graph(
        copy.deepcopy(graph),
        catch_errors=False,
        optimizers={name: conversion._pruning_once(f) for name, f in factories.items()},
    )
    assert sorted(_types(ours)) == sorted(_types(theirs))
    x = np.asarray([0.5, -2.0], np.float32)
    results = []
    # The graph as converted (no optimizer) is the reference.
    for optimized in (copy.deepcopy(graph), theirs, ours):
        model = optimized.make_model("optimized")
        session = ort.InferenceSession(model.SerializeToString())
        results.append(session.run(None, {"x:0": x}))
    reference, tf2onnx_way, pruning_once = results
    assert len(reference) == 2
    for want, got in zip(reference, pruning_once, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6)
    for want, got in zip(tf2onnx_way, pruning_once, strict=True):
        np.testing.assert_array_equal(got, want)
