"""Opset 23's fused ops in ONNX generators (`fused_norm`, `generator_fusion`):
RMS norm chains, hand-written (in a graph and a `Loop` body) and as tf2onnx
converts Keras's layers, become RMSNormalization with numpy's numbers; a
norm of another structure is left alone; keras-hub Llama and Gemma
generators, exported, carry the fused ops (their decoding step's attention
as one Attention node per layer in the loop body) and return keras-hub's
own greedy and seeded tokens, as Gemma 2's soft-capped, windowed step
does (its seeded tokens)."""

from __future__ import annotations

import collections

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
onnxruntime = pytest.importorskip("onnxruntime")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from keras_selfattn.export.formats.onnx import fused, fused_norm  # noqa: E402
from tests import generation_reference as reference  # noqa: E402
from tests.test_convert_blocks import PROMPTS, STEPS  # noqa: E402

EPSILON = 1e-5
DEPTH = 8
SCALE = np.linspace(0.5, 2.0, DEPTH).astype(np.float32)
STEPS_IN_LOOP = 3


def _rms(x: np.ndarray, scale=SCALE, epsilon=EPSILON) -> np.ndarray:
    x = x.astype(np.float64)
    return x / np.sqrt((x**2).mean(-1, keepdims=True) + epsilon) * scale


def _chain(prefix: str, x: str, out: str, *, order: str, mean: str) -> list:
    """An RMS norm chain as tf2onnx writes it, ending in `out`."""
    make = helper.make_node
    if mean == "GlobalAveragePool":
        averaged = make(mean, [f"{prefix}sq"], [f"{prefix}mean"])
    else:
        averaged = make(mean, [f"{prefix}sq", "last_axis"], [f"{prefix}mean"])
    nodes = [
        make("Pow", [x, "two"], [f"{prefix}sq"]),
        averaged,
        make("Add", [f"{prefix}mean", "epsilon"], [f"{prefix}var"]),
        make("Sqrt", [f"{prefix}var"], [f"{prefix}root"]),
        make("Reciprocal", [f"{prefix}root"], [f"{prefix}inv"]),
    ]
    if order == "normed first":
        nodes += [
            make("Mul", [x, f"{prefix}inv"], [f"{prefix}normed"]),
            make("Mul", [f"{prefix}normed", "scale"], [out]),
        ]
    else:  # x * (inv * scale), tf2onnx's order in a prompt pass
        nodes += [
            make("Mul", [f"{prefix}inv", "scale"], [f"{prefix}scaled"]),
            make("Mul", [x, f"{prefix}scaled"], [out]),
        ]
    return nodes


