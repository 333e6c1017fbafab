"""Quantized models export small, on each runtime's integer kernels, checked
against two references.

The fast suite exports one realistic model (D=512, 8 heads, int8) to the
four TensorFlow formats once (each exporter's own check runs), then reads
the files back: their size against the float weights, the integers they
store against Keras's own `_kernel` variables, and a `verify` of all four
on shapes the exporters did not check. The checks' rule is tested against
an artifact that quantizes otherwise (ONNX Runtime's `quantize_dynamic`).
The slow suite adds the padded classifier, D=1024, int4, and gptq/awq.
"""

from __future__ import annotations

import json
import logging
import os

import keras
import numpy as np
import pytest

from keras_selfattn import SelfAttention
from keras_selfattn.export import (
    ParityError,
    export_litert,
    export_onnx,
    export_openvino,
    export_saved_model,
    verify,
)
from tests.int8_probes import PROBE, with_inexact_probes

pytestmark = pytest.mark.tensorflow_only("the four TensorFlow export formats")

FEATURES = 512
PROJECTIONS = ("query", "key", "value", "output")
# The size the issue asks of an int8 file against its float one.
INT8_SIZE_SHARE = 0.3
INT4_SIZE_SHARE = 0.2


def _attention_model(features: int = FEATURES) -> keras.Model:
    keras.utils.set_random_seed(0)
    x = keras.Input((None, features), name="x")
    layer = SelfAttention(num_heads=8, output_dim=features, name="attention")
    return keras.Model(x, layer(x))


def _classifier(features: int = FEATURES) -> keras.Model:
    keras.utils.set_random_seed(0)
    tokens = keras.Input((None,), dtype="int32", name="tokens")
    x = keras.layers.Embedding(1000, features, mask_zero=True)(tokens)
    x = SelfAttention(num_heads=8, output_dim=features, use_bias=True)(x)
    x = keras.layers.GlobalAveragePooling1D()(x)
    return keras.Model(tokens, keras.layers.Dense(4, name="logits")(x))


def _float_bytes(model: keras.Model) -> int:
    """Bytes of the model's float32 weights (before it is quantized)."""
    return sum(4 * int(np.prod(w.shape)) for w in model.weights)


def _size(path: str) -> int:
    if os.path.isdir(path):
        return sum(
            os.path.getsize(os.path.join(d, f))
            for d, _, files in os.walk(path)
            for f in files
        )
    size = os.path.getsize(path)
    if path.endswith(".xml"):
        size += os.path.getsize(path[: -len(".xml")] + ".bin")
    return size


def _export_all(model: keras.Model, root) -> dict[str, str]:
    """The four TensorFlow formats, each through its exporter's own check."""
    return {
        "saved_model_dir": export_saved_model(model, root / "serving", "m"),
        "onnx_path": export_onnx(model, root / "m.onnx"),
        "litert_path": export_litert(model, root / "m.tflite"),
        "openvino_path": export_openvino(model, root / "m.xml"),
    }


@pytest.fixture(scope="module")
def int8(tmp_path_factory):
    """The D=512 int8 model, its float weight bytes, and its four exports."""
    model = _attention_model()
    float_bytes = _float_bytes(model)
    model.quantize("int8")
    paths = _export_all(model, tmp_path_factory.mktemp("int8"))
    return model, float_bytes, paths


def _keras_integers(model: keras.Model) -> dict[str, np.ndarray]:
    layer = model.get_layer("attention")
    return {
        name: keras.ops.convert_to_numpy(getattr(layer, f"{name}_dense")._kernel)
        for name in PROJECTIONS
    }


def _integer_matmuls(proto) -> list:
    """The file's integer matmuls by a stored kernel: the graph's own and
    those of the `then` branch of each int8 layer's `If` (uint8 x int8 by the
    stored integers; the `else` branch multiplies by the same integers + 128,
    computed from them), not the probe of the machine's kernel (constants)."""
    found = []
    for node in proto.graph.node:
        if node.op_type == "If":
            then = next(a.g for a in node.attribute if a.name == "then_branch")
            found += [n for n in then.node if n.op_type == "MatMulIntegerToFloat"]
        elif node.op_type in ("MatMulInteger", "MatMulIntegerToFloat"):
            found += [] if node.name.startswith(PROBE) else [node]
    return found


