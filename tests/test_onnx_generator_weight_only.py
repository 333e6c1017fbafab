"""An int4 (weight-only) model's ONNX generator computes its layers on
ONNX Runtime's `MatMulNBits` from Keras's integers, in the prompt pass and
in the `Loop` body, and generates the quantized Keras model's tokens.

The fast test rewrites a hand-made `Loop` whose body multiplies by an int4
`Dense` layer's dequantized kernel (`integer.rewrite`), against numpy. The
slow one exports a small int4 language model (its LM head the reverse
projection of an untied `ReversibleEmbedding`, as in keras-hub) and reads
the file back.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

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


def _language_model() -> keras.Model:
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
    model.quantize("int4")
    return model


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(model, ONNX generator path): exported with its own check (a fresh
    ONNX Runtime process against `generate`)."""
    from keras_selfattn.export import export_generator

    model = _language_model()
    path = tmp_path_factory.mktemp("int4") / "lm.onnx"
    return model, export_generator(model, path, "onnx", max_length=MAX_LENGTH)


@pytest.mark.slow
@pytest.mark.tensorflow_only("ONNX generators are written by TensorFlow")
def test_int4_generator_runs_matmul_nbits_in_its_loop(exported):
    import onnx

    model, path = exported
    proto = onnx.load(path)
    # Keras's int4 layers: every Dense (SelfAttention's projections too) and
    # the reverse projection, independently of the export's own lookup.
    dense = [
        layer
        for layer in model._flatten_layers()
        if isinstance(layer, keras.layers.Dense) and layer.quantization_mode == "int4"
    ]
    assert len(dense) == 5  # query, key, value, up, down
    body = _loop_body(proto)
    assert _ops(body).count("MatMulNBits") == len(dense) + 1
    assert _ops(proto.graph).count("MatMulNBits") == len(dense) + 1
    nested = [op for graph in _subgraphs(body) for op in _ops(graph)]
    assert not set(UNPACKING) & set(_ops(body) + nested)
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
def test_int4_generator_gives_the_quantized_models_tokens(exported):
    import onnxruntime

    import keras_selfattn

    model, path = exported
    prompts = np.random.default_rng(3).integers(1, VOCABULARY, (3, 7))
    steps = 12
    expected = keras_selfattn.generate(model, prompts, steps, max_length=MAX_LENGTH)
    session = onnxruntime.InferenceSession(str(path))
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