def _handwritten(scale=SCALE, opset=fused.FUSED_OPSET) -> onnx.ModelProto:
    """Outputs: `prompt` = rms(x) (ReduceMean, x * (inv * scale)); `kept` =
    rms(x) + 1 by a chain whose mean is also an output (`kept_mean`), so
    not fusable; `final` = x after 3 steps of x <- tanh(rms(x)) in a Loop
    whose body reads the epsilon, exponent and scale from outside."""
    info = helper.make_tensor_value_info
    body = helper.make_graph(
        [
            helper.make_node("Identity", ["cond_in"], ["cond_out"]),
            *_chain(
                "b/", "x_in", "b/norm", order="normed first", mean="GlobalAveragePool"
            ),
            helper.make_node("Tanh", ["b/norm"], ["x_out"]),
        ],
        "body",
        [
            info("i", TensorProto.INT64, []),
            info("cond_in", TensorProto.BOOL, []),
            info("x_in", TensorProto.FLOAT, None),
        ],
        [
            info("cond_out", TensorProto.BOOL, []),
            info("x_out", TensorProto.FLOAT, None),
        ],
    )
    kept = _chain("k/", "x", "k/norm", order="normed first", mean="ReduceMean")
    nodes = [
        *_chain("p/", "x", "prompt", order="scaled first", mean="ReduceMean"),
        *kept,
        helper.make_node("Add", ["k/norm", "one"], ["kept"]),
        helper.make_node("Identity", ["k/mean"], ["kept_mean"]),
        helper.make_node("Loop", ["steps", "true", "x"], ["final"], body=body),
    ]
    constants = {
        "two": np.array(2.0, np.float32),
        "one": np.array(1.0, np.float32),
        "epsilon": np.array([EPSILON], np.float32),
        "scale": scale,
        "last_axis": np.array([-1], np.int64),
        "steps": np.array(STEPS_IN_LOOP, np.int64),
        "true": np.array(True),
    }
    graph = helper.make_graph(
        nodes,
        "norms",
        [info("x", TensorProto.FLOAT, ["batch", "time", len(scale)])],
        [
            info(name, TensorProto.FLOAT, None)
            for name in ("prompt", "kept", "kept_mean", "final")
        ],
        [numpy_helper.from_array(v, k) for k, v in constants.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _ops(graph) -> collections.Counter:
    return collections.Counter(node.op_type for node in graph.node)


def _run(proto, feed) -> list:
    session = onnxruntime.InferenceSession(
        proto.SerializeToString(), providers=["CPUExecutionProvider"]
    )
    return session.run(None, feed)


def test_handwritten_chains_become_rms_normalization_with_numpy_s_numbers():
    proto = _handwritten()
    assert fused_norm.fuse_rms_norms(proto) == 2
    (loop,) = [node for node in proto.graph.node if node.op_type == "Loop"]
    body = loop.attribute[0].g
    assert _ops(body) == {"Identity": 1, "RMSNormalization": 1, "Tanh": 1}
    # The prompt's chain fused; the chain whose mean is read elsewhere kept.
    main = _ops(proto.graph)
    assert main["RMSNormalization"] == 1 and main["Pow"] == 1, main
    x = np.random.default_rng(0).standard_normal((2, 3, DEPTH)).astype(np.float32)
    prompt, kept, kept_mean, final = _run(proto, {"x": x})
    want = x.astype(np.float64)
    for _ in range(STEPS_IN_LOOP):
        want = np.tanh(_rms(want))
    np.testing.assert_allclose(prompt, _rms(x), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(kept, _rms(x) + 1, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(kept_mean[..., 0], (x**2).mean(-1), rtol=1e-5)
    np.testing.assert_allclose(final, want, rtol=1e-5, atol=1e-6)


def test_a_scale_of_another_shape_is_left_alone():
    proto = _handwritten()
    for initializer in proto.graph.initializer:
        if initializer.name == "scale":  # (1, DEPTH): not RMSNormalization's
            initializer.CopyFrom(numpy_helper.from_array(SCALE[None], "scale"))
    assert fused_norm.fuse_rms_norms(proto) == 0


def test_fuse_generator_upgrades_and_keeps_large_weights_in_place():
    """From opset 18, with a scale of 2048 elements (a large weight: left
    out of the copy that is upgraded, then kept as the model's own)."""
    from keras_selfattn.export.formats.onnx import generator_fusion

    if not generator_fusion.runs_fused_ops():
        pytest.skip("this onnx or ONNX Runtime does not run opset 23")
    import keras

    scale = np.linspace(0.5, 2.0, 2048).astype(np.float32)
    proto = _handwritten(scale, opset=18)
    weight = next(i for i in proto.graph.initializer if i.name == "scale")
    assert generator_fusion.fuse_generator(proto, keras.Sequential([])) is proto
    assert {(o.domain, o.version) for o in proto.opset_import} == {("", 23)}
    assert any(i is weight for i in proto.graph.initializer)  # not copied
    assert _ops(proto.graph)["RMSNormalization"] == 1
    x = np.random.default_rng(2).standard_normal((1, 2, 2048)).astype(np.float32)
    prompt, kept, _, final = _run(proto, {"x": x})
    want = x.astype(np.float64)
    for _ in range(STEPS_IN_LOOP):
        want = np.tanh(_rms(want, scale))
    np.testing.assert_allclose(prompt, _rms(x, scale), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(kept, _rms(x, scale) + 1, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(final, want, rtol=1e-5, atol=1e-6)


def test_fuse_generator_leaves_the_model_where_the_runtime_cannot_run_it(
    monkeypatch,
):
    import keras

    from keras_selfattn.export.formats.onnx import generator_fusion

    monkeypatch.setattr(generator_fusion, "runs_fused_ops", lambda: False)
    proto = _handwritten(opset=18)
    before = proto.SerializeToString()
    generator_fusion.fuse_generator(proto, keras.Sequential([]))
    assert proto.SerializeToString() == before


def test_fuse_generator_leaves_a_model_onnx_cannot_upgrade():
    """onnx's converter has no adapter for BitwiseAnd below opset 18 (an
    int4 model's unpacking writes one): the model stays as it was."""
    import keras

    from keras_selfattn.export.formats.onnx import generator_fusion

    proto = _handwritten(opset=17)
    bits = helper.make_tensor_value_info("bits", TensorProto.INT32, [2])
    proto.graph.input.append(bits)
    proto.graph.output.append(
        helper.make_tensor_value_info("low", TensorProto.INT32, [2])
    )
    proto.graph.node.append(helper.make_node("BitwiseAnd", ["bits", "bits"], ["low"]))
    before = proto.SerializeToString()
    generator_fusion.fuse_generator(proto, keras.Sequential([]))
    assert proto.SerializeToString() == before


@pytest.fixture(scope="module")
def keras_norms():
    """tf2onnx's conversion (opset 17, upgraded to 23) of Keras's
    RMSNormalization, LayerNormalization(rms_scaling=True) (a variance:
    centred) and LayerNormalization, with random weights; their outputs."""
    pytest.importorskip("tf2onnx")
    import keras
    import tensorflow as tf
    import tf2onnx

    inputs = keras.Input((5, DEPTH))
    rms = keras.layers.RMSNormalization(epsilon=EPSILON)(inputs)
    scaling = keras.layers.LayerNormalization(rms_scaling=True)(rms)
    layer_norm = keras.layers.LayerNormalization()(scaling)
    model = keras.Model(inputs, [rms, scaling, layer_norm])
    rng = np.random.default_rng(1)
    for weight in model.weights:
        weight.assign(rng.normal(size=weight.shape).astype("float32"))
    proto, _ = tf2onnx.convert.from_function(
        tf.function(model), [tf.TensorSpec((None, 5, DEPTH), tf.float32)], opset=17
    )
    x = rng.normal(size=(2, 5, DEPTH)).astype(np.float32)
    return fused.upgrade(proto), x, [np.asarray(y) for y in model(x)], model


@pytest.mark.tensorflow_only("tf2onnx converts TensorFlow graphs")
@pytest.mark.filterwarnings("ignore:You passed `rms_scaling=True`:UserWarning")
def test_keras_s_rms_normalization_fuses_and_centred_norms_stay(keras_norms):
    proto, x, expected, model = keras_norms
    before = _ops(proto.graph)
    assert fused_norm.fuse_rms_norms(proto) == 1
    after = _ops(proto.graph)
    assert after["RMSNormalization"] == 1
    # The two centred norms keep their means, square roots and subtractions.
    assert after["GlobalAveragePool"] == before["GlobalAveragePool"] - 1 == 4
    assert after["Sub"] == before["Sub"] == 2
    gamma = np.asarray(model.layers[1].weights[0])
    np.testing.assert_allclose(
        expected[0], _rms(x, gamma, EPSILON), rtol=1e-5, atol=1e-6
    )
    for got, want in zip(
        _run(proto, {proto.graph.input[0].name: x}), expected, strict=True
    ):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


class _KerasHubLogits:
    """keras-hub's causal LM as `reference.uncached` calls a token model."""

    def __init__(self, lm):
        self.lm = lm

    def predict_on_batch(self, tokens: np.ndarray):
        return self.lm(
            {"token_ids": tokens, "padding_mask": np.ones_like(tokens, bool)}
        )


SAMPLED = {"temperature": 1.5, "top_k": 8, "top_p": 0.95, "seed": 7}
FAMILIES = ["Llama", "Gemma"]  # x * scale and Gemma's x * (1 + scale)


@pytest.fixture(scope="module")
def generators(tmp_path_factory):
    """Family -> (keras-hub's causal LM, its ONNX generator's session, the
    file's model): each exported through the exporter's own check (the
    generator's tokens against `generate`, in a fresh process)."""
    pytest.importorskip("keras_hub")
    import keras_selfattn
    from keras_selfattn.export import export_generator
    from tests.test_convert_keras_hub_models import _causal_lm

    root = tmp_path_factory.mktemp("fused_generators")
    result = {}
    for family in FAMILIES:
        lm = _causal_lm(family)
        path = export_generator(
            keras_selfattn.convert_causal_lm(lm),
            root / f"{family}.onnx",
            "onnx",
            max_length=16,
        )
        session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
        result[family] = lm, session, onnx.load(path)
    return result


@pytest.mark.slow
@pytest.mark.tensorflow_only("ONNX generators are converted from TensorFlow")
@pytest.mark.parametrize("family", FAMILIES)
def test_generator_carries_the_fused_ops(generators, family):
    lm, _, proto = generators[family]
    layers = lm.backbone.num_layers
    assert {(o.domain, o.version) for o in proto.opset_import} >= {("", 23)}
    (loop,) = [node for node in proto.graph.node if node.op_type == "Loop"]
    body = next(a.g for a in loop.attribute if a.name == "body")
    # Two norms per block and the final one, in the prompt pass and the body.
    for graph in (proto.graph, body):
        ops = _ops(graph)
        assert ops["RMSNormalization"] == 2 * layers + 1, ops
        assert ops["Sqrt"] == 0 and ops["Reciprocal"] == 0, ops
    # The prompt pass's attention cores.
    assert _ops(proto.graph)["Attention"] == layers


@pytest.mark.slow
@pytest.mark.tensorflow_only("ONNX generators are converted from TensorFlow")
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("controls", [{}, SAMPLED], ids=["greedy", "sampled"])
def test_fused_generator_returns_keras_hub_s_tokens(generators, family, controls):
    lm, session, _ = generators[family]
    vocabulary = lm.backbone.vocabulary_size
    request = reference.generator_request(PROMPTS, STEPS, vocabulary, controls)
    tokens, lengths = session.run(["tokens", "lengths"], request)
    named = {k: v for k, v in controls.items() if k != "seed"}
    want, want_lengths = reference.uncached(
        _KerasHubLogits(lm), PROMPTS, STEPS, seed=controls.get("seed", 0), **named
    )
    assert len(np.unique(want)) >= 4, want  # varied tokens
    np.testing.assert_array_equal(tokens, want)
    np.testing.assert_array_equal(lengths, want_lengths)


def _attention_nodes(proto) -> list:
    """The Attention nodes of the generator's `Loop` body."""
    (loop,) = [node for node in proto.graph.node if node.op_type == "Loop"]
    body = next(a.g for a in loop.attribute if a.name == "body")
    return [node for node in body.node if node.op_type == "Attention"]


@pytest.mark.slow
@pytest.mark.tensorflow_only("ONNX generators are converted from TensorFlow")
@pytest.mark.parametrize("family", FAMILIES)
def test_generator_s_decoding_step_attention_is_fused(generators, family):
    """One Attention node per layer in the loop body (`loop_attention`), in
    place of the single-query path's decomposed softmax."""
    lm, _, proto = generators[family]
    nodes = _attention_nodes(proto)
    assert len(nodes) == lm.backbone.num_layers, [n.name for n in nodes]
    (loop,) = [node for node in proto.graph.node if node.op_type == "Loop"]
    body = next(a.g for a in loop.attribute if a.name == "body")
    assert _ops(body)["Exp"] == 0, _ops(body)


@pytest.fixture(scope="module")
def soft_capped(tmp_path_factory):
    """Gemma 2 (soft-capped scores, alternating sliding windows of 3): its
    keras-hub causal LM, its ONNX generator's session and file's model,
    exported through the exporter's own check."""
    pytest.importorskip("keras_hub")
    import keras_selfattn
    from keras_selfattn.export import export_generator
    from tests.test_convert_keras_hub_models import _causal_lm

    lm = _causal_lm("Gemma 2")
    path = export_generator(
        keras_selfattn.convert_causal_lm(lm),
        tmp_path_factory.mktemp("soft_capped") / "gemma_2.onnx",
        "onnx",
        max_length=16,
    )
    session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
    return lm, session, onnx.load(path)


@pytest.mark.slow
@pytest.mark.tensorflow_only("ONNX generators are converted from TensorFlow")
def test_soft_capped_windowed_step_fuses_with_keras_hub_s_tokens(soft_capped):
    """The soft-cap becomes Attention's `softcap`, the windows stay in the
    mask; the seeded tokens are keras-hub's own. (Greedy, this small random
    Gemma 2 repeats each prompt's last token, whatever the weights' seed:
    tokens that could not tell a wrong attention.)"""
    lm, session, proto = soft_capped
    nodes = _attention_nodes(proto)
    assert len(nodes) == lm.backbone.num_layers
    caps = [helper.get_node_attr_value(node, "softcap") for node in nodes]
    np.testing.assert_allclose(caps, 5.0)
    request = reference.generator_request(
        PROMPTS, STEPS, lm.backbone.vocabulary_size, SAMPLED
    )
    tokens, lengths = session.run(["tokens", "lengths"], request)
    named = {k: v for k, v in SAMPLED.items() if k != "seed"}
    want, want_lengths = reference.uncached(
        _KerasHubLogits(lm), PROMPTS, STEPS, seed=SAMPLED["seed"], **named
    )
    assert len(np.unique(want)) >= 4, want
    np.testing.assert_array_equal(tokens, want)
    np.testing.assert_array_equal(lengths, want_lengths)


@pytest.mark.slow
@pytest.mark.tensorflow_only("ONNX generators are converted from TensorFlow")
@pytest.mark.parametrize("family", FAMILIES)
def test_generator_s_layers_share_the_step_s_key_mask_and_rows(generators, family):
    """The loop body's layers read one key mask (built from the cache's
    attended length, `Masks.key_length`, not from each layer's keys), their
    matmuls read the normalized activations without a reshape to rows
    (`matmul_rows`), and the rotation negates no input."""
    lm, _, proto = generators[family]
    assert lm.backbone.num_layers >= 2
    (loop,) = [node for node in proto.graph.node if node.op_type == "Loop"]
    body = next(a.g for a in loop.attribute if a.name == "body")
    ops = _ops(body)
    assert ops["Range"] == 1 and ops["Neg"] == 0, ops
    producers = {out: node for node in body.node for out in node.output}
    matmuls = [node for node in body.node if node.op_type == "MatMul"]
    sources = [producers[node.input[0]].op_type for node in matmuls]
    assert sources.count("RMSNormalization") >= 2 * lm.backbone.num_layers, sources