def _onnx_kernels(proto, numpy_helper) -> list[np.ndarray]:
    """Every 8-bit matrix of the ONNX file, as the integers it multiplies by:
    an integer matmul's stored kernel minus its zero point, and any other
    int8 initializer as stored (the probe's constants aside)."""
    arrays = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
    found, used = [], set()
    for node in _integer_matmuls(proto):
        kernel = arrays[node.input[1]].astype(np.int16)
        zero_point = node.input[5] if len(node.input) > 5 else ""
        if node.op_type == "MatMulInteger":
            zero_point = node.input[3] if len(node.input) > 3 else ""
        if zero_point:
            kernel = kernel - arrays[zero_point].astype(np.int16)
        found.append(kernel.astype(np.int8))
        used.add(node.input[1])
    found += [
        array
        for name, array in arrays.items()
        if array.dtype in (np.int8, np.uint8)
        and array.ndim == 2
        and name not in used
        and not name.startswith(PROBE)
    ]
    return found


def _saved_model_int8(directory: str, tf) -> list[np.ndarray]:
    """The int8 variables of a SavedModel and the int8 constants of its
    graph's functions (where an int8 kernel small enough to fold is kept)."""
    from tensorflow.core.protobuf import saved_model_pb2

    checkpoint = tf.train.load_checkpoint(
        os.path.join(directory, "variables", "variables")
    )
    dtypes = checkpoint.get_variable_to_dtype_map()
    found = [checkpoint.get_tensor(name) for name in dtypes if dtypes[name] == tf.int8]
    saved = saved_model_pb2.SavedModel()
    with open(os.path.join(directory, "saved_model.pb"), "rb") as file:
        saved.ParseFromString(file.read())
    graph = saved.meta_graphs[0].graph_def
    nodes = list(graph.node)
    for function in graph.library.function:
        nodes.extend(function.node_def)
    for node in nodes:
        if node.op == "Const" and node.attr["dtype"].type == tf.int8.as_datatype_enum:
            value = tf.make_ndarray(node.attr["value"].tensor)
            if value.ndim == 2:
                found.append(value)
    return found


def _stored_int8(paths: dict[str, str]) -> dict[str, list[np.ndarray]]:
    """Every int8 matrix each file stores, as stored."""
    import onnx
    import openvino
    import tensorflow as tf
    from ai_edge_litert.interpreter import Interpreter
    from onnx import numpy_helper

    found = {
        "saved_model_dir": _saved_model_int8(paths["saved_model_dir"], tf),
        "onnx_path": _onnx_kernels(onnx.load(paths["onnx_path"]), numpy_helper),
    }
    interpreter = Interpreter(model_path=paths["litert_path"])
    found["litert_path"] = [
        interpreter.get_tensor(d["index"])
        for d in interpreter.get_tensor_details()
        if d["dtype"] == np.int8 and len(d["shape"]) == 2
    ]
    ir = openvino.Core().read_model(paths["openvino_path"])
    found["openvino_path"] = [
        op.get_data()
        for op in ir.get_ordered_ops()
        if op.get_type_name() == "Constant"
        and op.get_element_type() == openvino.Type.i8
    ]
    return found


@pytest.mark.slow  # the int8 model's four checked exports: 18 s
def test_int8_files_are_at_most_three_tenths_of_the_float_weights(int8):
    _, float_bytes, paths = int8
    shares = {name: _size(path) / float_bytes for name, path in paths.items()}
    assert all(share <= INT8_SIZE_SHARE for share in shares.values()), shares


def _blocks(matrix: np.ndarray) -> list[bytes]:
    """Every FEATURES-wide column block of `matrix` in either orientation
    (a runtime may keep several projections side by side in one matrix)."""
    found = []
    for oriented in (matrix, matrix.T):
        if oriented.shape[0] == FEATURES and oriented.shape[1] % FEATURES == 0:
            for start in range(0, oriented.shape[1], FEATURES):
                block = oriented[:, start : start + FEATURES]
                found.append(np.ascontiguousarray(block).tobytes())
    return found


@pytest.mark.slow  # the same exports
def test_each_file_stores_kerass_integers_once(int8):
    """The int8 matrices in every file are exactly Keras's `_kernel`s (LiteRT
    and OpenVINO store them transposed), each once, and nothing else."""
    model, _, paths = int8
    wanted = _keras_integers(model)
    for artifact, stored in _stored_int8(paths).items():
        blocks = [block for matrix in stored for block in _blocks(matrix)]
        found = [name for name, kernel in wanted.items() if kernel.tobytes() in blocks]
        assert found == list(PROJECTIONS), artifact
        total = sum(matrix.size for matrix in stored)
        assert total == sum(kernel.size for kernel in wanted.values()), artifact


