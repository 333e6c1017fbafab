"""export_saved_model: TF Serving layout, signature, parity with Keras, safety.

Parity is checked here independently of `verify`: the SavedModel is loaded
with tf.saved_model.load, called through `serving_default`, and compared
with the Keras model's own predictions.
"""

from __future__ import annotations

import os
import shutil

import keras
import numpy as np
import pytest
import tensorflow as tf
from google.protobuf import text_format
from tensorflow.core.protobuf import fingerprint_pb2, saved_model_pb2
from tensorflow_serving.apis import prediction_log_pb2
from tensorflow_serving.config import model_server_config_pb2

from keras_selfattn import SelfAttention
from keras_selfattn.export import ParityError, export_saved_model
from keras_selfattn.export.formats import saved_model as saved_model_module
from keras_selfattn.export.formats import saved_model_shapes
from keras_selfattn.export.forward.graph import build_endpoint
from tests import model_zoo
from tests.files import tree_digest

pytestmark = [
    pytest.mark.skipif(
        keras.backend.backend() == "torch",
        reason="SavedModel export does not run on torch (see test_export_backends)",
    ),
    # JAX's export goes through jax2tf at several times the cost; its cell of
    # the backend x format matrix is in test_export_formats / test_keras_export.
    pytest.mark.slow_on("jax", "SavedModel export and its serving checks"),
]

SHAPES = [(1, 1), (2, 33), (3, 128), (2, 512), (4, 20)]
MODELS = [*model_zoo.ALL, "attention_with_mask_input"]


def _build(name: str, seed: int = 0) -> keras.Model:
    return getattr(model_zoo, name)(seed)


def _keras_outputs(model: keras.Model, arrays: dict) -> np.ndarray:
    args = [arrays[t.name] for t in model.inputs]
    return model.predict(args if len(args) > 1 else args[0], verbose=0)


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """Each model exported once (with warmup) into one base dir; the export's
    own check (a fresh process each) is left to the tests of `check` below:
    test_parity_with_keras compares with Keras itself."""
    base = str(tmp_path_factory.mktemp("serving"))
    result = {}
    for name in MODELS:
        model = _build(name)
        version_dir = export_saved_model(model, base, name, warmup=True, check=False)
        result[name] = (model, version_dir)
    return base, result


@pytest.mark.parametrize("name", MODELS)
def test_parity_with_keras(exports, name):
    model, version_dir = exports[1][name]
    signature = tf.saved_model.load(version_dir).signatures["serving_default"]
    for batch, time in SHAPES:
        arrays = model_zoo.sample_inputs(model, batch, time, seed=batch * time)
        served = signature(**{k: tf.constant(v) for k, v in arrays.items()})
        (output_name,) = served
        np.testing.assert_allclose(
            served[output_name].numpy(),
            _keras_outputs(model, arrays),
            atol=1e-5,
            rtol=1e-4,
            err_msg=f"{name} at batch={batch}, time={time}",
        )


def test_padding_changes_the_outputs(exports):
    # Guards the parity test above: padded rows must matter, so an export that
    # ignored the mask could not pass it.
    model, _ = exports[1]["masked_classifier"]
    arrays = model_zoo.sample_inputs(model, 4, 20, seed=80)
    tokens = arrays["tokens"]
    assert (tokens == 0).any(), "sample must contain padding"
    unmasked = keras.layers.Embedding(model_zoo.VOCAB, model_zoo.FEATURES)
    unmasked.build((None, None))
    unmasked.set_weights(model.get_layer("embed").get_weights())
    x = model.get_layer("attention")(unmasked(tokens))
    x = model.get_layer("probabilities")(keras.ops.mean(x, axis=1))
    assert np.abs(np.asarray(x) - _keras_outputs(model, arrays)).max() > 1e-3


@pytest.mark.parametrize(
    "name, inputs, output, output_rank",
    [
        ("attention_only", {"features": ("float32", 3)}, "attention", 3),
        ("masked_classifier", {"tokens": ("int32", 2)}, "probabilities", 2),
        ("causal_multihead", {"sequence": ("float32", 3)}, "causal_attention", 3),
        ("transformer_encoder", {"embeddings": ("float32", 3)}, "norm_1b", 3),
        (
            "attention_with_mask_input",
            {"features": ("float32", 3), "mask": ("bool", 2)},
            "attention",
            3,
        ),
    ],
)
def test_signature_names_dtypes_and_dynamic_dims(
    exports, name, inputs, output, output_rank
):
    loaded = tf.saved_model.load(exports[1][name][1])
    assert list(loaded.signatures) == ["serving_default"]
    signature = loaded.signatures["serving_default"]
    _, specs = signature.structured_input_signature
    assert sorted(specs) == sorted(inputs)
    for input_name, (dtype, rank) in inputs.items():
        assert specs[input_name].dtype == tf.as_dtype(dtype)
        assert specs[input_name].shape.rank == rank
        assert specs[input_name].shape[:2].as_list() == [None, None]
    assert list(signature.structured_outputs) == [output]
    out_shape = signature.structured_outputs[output].shape
    assert out_shape.rank == output_rank and out_shape[0] is None


