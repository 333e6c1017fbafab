"""export_onnx: names, dynamic axes, parity in onnxruntime, opsets, safety.

Parity is checked here independently of `verify`: each file runs in a real
onnxruntime InferenceSession and is compared with the Keras model's own
predictions on several shapes (tf2onnx can emit graphs that pass
onnx.checker and still miscompute for some batch sizes or lengths).
"""

from __future__ import annotations

import os

import keras
import numpy as np
import onnx
import onnxruntime
import pytest

from keras_selfattn import SelfAttention
from keras_selfattn.export import ParityError, export_onnx
from keras_selfattn.export.formats.onnx import format as onnx_module
from keras_selfattn.export.forward.graph import build_endpoint
from tests import model_zoo

pytestmark = pytest.mark.tensorflow_only("ONNX export through tf2onnx")

SHAPES = [(1, 1), (2, 33), (3, 128), (2, 512), (4, 20)]
MODELS = [*model_zoo.ALL, "attention_with_mask_input"]


def _session(path: str) -> onnxruntime.InferenceSession:
    return onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])


def _keras_outputs(model: keras.Model, arrays: dict) -> np.ndarray:
    args = [arrays[t.name] for t in model.inputs]
    return model.predict(args if len(args) > 1 else args[0], verbose=0)


def _dims(value_info) -> list:
    return [
        d.dim_param if d.HasField("dim_param") else d.dim_value
        for d in value_info.type.tensor_type.shape.dim
    ]


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """Each model exported once with the default opset, without the export's
    own check (a fresh process each): the parity test below is that check."""
    directory = tmp_path_factory.mktemp("onnx")
    result = {}
    for name in MODELS:
        model = getattr(model_zoo, name)(0)
        path = export_onnx(model, directory / f"{name}.onnx", check=False)
        result[name] = (model, path)
    return result


@pytest.mark.parametrize("name", MODELS)
def test_parity_with_keras_in_onnxruntime(exports, name):
    model, path = exports[name]
    session = _session(path)
    for batch, time in SHAPES:
        arrays = model_zoo.sample_inputs(model, batch, time, seed=batch * time)
        (actual,) = session.run(None, arrays)
        np.testing.assert_allclose(
            actual,
            _keras_outputs(model, arrays),
            atol=1e-5,
            rtol=1e-4,
            err_msg=f"{name} at batch={batch}, time={time}",
        )


@pytest.mark.parametrize(
    "name, inputs, outputs",
    [
        (
            "masked_classifier",
            {"tokens": (onnx.TensorProto.INT32, ["batch", "time"])},
            {"probabilities": ["batch", 3]},
        ),
        (
            "causal_multihead",
            {"sequence": (onnx.TensorProto.FLOAT, ["batch", "time", 8])},
            {"causal_attention": ["batch", "time", 6]},
        ),
        (
            "attention_with_mask_input",
            {
                "features": (onnx.TensorProto.FLOAT, ["batch", "time", 8]),
                "mask": (onnx.TensorProto.BOOL, ["batch", "time"]),
            },
            {"attention": ["batch", "time", 8]},
        ),
    ],
)
def test_names_dtypes_and_readable_dynamic_axes(exports, name, inputs, outputs):
    model = onnx.load(exports[name][1])
    assert {
        i.name: (i.type.tensor_type.elem_type, _dims(i)) for i in model.graph.input
    } == inputs
    assert {o.name: _dims(o) for o in model.graph.output} == outputs
    assert model.opset_import[0].version == onnx_module.DEFAULT_OPSET


def test_file_passes_onnx_checker(exports):
    for _, path in exports.values():
        onnx.checker.check_model(onnx.load(path), full_check=True)


@pytest.mark.slow  # two more ONNX exports
@pytest.mark.parametrize("opset", [13, 18])
def test_opset_range_ends(tmp_path, opset):
    model = model_zoo.causal_multihead(seed=2)
    path = export_onnx(model, tmp_path / "m.onnx", opset=opset)
    assert onnx.load(path).opset_import[0].version == opset
    arrays = model_zoo.sample_inputs(model, 3, 17, seed=1)
    (actual,) = _session(path).run(None, arrays)
    np.testing.assert_allclose(actual, _keras_outputs(model, arrays), atol=1e-5)


def test_attention_weights_output(tmp_path):
    model = model_zoo.masked_classifier(seed=5)
    path = export_onnx(model, tmp_path / "m.onnx", attention_outputs="attention")
    proto = onnx.load(path)
    outputs = {o.name: _dims(o) for o in proto.graph.output}
    assert outputs == {
        "probabilities": ["batch", 3],
        "attention_weights": ["batch", 2, "time", "time"],
    }
    tokens = model_zoo.sample_inputs(model, 3, 12, seed=4)["tokens"]
    session = _session(path)
    names = [o.name for o in session.get_outputs()]
    result = dict(zip(names, session.run(None, {"tokens": tokens}), strict=True))
    embedded = model.get_layer("embed")(tokens)
    _, weights = model.get_layer("attention")(
        embedded, mask=tokens != 0, return_attention_scores=True
    )
    np.testing.assert_allclose(result["attention_weights"], weights, atol=1e-6)
    padded_keys = result["attention_weights"].transpose(0, 3, 1, 2)[tokens == 0]
    assert padded_keys.size and (padded_keys == 0).all()