@pytest.mark.slow  # the same exports
def test_onnx_int8_layers_choose_an_exact_kernel(int8):
    """Each int8 layer multiplies Keras's integers + 128 (uint8, zero point
    128) by its stored int8 integers W where the probe finds the machine's
    uint8 x int8 kernel exact (255 x 127 and 255 x -127 along 64 pairs: the
    largest pairs the codes form, which saturate the 16-bit pair sums of
    x86 CPUs without VNNI or AMX), and by W + 128 (uint8, zero point 128,
    ONNX Runtime's uint8 x uint8 kernel, exact everywhere) where not. Both
    branches, run here (the second by a probe made to fail), compute the
    same numbers as the quantized Keras model."""
    import onnx
    import onnxruntime
    from onnx import numpy_helper

    model, _, paths = int8
    proto = onnx.load(paths["onnx_path"])
    arrays = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
    producers = {output: node for node in proto.graph.node for output in node.output}
    probe = producers[f"{PROBE}products"]
    assert probe.op_type == "MatMulInteger", probe
    codes, weights = (arrays[name] for name in probe.input)
    assert codes.dtype == np.uint8 and (codes == 255).all()
    assert weights.dtype == np.int8 and sorted(set(weights.ravel())) == [-127, 127]
    exact = codes.astype(np.int64) @ weights.astype(np.int64)
    np.testing.assert_array_equal(arrays[f"{PROBE}exact"], exact)
    choices = [n for n in proto.graph.node if n.op_type == "If"]
    assert len(choices) == len(PROJECTIONS)
    for choice in choices:
        assert list(choice.input) == [f"{PROBE}exact_kernel"], choice.name
        branches = {a.name: list(a.g.node) for a in choice.attribute}
        (signed,) = branches["then_branch"]
        *shift, unsigned = branches["else_branch"]
        assert [n.op_type for n in shift] == ["Cast", "Add", "Cast"], choice.name
        assert list(shift[0].input) == [signed.input[1]], choice.name
        assert arrays[shift[1].input[1]] == 128, choice.name
        assert list(unsigned.input[2:5]) == list(signed.input[2:5]), choice.name
        assert unsigned.input[1] == shift[2].output[0], choice.name
        kernel = arrays[signed.input[1]]
        assert kernel.dtype == np.int8 and np.abs(kernel).max() <= 127, choice.name
        zero_points = (arrays[signed.input[4]], arrays[signed.input[5]])
        assert [z.dtype for z in zero_points] == [np.uint8, np.int8], choice.name
        assert zero_points == (128, 0), choice.name
        assert arrays[unsigned.input[5]].dtype == np.uint8, choice.name
        assert arrays[unsigned.input[5]] == 128, choice.name
        quantize = producers[signed.input[0]]
        assert quantize.op_type == "QuantizeLinear", choice.name
        assert arrays[quantize.input[1]] == 1.0 and arrays[quantize.input[2]] == 128
    x = np.random.default_rng(3).standard_normal((2, 9, FEATURES)).astype("float32")
    expected = keras.ops.convert_to_numpy(model(x))
    results = []
    for variant in (proto, with_inexact_probes(proto, probes=1)):
        session = onnxruntime.InferenceSession(
            variant.SerializeToString(), providers=["CPUExecutionProvider"]
        )
        results.append(session.run(None, {"x": x})[0])
    np.testing.assert_array_equal(results[0], results[1])
    # Within a quantization step of the output layer's (an activation whose
    # float value differs by an ulp from TensorFlow's can round the other
    # way at a tie); a saturating kernel was 0.72 off.
    np.testing.assert_allclose(results[0], expected, rtol=1e-5, atol=1e-3)