def test_tf_serving_layout_and_models_config(exports):
    base, result = exports
    for name, (_, version_dir) in result.items():
        assert version_dir == os.path.join(base, name, "1")
        assert os.path.isfile(os.path.join(version_dir, "saved_model.pb"))
        assert os.path.isdir(os.path.join(version_dir, "variables"))
    assert not [e for e in os.listdir(base) if e.startswith(".")]
    config = model_server_config_pb2.ModelServerConfig()
    with open(os.path.join(base, "models.config")) as handle:
        text_format.Parse(handle.read(), config)
    entries = config.model_config_list.config
    assert sorted(entry.name for entry in entries) == sorted(MODELS)
    assert all(entry.model_platform == "tensorflow" for entry in entries)


def _function_nodes(version_dir: str) -> list:
    saved = saved_model_pb2.SavedModel()
    with open(os.path.join(version_dir, "saved_model.pb"), "rb") as file:
        saved.ParseFromString(file.read())
    (graph,) = saved.meta_graphs
    return [node for f in graph.graph_def.library.function for node in f.node_def]


def _fingerprint(version_dir) -> bytes:
    """The SavedModel's fingerprint, its random uuid cleared."""
    fingerprint = fingerprint_pb2.FingerprintDef()
    with open(os.path.join(version_dir, "fingerprint.pb"), "rb") as file:
        fingerprint.ParseFromString(file.read())
    assert fingerprint.saved_model_checksum
    fingerprint.ClearField("uuid")
    return fingerprint.SerializeToString()


def test_functions_keep_only_the_shapes_tensorflow_cannot_infer(exports, tmp_path):
    """Each function's ops lose the traced output shapes a session infers
    again; calls and control flow keep theirs; the fingerprint TensorFlow
    reads describes the file as written (TensorFlow's own writer, run on a
    copy, writes the same one)."""
    from tensorflow.python.saved_model import fingerprinting_utils

    shapes = saved_model_shapes.SHAPES_ATTRIBUTE
    opaque = saved_model_shapes.OPAQUE_OPS
    for name, (_, version_dir) in exports[1].items():
        nodes = _function_nodes(version_dir)
        kept = [node.op for node in nodes if shapes in node.attr]
        assert kept and set(kept) <= opaque, name
        assert len(nodes) > 2 * len(kept), name
        copy = tmp_path / name
        shutil.copytree(version_dir, copy)
        os.remove(copy / "fingerprint.pb")
        fingerprinting_utils.write_fingerprint(str(copy))
        assert _fingerprint(version_dir) == _fingerprint(copy), name


def test_warmup_requests_run_through_the_signature(exports):
    model, version_dir = exports[1]["masked_classifier"]
    path = os.path.join(version_dir, "assets.extra", "tf_serving_warmup_requests")
    records = list(tf.data.TFRecordDataset(path).as_numpy_iterator())
    assert len(records) >= 2
    signature = tf.saved_model.load(version_dir).signatures["serving_default"]
    for record in records:
        log = prediction_log_pb2.PredictionLog.FromString(record)
        request = log.predict_log.request
        assert request.model_spec.name == "masked_classifier"
        assert request.model_spec.signature_name == "serving_default"
        assert list(request.inputs) == ["tokens"]
        tokens = tf.make_ndarray(request.inputs["tokens"])
        assert tokens.dtype == np.int32 and tokens.shape[0] == 1
        assert tokens.min() >= 1 and tokens.max() < model_zoo.VOCAB
        served = signature(tokens=tf.constant(tokens))["probabilities"].numpy()
        np.testing.assert_allclose(served, model.predict(tokens, verbose=0), atol=1e-6)