@pytest.mark.slow  # a .keras round trip, exported and checked: 7 s
def test_model_loaded_from_keras_file(tmp_path):
    model = model_zoo.transformer_encoder(seed=3)
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras", safe_mode=True)
    path = export_onnx(loaded, tmp_path / "m.onnx")
    arrays = model_zoo.sample_inputs(model, 2, 40, seed=2)
    (actual,) = _session(path).run(None, arrays)
    np.testing.assert_allclose(actual, _keras_outputs(model, arrays), atol=1e-5)


def test_exact_gelu_exports(tmp_path):
    """Keras's exact GELU is erfc on TensorFlow, which tf2onnx cannot
    convert by itself (`onnx.tf2onnx_handlers`); its tail rounds
    to 0 (inputs -6)."""
    keras.utils.set_random_seed(0)
    x = keras.Input((None, 8), name="x")
    h = keras.layers.Dense(16, activation="gelu")(x)
    model = keras.Model(x, SelfAttention(num_heads=2, output_dim=8)(h))
    path = export_onnx(model, tmp_path / "gelu.onnx")
    inputs = np.random.default_rng(0).normal(size=(2, 9, 8)).astype("float32") * 4
    (actual,) = _session(path).run(None, {"x": inputs})
    np.testing.assert_allclose(actual, model.predict(inputs, verbose=0), atol=1e-5)


def test_constant_computed_when_the_model_was_built_is_in_the_file(tmp_path):
    """keras-hub's GemmaBackbone scales its embeddings by a tensor computed
    when built (`ops.sqrt(hidden_dim)`): the traced function captures it and
    tf2onnx listed it as a graph input."""
    keras.utils.set_random_seed(0)
    x = keras.Input((None, 8), name="x")
    h = x * keras.ops.cast(keras.ops.sqrt(16), "float32")
    model = keras.Model(x, SelfAttention(num_heads=2, output_dim=8)(h))
    path = export_onnx(model, tmp_path / "scaled.onnx")
    session = _session(path)
    assert [i.name for i in session.get_inputs()] == ["x"]
    inputs = np.random.default_rng(0).normal(size=(2, 5, 8)).astype("float32")
    (actual,) = session.run(None, {"x": inputs})
    np.testing.assert_allclose(actual, model.predict(inputs, verbose=0), atol=1e-5)


# ------------------------------------------------------------------- safety
@pytest.fixture
def small_model():
    return model_zoo.attention_only(seed=1)


@pytest.mark.parametrize("opset", [12, 19, 0, "17", 17.0, True])
def test_unsupported_opset(tmp_path, small_model, opset):
    with pytest.raises(ValueError, match=r"opset .*13 to 18") as caught:
        export_onnx(small_model, tmp_path / "m.onnx", opset=opset)
    assert f"opset={opset!r}" in str(caught.value)
    assert os.listdir(tmp_path) == []


def test_existing_file_is_refused_and_left_intact(tmp_path, small_model):
    target = tmp_path / "m.onnx"
    target.write_bytes(b"previous export")
    with pytest.raises(FileExistsError):
        export_onnx(small_model, target)
    assert target.read_bytes() == b"previous export"
    assert os.listdir(tmp_path) == ["m.onnx"]


@pytest.mark.parametrize("error", [OSError("disk full"), KeyboardInterrupt()])
def test_failure_while_writing_leaves_nothing(
    tmp_path, small_model, monkeypatch, error
):
    def write_half_then_fail(proto, path):
        with open(path, "wb") as handle:
            handle.write(proto.SerializeToString()[:100])
        raise error

    monkeypatch.setattr(onnx, "save", write_half_then_fail)
    with pytest.raises(type(error)):
        export_onnx(small_model, tmp_path / "new_dir" / "m.onnx")
    assert os.listdir(tmp_path) == []


def test_graph_that_miscomputes_is_refused(tmp_path, small_model, monkeypatch):
    # A graph that passes onnx.checker but computes another function (here:
    # another model's weights) must not reach the target path.
    impostor = model_zoo.attention_only(seed=2)
    real_convert = onnx_module.convert_to_onnx

    def convert_impostor(target, opset, weights=None):
        return real_convert(build_endpoint(impostor).target(), opset, weights)

    monkeypatch.setattr(onnx_module, "convert_to_onnx", convert_impostor)
    with pytest.raises(ParityError, match="differ from Keras") as caught:
        export_onnx(small_model, tmp_path / "m.onnx")
    assert all(row.runtime == "onnx" for row in caught.value.report.rows)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("path", ["", "some_dir/", b"m.onnx", None])
def test_bad_paths(tmp_path, small_model, monkeypatch, path):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="`path` must"):
        export_onnx(small_model, path)
    assert os.listdir(tmp_path) == []


def test_unwritable_target(tmp_path, small_model):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(NotADirectoryError):
        export_onnx(small_model, blocker / "m.onnx", check=False)
    assert os.listdir(tmp_path) == ["file"]


def test_auto_generated_input_name_is_refused(tmp_path):
    inputs = keras.Input((None, 4))
    model = keras.Model(inputs, keras.layers.Dense(2)(inputs))
    with pytest.raises(ValueError, match="has a name Keras generated"):
        export_onnx(model, tmp_path / "m.onnx")
    assert os.listdir(tmp_path) == []
