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
        assert _ops(body).count("MatMulNBits") == len(dense) + 1
        assert _ops(proto.graph).count("MatMulNBits") == len(dense) + 1
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
            {
                "prompt_tokens": prompts.astype(np.int32),
                "prompt_lengths": np.full(3, 7, np.int32),
                "max_new_tokens": np.asarray(steps, np.int32),
                "temperature": np.asarray(0.0, np.float32),
                "top_k": np.asarray(VOCABULARY, np.int32),
                "top_p": np.asarray(1.0, np.float32),
                "seed": np.asarray(0, np.int32),
                "end_token": np.asarray(-1, np.int32),
            },
        )
        np.testing.assert_array_equal(tokens, expected.tokens)
        np.testing.assert_array_equal(lengths, np.full(3, steps))