def test_attention_weights_output(tmp_path):
    model = model_zoo.masked_classifier()
    version_dir = export_saved_model(
        model,
        tmp_path,
        "clf",
        attention_outputs="attention",
        models_config=False,
        check=False,  # compared with the layer itself below
    )
    signature = tf.saved_model.load(version_dir).signatures["serving_default"]
    assert sorted(signature.structured_outputs) == [
        "attention_weights",
        "probabilities",
    ]
    tokens = model_zoo.sample_inputs(model, 3, 9, seed=3)["tokens"]
    served = signature(tokens=tf.constant(tokens))
    # Reference: the layer called directly on the embedded tokens and mask.
    embedded = model.get_layer("embed")(tokens)
    _, weights = model.get_layer("attention")(
        embedded, mask=tokens != 0, return_attention_scores=True
    )
    assert served["attention_weights"].shape == (3, 2, 9, 9)
    np.testing.assert_allclose(served["attention_weights"], weights, atol=1e-6)
    np.testing.assert_allclose(
        served["probabilities"], model.predict(tokens, verbose=0), atol=1e-6
    )


def test_sequential_model_exports(tmp_path):
    model = keras.Sequential(
        [
            keras.Input((None, 4), name="signal"),
            SelfAttention(num_heads=2, name="attention"),
            keras.layers.Dense(1, name="score"),
        ]
    )
    version_dir = export_saved_model(
        model, tmp_path, "seq", models_config=False, check=False
    )
    signature = tf.saved_model.load(version_dir).signatures["serving_default"]
    x = np.random.default_rng(0).standard_normal((2, 7, 4)).astype("float32")
    served = signature(signal=tf.constant(x))
    np.testing.assert_allclose(served["score"], model.predict(x, verbose=0), atol=1e-5)


def test_model_loaded_from_keras_file(tmp_path):
    model = model_zoo.causal_multihead(seed=4)
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras", safe_mode=True)
    version_dir = export_saved_model(loaded, tmp_path / "base", "m", check=False)
    signature = tf.saved_model.load(version_dir).signatures["serving_default"]
    x = model_zoo.sample_inputs(model, 2, 11, seed=1)["sequence"]
    np.testing.assert_allclose(
        signature(sequence=tf.constant(x))["causal_attention"],
        model.predict(x, verbose=0),
        atol=1e-5,
    )


# ----------------------------------------------------------- versions, safety
@pytest.fixture
def small_model():
    return model_zoo.attention_only(seed=1)


def test_versions_increment_and_explicit_versions(tmp_path, small_model):
    def export(version=None):
        return export_saved_model(
            small_model, tmp_path, "m", version, check=False, models_config=False
        )

    assert export() == os.path.join(tmp_path, "m", "1")
    assert export() == os.path.join(tmp_path, "m", "2")
    assert export(7) == os.path.join(tmp_path, "m", "7")
    os.makedirs(tmp_path / "m" / "not_a_version")
    assert export() == os.path.join(tmp_path, "m", "8")
    assert sorted(os.listdir(tmp_path / "m")) == ["1", "2", "7", "8", "not_a_version"]


def test_existing_version_is_refused_and_left_byte_identical(tmp_path, small_model):
    first = export_saved_model(small_model, tmp_path, "m", check=False)
    before = tree_digest(str(tmp_path))
    other = model_zoo.attention_only(seed=2)
    with pytest.raises(FileExistsError, match="Version 1 of model 'm' already exists"):
        export_saved_model(other, tmp_path, "m", version=1)
    os.rename(first, os.path.join(tmp_path, "m", "001"))
    with pytest.raises(FileExistsError, match="Version 1"):
        export_saved_model(other, tmp_path, "m", version=1)
    os.rename(os.path.join(tmp_path, "m", "001"), first)
    assert tree_digest(str(tmp_path)) == before


@pytest.mark.parametrize("error", [RuntimeError("disk full"), KeyboardInterrupt()])
def test_failure_mid_export_leaves_nothing(tmp_path, small_model, monkeypatch, error):
    export_saved_model(small_model, tmp_path, "m", check=False)
    before = tree_digest(str(tmp_path))

    def write_half_then_fail(endpoint, directory):
        with open(os.path.join(directory, "saved_model.pb"), "wb") as handle:
            handle.write(b"partial")
        os.makedirs(os.path.join(directory, "variables"))
        raise error

    monkeypatch.setattr(saved_model_module, "write_saved_model", write_half_then_fail)
    with pytest.raises(type(error)):
        export_saved_model(small_model, tmp_path, "m")
    with pytest.raises(type(error)):
        export_saved_model(small_model, tmp_path / "fresh" / "base", "m")
    assert tree_digest(str(tmp_path)) == before
    assert sorted(os.listdir(tmp_path)) == ["m", "models.config"]


