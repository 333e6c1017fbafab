"""A quantized model's ONNX generator computes its layers on ONNX Runtime's
integer kernels from Keras's integers, in the prompt pass and in the `Loop`
body, and generates the quantized Keras model's tokens: int4 (weight-only)
on `MatMulNBits`, int8 with Keras's activation quantizer on
`MatMulIntegerToFloat` (the kernel a probe of the CPU picks, both of its
choices run here).

The fast test rewrites a hand-made `Loop` whose body multiplies by an int4
`Dense` layer's dequantized kernel (`integer.rewrite`), against numpy. The
slow ones export a small int4 and int8 language model (its LM head the
reverse projection of an untied `ReversibleEmbedding`, as in keras-hub) and
read the files back.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

from benchmarks.generation import greedy_request
from tests.int8_probes import PROBE, with_inexact_probes

VOCABULARY = 96
HIDDEN = 64
MAX_LENGTH = 24
# Ops that unpack 4-bit codes (Keras's `unpack_int4` as converted).
UNPACKING = ("BitShift", "BitwiseAnd", "BitwiseOr")


def _subgraphs(graph):
    for node in graph.node:
        for attribute in node.attribute:
            yield from attribute.graphs
            if attribute.HasField("g"):
                yield attribute.g


def _ops(graph) -> list[str]:
    return [node.op_type for node in graph.node]


def _loop_body(proto):
    (loop,) = [node for node in proto.graph.node if node.op_type == "Loop"]
    return next(a.g for a in loop.attribute if a.name == "body")


def _int4_dense(inputs: int, units: int) -> keras.layers.Dense:
    keras.utils.set_random_seed(0)
    layer = keras.layers.Dense(units, use_bias=False, name="projection")
    layer.build((None, inputs))
    layer.quantize("int4")
    return layer


def test_rewrite_reaches_a_loop_body_and_stores_the_codes_once():
    import onnx
    import onnxruntime
    from onnx import TensorProto, helper, numpy_helper

    from keras_selfattn.export.formats.onnx import integer
    from keras_selfattn.export.quantization import describe

    layer = _int4_dense(256, 48)
    quantized = describe(layer)
    # Keras's own call of the quantized layer: the reference.
    x = np.random.default_rng(0).standard_normal((3, 256)).astype(np.float32)
    want = keras.ops.convert_to_numpy(layer(x))
    kernel = numpy_helper.from_array(quantized.kernel, "kernel")
    body = helper.make_graph(
        [
            helper.make_node("Identity", ["carried"], ["carried_out"]),
            helper.make_node("MatMul", ["x", "kernel"], ["step_y"]),
        ],
        "body",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
            helper.make_tensor_value_info("carried", TensorProto.FLOAT, [3, 48]),
        ],
        [
            helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
            helper.make_tensor_value_info("carried_out", TensorProto.FLOAT, [3, 48]),
            helper.make_tensor_value_info("step_y", TensorProto.FLOAT, [3, 48]),
        ],
    )
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "kernel"], ["prompt_y"]),
            helper.make_node(
                "Loop", ["steps", "", "prompt_y"], ["last", "stacked"], body=body
            ),
        ],
        "loop",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 256]),
            helper.make_tensor_value_info("steps", TensorProto.INT64, []),
        ],
        [
            helper.make_tensor_value_info("last", TensorProto.FLOAT, [3, 48]),
            helper.make_tensor_value_info(
                "stacked", TensorProto.FLOAT, ["steps", 3, 48]
            ),
        ],
        [kernel],
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    proto, schemes = integer.rewrite(proto, [quantized])
    assert schemes[0].exact, schemes
    body = _loop_body(proto)
    assert _ops(proto.graph).count("MatMulNBits") == 1
    assert _ops(body).count("MatMulNBits") == 1 and "MatMul" not in _ops(body)
    # The codes are stored once, in the main graph, read by both.
    codes = [i for i in proto.graph.initializer if i.data_type == TensorProto.UINT8]
    assert len(codes) == 2  # the packed codes and zero points
    assert not list(body.initializer)
    assert not [
        i
        for i in proto.graph.initializer
        if i.data_type == TensorProto.FLOAT
        and len(i.dims) == 2
        and i.dims[0] * i.dims[1] == 256 * 48
    ]
    onnx.checker.check_model(proto)
    session = onnxruntime.InferenceSession(proto.SerializeToString())
    last, stacked = session.run(None, {"x": x, "steps": np.asarray(2, np.int64)})
    np.testing.assert_allclose(last, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(stacked, np.stack([want, want]), rtol=1e-5, atol=1e-5)


def _language_model(mode: str) -> keras.Model:
    from keras_selfattn import SelfAttention

    keras.utils.set_random_seed(0)
    tokens = keras.Input((None,), dtype="int32", name="tokens")
    embedding = keras.layers.ReversibleEmbedding(
        VOCABULARY, HIDDEN, tie_weights=False, name="embedding"
    )
    x = embedding(tokens)
    h = SelfAttention(
        num_heads=4, key_dim=16, causal=True, rope_max_wavelength=100, name="attn"
    )(x)
    x = keras.layers.Add()([x, h])
    up = keras.layers.Dense(2 * HIDDEN, activation="gelu", name="up")(x)
    x = keras.layers.Add()([x, keras.layers.Dense(HIDDEN, name="down")(up)])
    model = keras.Model(tokens, embedding(x, reverse=True))
    model.quantize(mode)
    return model


@pytest.fixture(scope="module", params=["int4", "int8"])
def exported(request, tmp_path_factory):
    """(mode, model, ONNX generator path): exported with its own check (a
    fresh ONNX Runtime process against `generate`)."""
    from keras_selfattn.export import export_generator

    model = _language_model(request.param)
    path = tmp_path_factory.mktemp(request.param) / "lm.onnx"
    path = export_generator(model, path, "onnx", max_length=MAX_LENGTH)
    return request.param, model, path


def _int8_layers(graph) -> list:
    """The graph's int8 layers: each an `If` on the probe whose branches
    multiply on `MatMulIntegerToFloat` (uint8 x int8, uint8 x uint8)."""
    found = []
    for node in graph.node:
        branches = {a.name: [n.op_type for n in a.g.node] for a in node.attribute}
        if node.op_type == "If" and node.input[0].startswith(PROBE):
            assert branches["then_branch"] == ["MatMulIntegerToFloat"], node.name
            assert branches["else_branch"][-1] == "MatMulIntegerToFloat", node.name
            found.append(node)
    return found


@pytest.mark.slow
@pytest.mark.tensorflow_only("ONNX generators are written by TensorFlow")
def test_generator_runs_integer_kernels_in_its_loop(exported):
    import onnx

    mode, model, path = exported
    proto = onnx.load(path)
    # Keras's quantized layers: every Dense (SelfAttention's projections
    # too) and the reverse projection, independently of the export's lookup.
    dense = [
        layer
        for layer in model._flatten_layers()
        if isinstance(layer, keras.layers.Dense) and layer.quantization_mode == mode
    ]
    assert len(dense) == 5  # query, key, value, up, down
    body = _loop_body(proto)
    nested = [op for graph in _subgraphs(body) for op in _ops(graph)]
    if mode == "int4":
        for graph in (body, proto.graph):
            assert len(_nbits_layers(graph)) == len(dense) + 1
            # query, key and value read one input: one node, packed.
            assert _ops(graph).count("MatMulNBits") == len(dense) + 1 - 2
        assert not set(UNPACKING) & set(_ops(body) + nested)
    else:
        assert len(_int8_layers(body)) == len(dense) + 1
        assert len(_int8_layers(proto.graph)) == len(dense) + 1
        # No integer matmul but the probes (Keras's own int8 x int8 call).
        for graph in [proto.graph, body]:
            integer = [n for n in graph.node if n.op_type == "MatMulInteger"]
            assert [n.name.startswith(PROBE) for n in integer] == [True]
        # query, key and value quantize their one input once, each pass.
        assert _ops(body).count("QuantizeLinear") == len(dense) + 1 - 2
        # Each kernel's integers stored once, read by both passes.
        stored = sorted(
            tuple(tensor.dims)
            for tensor in proto.graph.initializer
            if tensor.data_type == onnx.TensorProto.INT8
            and len(tensor.dims) == 2
            and not tensor.name.startswith(PROBE)
        )
        kernels = [tuple(layer._kernel.shape) for layer in dense]
        table = tuple(model.get_layer("embedding")._embeddings.shape)
        assert stored == sorted([*kernels, (HIDDEN, VOCABULARY), table])
    assert "MatMul" not in _ops(body) + nested
    kernels = {(HIDDEN, VOCABULARY)} | {
        (layer.kernel.shape[0], layer.kernel.shape[1]) for layer in dense
    }
    floats = [
        tuple(tensor.dims)
        for graph in [proto.graph, body, *_subgraphs(body)]
        for tensor in graph.initializer
        if tensor.data_type == onnx.TensorProto.FLOAT
    ]
    assert not kernels & set(floats)


@pytest.mark.slow
@pytest.mark.tensorflow_only("ONNX generators are written by TensorFlow")
def test_generator_gives_the_quantized_models_tokens(exported):
    import onnx
    import onnxruntime

    import keras_selfattn

    mode, model, path = exported
    prompts = np.random.default_rng(3).integers(1, VOCABULARY, (3, 7))
    steps = 12
    expected = keras_selfattn.generate(model, prompts, steps, max_length=MAX_LENGTH)
    files = [str(path)]
    if mode == "int8":
        files.append(with_inexact_probes(onnx.load(path), probes=2).SerializeToString())
    for file in files:
        session = onnxruntime.InferenceSession(file)
        tokens, lengths = session.run(
            ["tokens", "lengths"],
            greedy_request(prompts.astype(np.int32), steps, VOCABULARY),
        )
        np.testing.assert_array_equal(tokens, expected.tokens)
        np.testing.assert_array_equal(lengths, np.full(3, steps))


def _nbits_layers(graph) -> list:
    """Each layer `graph` computes on `MatMulNBits`: the node, once per
    layer (layers reading one input share a node, `packed_matmuls`, whose
    output a `Split` gives each of them)."""
    splits = {n.input[0]: len(n.output) for n in graph.node if n.op_type == "Split"}
    return [
        node
        for node in graph.node
        if node.op_type == "MatMulNBits"
        for _ in range(splits.get(node.output[0], 1))
    ]


def _accuracy_levels(graph) -> list[int]:
    """The `accuracy_level` of each layer computed on `MatMulNBits`."""
    return [
        a.i
        for node in _nbits_layers(graph)
        for a in node.attribute
        if a.name == "accuracy_level"
    ]


def _block_rounded(x: np.ndarray, kernel: np.ndarray, block: int) -> np.ndarray:
    """numpy's `int4_inputs="int8"`: each row of `x` rounded to int8 per
    block of `block` inputs (symmetric, largest magnitude to 127), times the
    dequantized `kernel`, in float64."""
    rows, inputs = x.shape
    blocks = x.astype(np.float64).reshape(rows, inputs // block, block)
    scale = np.abs(blocks).max(axis=-1, keepdims=True) / 127
    rounded = np.rint(blocks / scale) * scale
    return rounded.reshape(rows, inputs) @ kernel.astype(np.float64)


def test_int8_inputs_round_each_block_of_a_4_bit_layer():
    import json

    import onnxruntime
    from onnx import TensorProto, helper, numpy_helper

    from keras_selfattn.export.formats.onnx import integer
    from keras_selfattn.export.quantization import describe

    layer = _int4_dense(256, 48)  # Keras's int4: blocks of 128 inputs
    quantized = describe(layer)
    x = np.random.default_rng(1).standard_normal((3, 256)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "kernel"], ["y"])],
        "dense",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 256])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 48])],
        [numpy_helper.from_array(quantized.kernel, "kernel")],
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    proto, (scheme,) = integer.rewrite(proto, [quantized], round_inputs=True)
    assert not scheme.exact and scheme.rounds_inputs, scheme
    (node,) = [n for n in proto.graph.node if n.op_type == "MatMulNBits"]
    assert _accuracy_levels(proto.graph) == [4], node
    stated = json.loads(proto.metadata_props[0].value)
    assert stated["rounds_inputs"] and not stated["exact"], stated
    (y,) = onnxruntime.InferenceSession(proto.SerializeToString()).run(None, {"x": x})
    want = _block_rounded(x, quantized.kernel, 128)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
    # Keras's float inputs give another product, farther than that.
    floats = keras.ops.convert_to_numpy(layer(x))
    assert np.abs(y - floats).max() > 100 * np.abs(y - want).max()


def test_int8_inputs_are_refused_outside_onnx(tmp_path):
    from keras_selfattn.export import export_generator

    model = _language_model("int4")
    with pytest.raises(
        ValueError, match=r"int4_inputs='int8', export_format='saved_model'"
    ):
        export_generator(
            model,
            tmp_path / "lm",
            "saved_model",
            max_length=MAX_LENGTH,
            name="lm",
            int4_inputs="int8",
        )
    assert not list(tmp_path.iterdir())


def test_unknown_int4_inputs_are_refused(tmp_path):
    from keras_selfattn.export import export_generator

    with pytest.raises(ValueError, match=r"Received: int4_inputs='int4'"):
        export_generator(
            _language_model("int4"),
            tmp_path / "lm.onnx",
            "onnx",
            max_length=MAX_LENGTH,
            int4_inputs="int4",
        )
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
@pytest.mark.tensorflow_only("ONNX generators are written by TensorFlow")
def test_int8_inputs_generator_rounds_in_both_passes(tmp_path):
    import json

    import onnx
    import onnxruntime

    from keras_selfattn.export import export_generator

    model = _language_model("int4")
    # The export's own check passed: Keras's tokens, or near ties of its
    # logits (`near_ties`), in a fresh ONNX Runtime process.
    path = export_generator(
        model, tmp_path / "lm.onnx", "onnx", max_length=MAX_LENGTH, int4_inputs="int8"
    )
    proto = onnx.load(path)
    for graph in [proto.graph, _loop_body(proto)]:
        # 5 Dense layers and the LM head.
        assert _accuracy_levels(graph) == [4] * 6, _accuracy_levels(graph)
    (entry,) = [e for e in proto.metadata_props if e.key.endswith("quantization")]
    assert json.loads(entry.value)["rounds_inputs"]
    prompts = np.random.default_rng(3).integers(1, VOCABULARY, (3, 7))
    tokens, _ = onnxruntime.InferenceSession(path).run(
        ["tokens", "lengths"],
        greedy_request(prompts.astype(np.int32), 12, VOCABULARY),
    )
    # Keras's logits on the file's own tokens (its full forward pass): each
    # token is their largest, or within the rounding of it (two logits
    # moved by 5 % of the largest magnitude each, `near_ties.BAND`).
    ids = np.concatenate([prompts, tokens[:, :-1]], axis=1)
    logits = keras.ops.convert_to_numpy(model(ids))[:, 6:].astype(np.float64)
    chosen = np.take_along_axis(logits, tokens[..., None], axis=-1)[..., 0]
    gaps = logits.max(axis=-1) - chosen
    assert np.all(gaps <= 0.1 * np.abs(logits).max(axis=-1)), gaps
    assert np.all(gaps[:, 0] == 0), gaps  # the prompt pass's token: Keras's
    assert np.mean(gaps == 0) >= 0.9, gaps