@pytest.mark.slow
def test_the_default_int8_file_is_exact_at_the_extreme_codes(tmp_path):
    """Activation and kernel integers at +-127, the largest pair sums the
    shifted codes can form (255 x 127 and 1 x -127): ONNX Runtime's result,
    on either of the file's kernels (`with_inexact_probes`), is the quantized
    Keras model's, and (+-2.5 and +-1 are exact at those codes) numpy's
    float product's."""
    import onnx
    import onnxruntime

    x = keras.Input((None, 16), name="x")
    model = keras.Model(x, keras.layers.Dense(32, use_bias=False, name="d")(x))
    signs = np.random.default_rng(0).choice([-1.0, 1.0], (16, 32))
    model.get_layer("d").kernel.assign(signs.astype("float32"))
    model.quantize("int8")
    proto = onnx.load(export_onnx(model, tmp_path / "extreme.onnx"))
    rows = np.random.default_rng(1).choice([-2.5, 2.5], (3, 5, 16))
    rows[0, 0] = np.linspace(-2.5, 2.5, 16)  # codes between the extremes too
    rows = rows.astype("float32")
    expected = keras.ops.convert_to_numpy(model(rows))
    for variant in (proto, with_inexact_probes(proto, probes=1)):
        session = onnxruntime.InferenceSession(
            variant.SerializeToString(), providers=["CPUExecutionProvider"]
        )
        (got,) = session.run(None, {"x": rows})
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-5)
        np.testing.assert_allclose(got[1:], rows[1:] @ signs, rtol=1e-6, atol=1e-5)


def _arrays(proto, numpy_helper) -> list[bytes]:
    """The model's stored arrays (dtype and bytes), whatever their names."""
    return [
        numpy_helper.to_array(t).dtype.str.encode() + numpy_helper.to_array(t).tobytes()
        for t in proto.graph.initializer
    ]


@pytest.mark.slow  # the same exports
def test_the_deprecated_vnni_option_warns_and_writes_the_default_file(int8, tmp_path):
    """`int8_matmul="vnni"` is deprecated: one FutureWarning naming it (Python
    shows it by default), and the file is the default one (the same graph,
    probe included), exact on every CPU (the default check passes)."""
    import onnx
    import onnxruntime
    from onnx import numpy_helper

    model, _, _ = int8
    default = onnx.load(export_onnx(model, tmp_path / "default.onnx"))
    with pytest.warns(FutureWarning) as caught:
        path = export_onnx(model, tmp_path / "vnni.onnx", int8_matmul="vnni")
    ours = [w for w in caught if "int8_matmul='vnni'" in str(w.message)]
    assert [w.category for w in ours] == [FutureWarning]
    assert "default" in str(ours[0].message) and "removed" in str(ours[0].message)
    proto = onnx.load(path)
    # Each trace names its nodes apart (functional_2, functional_4): compare
    # the ops, the stored arrays and the outputs.
    ops = sorted(node.op_type for node in proto.graph.node)
    assert ops == sorted(node.op_type for node in default.graph.node)
    assert "If" in ops
    assert sorted(_arrays(proto, numpy_helper)) == sorted(
        _arrays(default, numpy_helper)
    )
    assert proto.metadata_props == default.metadata_props
    x = np.random.default_rng(3).normal(size=(2, 5, FEATURES)).astype("float32")
    got, want = (
        onnxruntime.InferenceSession(
            p.SerializeToString(), providers=["CPUExecutionProvider"]
        ).run(None, {"x": x})[0]
        for p in (proto, default)
    )
    np.testing.assert_array_equal(got, want)


@pytest.mark.slow  # the same exports
def test_an_unknown_int8_matmul_is_refused_before_any_work(int8, tmp_path):
    model, _, _ = int8
    refusal = r"`int8_matmul`.*Received: int8_matmul='avx2'"
    with pytest.raises(ValueError, match=refusal):
        export_onnx(model, tmp_path / "m.onnx", int8_matmul="avx2")
    assert not (tmp_path / "m.onnx").exists()


@pytest.mark.slow  # the same exports
def test_every_runtime_within_the_rule_on_unchecked_shapes(int8):
    """All four files on shapes the exporters did not check: each is within
    1.25x Keras's own quantization error of the dequantized-float model, the
    SavedModel computes that model itself, and the ONNX file Keras's exact
    scheme (these small shapes have no activation at a rounding tie)."""
    model, _, paths = int8
    report = verify(model, shapes=((2, 7), (1, 20)), seed=11, **paths)
    rows = {(row.runtime, row.shape): row for row in report.rows}
    assert len(rows) == 8 and report.ok, report.table()
    for shape in ("2x7", "1x20"):
        own = rows[("onnx", shape)].quantization_err
        assert own > 1e-3  # quantization changes the outputs measurably
        assert rows[("onnx", shape)].max_abs_err <= 1e-5, report.table()
        assert rows[("saved_model", shape)].dequantized_err <= 1e-5, report.table()
    schemes = {row.runtime: row.scheme for row in report.rows}
    assert "Keras's scheme" in schemes["onnx"]
    assert "dequantized in the graph" in schemes["saved_model"]
    assert "dynamic range" in schemes["litert"]
    assert "compressed" in schemes["openvino"]
    text = report.table()
    assert "vs dequantized float" in text and "keras's own" in text