@pytest.mark.slow  # two exports of a SavedModel: 12 s
def test_failed_check_leaves_nothing(tmp_path, monkeypatch):
    # A SavedModel that loads but computes another function (weights of
    # another seed) must be refused before it is moved into place.
    model = model_zoo.attention_only(seed=0)
    impostor = model_zoo.attention_only(seed=1)
    real_write = saved_model_module.write_saved_model

    def write_impostor(target, directory):
        real_write(build_endpoint(impostor).target(), directory)

    monkeypatch.setattr(saved_model_module, "write_saved_model", write_impostor)
    with pytest.raises(ParityError, match="differ from Keras") as caught:
        export_saved_model(model, tmp_path, "m", models_config=False)
    assert not caught.value.report.ok
    assert os.listdir(tmp_path) == []


# ----------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "name", ["", "  ", "a/b", "../evil", "..", ".", ".hidden", "a\\b", "x\x00y", "a\nb"]
)
def test_bad_names_are_refused_before_writing(tmp_path, small_model, name):
    with pytest.raises(ValueError, match="`name`") as caught:
        export_saved_model(small_model, tmp_path / "base", name)
    assert repr(name) in str(caught.value)
    assert not os.path.exists(tmp_path / "base")
    assert os.listdir(tmp_path) == []


def test_empty_base_dir_is_refused(tmp_path, small_model, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="`base_dir` must be a non-empty path"):
        export_saved_model(small_model, "", "m")
    assert os.listdir(tmp_path) == []


def test_concurrent_export_of_the_same_version_is_not_overwritten(
    tmp_path, small_model, monkeypatch
):
    # Another process creates version 1 while this export writes: the rename
    # must fail instead of replacing it, and this export's files must go.
    real_write = saved_model_module.write_saved_model
    target = tmp_path / "m" / "1"

    def write_while_another_process_exports(export_target, directory):
        real_write(export_target, directory)
        target.mkdir()
        (target / "saved_model.pb").write_bytes(b"the other export")

    monkeypatch.setattr(
        saved_model_module, "write_saved_model", write_while_another_process_exports
    )
    with pytest.raises(FileExistsError):
        export_saved_model(small_model, tmp_path, "m", check=False)
    assert os.listdir(tmp_path / "m") == ["1"]
    assert os.listdir(target) == ["saved_model.pb"]
    assert (target / "saved_model.pb").read_bytes() == b"the other export"


@pytest.mark.parametrize("version", [0, -3, 1.5, "2", True])
def test_bad_versions_are_refused(tmp_path, small_model, version):
    with pytest.raises(ValueError, match=f"version={version!r}"):
        export_saved_model(small_model, tmp_path, "m", version)
    assert os.listdir(tmp_path) == []


def test_auto_generated_input_name_is_refused(tmp_path):
    inputs = keras.Input((None, 4))
    model = keras.Model(inputs, SelfAttention()(inputs))
    with pytest.raises(
        ValueError, match=r"'(input_layer|keras_tensor)(_\d+)?' has a name Keras"
    ):
        export_saved_model(model, tmp_path, "m")
    assert os.listdir(tmp_path) == []


def test_not_a_model_is_refused(tmp_path):
    with pytest.raises(TypeError, match="must be a keras.Model"):
        export_saved_model(SelfAttention(), tmp_path, "m")

    class Subclassed(keras.Model):
        def call(self, x):
            return x

    with pytest.raises(ValueError, match="Functional or Sequential"):
        export_saved_model(Subclassed(), tmp_path, "m")
    assert os.listdir(tmp_path) == []


def test_unknown_attention_layer_is_refused(tmp_path, small_model):
    with pytest.raises(ValueError, match=r"'nope'.*Available: \['attention'\]"):
        export_saved_model(small_model, tmp_path, "m", attention_outputs="nope")


def test_unwritable_target(tmp_path, small_model):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(NotADirectoryError):
        export_saved_model(small_model, blocker / "base", "m", check=False)
    assert sorted(os.listdir(tmp_path)) == ["file"]


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_read_only_base_dir(tmp_path, small_model):
    base = tmp_path / "base"
    base.mkdir()
    base.chmod(0o555)
    try:
        with pytest.raises(PermissionError):
            export_saved_model(small_model, base, "m", check=False)
        assert os.listdir(base) == []
    finally:
        base.chmod(0o755)