@pytest.fixture(scope="module")
def other_scheme(int8, tmp_path_factory):
    """ONNX Runtime's own `quantize_dynamic` (per-tensor asymmetric int8
    activations) of the dequantized-float model, and a copy of it that
    claims Keras's scheme in its metadata."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    model, _, _ = int8
    root = tmp_path_factory.mktemp("other")
    dequantized = _attention_model()  # the same architecture, in float
    layer = model.get_layer("attention")
    for name in PROJECTIONS:
        dense = getattr(layer, f"{name}_dense")
        kernel = keras.ops.convert_to_numpy(dense._kernel).astype("float32")
        scale = keras.ops.convert_to_numpy(dense.kernel_scale)
        getattr(dequantized.get_layer("attention"), f"{name}_dense").kernel.assign(
            kernel / scale
        )
    plain = export_onnx(dequantized, root / "plain.onnx", check=False)
    ours = str(root / "dynamic.onnx")
    quantize_dynamic(plain, ours, weight_type=QuantType.QInt8)
    claimed = onnx.load(ours)
    claimed.metadata_props.append(
        onnx.StringStringEntryProto(
            key="keras_selfattn.quantization",
            value=json.dumps({"exact": True, "layers": {"attention": "claimed"}}),
        )
    )
    claiming = str(root / "claiming.onnx")
    onnx.save(claimed, claiming)
    return model, ours, claiming


@pytest.mark.slow  # another scheme's export and check: 20 s
def test_a_coarser_scheme_beyond_the_margin_is_refused(other_scheme):
    """quantize_dynamic's per-tensor activations land further from the
    dequantized model than 1.25x Keras's per-token ones at long shapes."""
    model, ours, _ = other_scheme
    with pytest.raises(ParityError) as caught:
        verify(model, onnx_path=ours, shapes=((2, 512),))
    (row,) = caught.value.report.rows
    assert row.rms_ratio > 1.25, row
    assert "quantize_dynamic" in row.scheme


@pytest.mark.slow  # the same
def test_a_file_claiming_kerass_scheme_must_match_the_quantized_model(other_scheme):
    model, _, claiming = other_scheme
    with pytest.raises(ParityError) as caught:
        verify(model, onnx_path=claiming, shapes=((2, 7),))
    (row,) = caught.value.report.rows
    assert row.max_abs_err > 0.1 * row.quantization_err, row


# Seed 5's inputs gave a ratio of 1.40 with the 256 elements the rule took
# before (seed 0: 0.91 on the Intel Xeon, 1.53 reported on the AMD EPYC);
# with 1024, 0.96-1.07 over seeds 0-11 (docs/quantization.md).
@pytest.mark.slow
def test_litert_int8_classifier_within_the_rule_on_any_inputs(tmp_path):
    """LiteRT's int8 padded classifier (D=512; activations quantized per
    row, asymmetric, by XNNPACK) is about as far from the dequantized float
    model as Keras's own (symmetric per token): within the rule, near 1x,
    on inputs of several seeds."""
    model = _classifier(FEATURES)
    model.quantize("int8")
    path = export_litert(model, tmp_path / "m.tflite")
    for seed in (0, 5):
        report = verify(model, litert_path=path, seed=seed)
        assert report.ok, report.table()
        assert 0.8 <= report.rows[0].rms_ratio <= 1.15, report.table()


@pytest.mark.slow
@pytest.mark.parametrize(
    "build, features",
    [(_classifier, 512), (_attention_model, 1024)],
    ids=["classifier-512", "attention-1024"],
)
def test_int8_models_export_everywhere_at_three_tenths(build, features, tmp_path):
    """The issue's two models at D=512 and D=1024 (the padded classifier's
    Embedding and Dense are quantized too), each through every exporter's
    default check, at most 0.3x the float weights."""
    model = build(features)
    float_bytes = _float_bytes(model)
    model.quantize("int8")
    paths = _export_all(model, tmp_path)
    shares = {name: _size(path) / float_bytes for name, path in paths.items()}
    assert all(share <= INT8_SIZE_SHARE for share in shares.values()), shares


@pytest.mark.slow
def test_int4_keeps_four_bits_where_the_format_can(tmp_path, caplog):
    """Keras's int4 (groups of 128 with zero points, float activations):
    ONNX (MatMulNBits), OpenVINO (u4) and the SavedModel keep 4-bit codes,
    at most 0.2x the float weights; LiteRT, which has no kernel for them,
    writes float weights and says so; every file computes Keras's result."""
    model = _attention_model()
    float_bytes = _float_bytes(model)
    model.quantize("int4")
    with caplog.at_level(logging.WARNING):
        paths = _export_all(model, tmp_path)
    assert any("float32 weights" in r.getMessage() for r in caplog.records)
    shares = {name: _size(path) / float_bytes for name, path in paths.items()}
    for name in ("saved_model_dir", "onnx_path", "openvino_path"):
        assert shares[name] <= INT4_SIZE_SHARE, shares
    report = verify(model, shapes=((2, 9),), seed=3, **paths)
    assert report.ok and all(r.dequantized_err < 1e-4 for r in report.rows), (
        report.table()
    )


@pytest.mark.slow
def test_int4_generator_writes_onnx_at_the_opset_of_its_unpacking(tmp_path):
    """An int4 token model's ONNX generator, whose loop unpacks its 4-bit
    codes with BitwiseAnd (opset 18): by default at opset 18, through the
    export's own check (a fresh onnxruntime process against `generate`);
    opset=17 asked is refused in one line naming the op and the way out."""
    from keras_selfattn.export import export_generator

    keras.utils.set_random_seed(0)
    tokens = keras.Input((None,), dtype="int32", name="tokens")
    x = keras.layers.Embedding(64, 256)(tokens)
    x = SelfAttention(num_heads=4, causal=True, output_dim=256)(x)
    model = keras.Model(tokens, keras.layers.Dense(64)(x))
    model.quantize("int4")
    path = export_generator(model, tmp_path / "lm.onnx", "onnx", max_length=16)
    import onnx

    opsets = {o.domain: o.version for o in onnx.load(path).opset_import}
    assert opsets[""] >= 18, opsets
    with pytest.raises(ValueError, match="pass opset=18 or leave opset unset") as e:
        export_generator(model, tmp_path / "old.onnx", "onnx", max_length=16, opset=17)
    assert "\n" not in str(e.value) and not os.path.exists(tmp_path / "old.onnx")


def _calibrated(mode: str) -> keras.Model:
    keras.utils.set_random_seed(1)
    tokens = keras.Input((None,), dtype="int32", name="tokens")
    embedding = keras.layers.Embedding(50, 64)
    attention = SelfAttention(num_heads=2, output_dim=64, use_bias=True, causal=True)
    model = keras.Model(tokens, attention(embedding(tokens)))
    data = np.random.default_rng(0).integers(1, 50, (8, 16)).astype("int32")
    common = dict(
        dataset=list(data),
        tokenizer=lambda s: s,
        num_samples=8,
        sequence_length=16,
        group_size=16,
        quantization_layer_structure={
            "pre_block_layers": [embedding],
            "sequential_blocks": [attention],
        },
    )
    if mode == "gptq":
        config = keras.quantizers.GPTQConfig(weight_bits=4, **common)
    else:
        config = keras.quantizers.AWQConfig(**common)
    model.quantize(mode, config=config)
    return model


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["gptq", "awq"])
def test_calibrated_modes_run_on_four_bit_kernels(mode, tmp_path):
    """gptq and awq (4 bits, groups of 16) export to ONNX as MatMulNBits and
    to OpenVINO as u4 codes, and compute Keras's results."""
    import onnx

    model = _calibrated(mode)
    onnx_path = export_onnx(model, tmp_path / "m.onnx")
    openvino_path = export_openvino(model, tmp_path / "m.xml")
    saved = export_saved_model(model, tmp_path / "serving", "m")
    ops = [node.op_type for node in onnx.load(onnx_path).graph.node]
    assert ops.count("MatMulNBits") == len(PROJECTIONS)
    report = verify(
        model,
        onnx_path=onnx_path,
        openvino_path=openvino_path,
        saved_model_dir=saved,
        shapes=((2, 9),),
        seed=5,
    )
    assert report.ok, report.table()


def test_the_cli_exports_a_quantized_keras_file(tmp_path, capsys):
    from keras_selfattn_cli import main

    model = _attention_model(64)
    model.quantize("int8")
    model.save(tmp_path / "q.keras")
    status = main(
        ["export", str(tmp_path / "q.keras"), "--onnx", str(tmp_path / "q.onnx")]
    )
    out = capsys.readouterr().out
    assert status == 0, out
    assert "vs dequantized float" in out and "Keras's scheme" in out
