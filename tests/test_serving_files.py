"""Warmup files and models.config: TF Serving's protos, errors, atomic writes."""

from __future__ import annotations

import os

import numpy as np
import pytest
import tensorflow as tf
from google.protobuf import text_format
from tensorflow_serving.apis import prediction_log_pb2
from tensorflow_serving.config import model_server_config_pb2

from keras_selfattn.serving import (
    models_config_text,
    read_warmup_file,
    served_model_names,
    write_models_config,
    write_warmup_file,
)
from keras_selfattn.serving.warmup import MAX_WARMUP_RECORDS

pytestmark = pytest.mark.tensorflow_only(
    "TF Serving's protos and TFRecord warmup files"
)


def _examples() -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(3)
    return [
        {
            "tokens": rng.integers(0, 9, size=(1, 4)).astype("int32"),
            "mask": np.array([[True, True, False, False]]),
        },
        {
            "tokens": rng.integers(0, 9, size=(2, 7)).astype("int32"),
            "mask": np.ones((2, 7), bool),
        },
    ]


# --- warmup ----------------------------------------------------------------


def test_warmup_file_holds_prediction_logs_tf_serving_can_read(tmp_path):
    path = tmp_path / "1" / "assets.extra" / "tf_serving_warmup_requests"
    examples = _examples()
    assert write_warmup_file(str(path), "clf", examples, "sig") == str(path)
    # Read back with TensorFlow's own TFRecord reader and TF Serving's proto.
    records = [r.numpy() for r in tf.data.TFRecordDataset(str(path))]
    assert len(records) == len(examples)
    for record, example in zip(records, examples, strict=True):
        log = prediction_log_pb2.PredictionLog.FromString(record)
        assert log.WhichOneof("log_type") == "predict_log"
        request = log.predict_log.request
        assert request.model_spec.name == "clf"
        assert request.model_spec.signature_name == "sig"
        assert set(request.inputs) == set(example)
        for key, value in example.items():
            decoded = tf.make_ndarray(request.inputs[key])
            assert decoded.dtype == value.dtype
            np.testing.assert_array_equal(decoded, value)
    assert os.listdir(path.parent) == [path.name]  # no temporary file left


def test_read_warmup_file_returns_the_requests_in_order(tmp_path):
    path = str(tmp_path / "warmup")
    examples = _examples()
    write_warmup_file(path, "clf", examples)
    requests = read_warmup_file(path)
    assert [r.inputs["tokens"].tensor_shape.dim[1].size for r in requests] == [4, 7]
    for request, example in zip(requests, examples, strict=True):
        np.testing.assert_array_equal(
            tf.make_ndarray(request.inputs["mask"]), example["mask"]
        )
        assert request.model_spec.signature_name == "serving_default"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"examples": []}, "`examples` must be a non-empty list"),
        ({"examples": {"x": np.zeros(1)}}, "`examples` must be a non-empty list"),
        ({"examples": [{}]}, r"`examples\[0\]` must be a non-empty dict"),
        ({"examples": [{"x": np.array(["a"])}]}, r"inputs\['x'\]"),
        ({"examples": [{"x": np.zeros(1)}] * (MAX_WARMUP_RECORDS + 1)}, "at most 1000"),
        ({"model_name": "a/b"}, "model_name='a/b'"),
        ({"signature_name": ""}, "signature_name=''"),
        ({"path": ""}, "path=''"),
    ],
)
def test_write_warmup_file_rejects_bad_arguments(tmp_path, kwargs, message):
    target = tmp_path / "warmup"
    arguments = {
        "path": str(target),
        "model_name": "clf",
        "examples": [{"x": np.zeros((1, 2), "float32")}],
    }
    arguments.update(kwargs)
    with pytest.raises(ValueError, match=message):
        write_warmup_file(**arguments)
    assert os.listdir(tmp_path) == []  # nothing written, not even a folder


def test_failed_warmup_write_keeps_the_old_file(tmp_path):
    path = str(tmp_path / "warmup")
    write_warmup_file(path, "clf", _examples())
    before = open(path, "rb").read()
    with pytest.raises(ValueError):
        write_warmup_file(path, "clf", [{"x": np.array([object()])}])
    assert open(path, "rb").read() == before
    assert os.listdir(tmp_path) == ["warmup"]


def test_read_warmup_file_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing"):
        read_warmup_file(str(tmp_path / "missing"))
    garbage = tmp_path / "garbage"
    garbage.write_bytes(b"this is not a TFRecord file at all")
    with pytest.raises(ValueError, match="not a TFRecord file"):
        read_warmup_file(str(garbage))
    classify = tmp_path / "classify"
    log = prediction_log_pb2.PredictionLog()
    log.classify_log.request.model_spec.name = "clf"
    with tf.io.TFRecordWriter(str(classify)) as writer:
        writer.write(log.SerializeToString())
    with pytest.raises(ValueError, match="Record 0 .*found 'classify_log'"):
        read_warmup_file(str(classify))
    not_a_proto = tmp_path / "not_a_proto"
    with tf.io.TFRecordWriter(str(not_a_proto)) as writer:
        writer.write(b"\xff\xff\xff")
    with pytest.raises(ValueError, match="Record 0 .* is not a PredictionLog proto"):
        read_warmup_file(str(not_a_proto))


# --- models.config -----------------------------------------------------------


def _parse(text: str) -> model_server_config_pb2.ModelServerConfig:
    return text_format.Parse(text, model_server_config_pb2.ModelServerConfig())


def test_models_config_docker_and_local_paths(tmp_path):
    docker = _parse(models_config_text(str(tmp_path), ["a", "b"]))
    models = docker.model_config_list.config
    assert [(m.name, m.base_path, m.model_platform) for m in models] == [
        ("a", "/models/a", "tensorflow"),
        ("b", "/models/b", "tensorflow"),
    ]
    other = _parse(models_config_text(str(tmp_path), ["a"], container_base="/srv/m"))
    assert other.model_config_list.config[0].base_path == "/srv/m/a"
    local = _parse(models_config_text("relative/dir", ["a"], container_base=None))
    assert local.model_config_list.config[0].base_path == os.path.join(
        os.path.abspath("relative/dir"), "a"
    )


def test_write_models_config_replaces_atomically(tmp_path):
    path = write_models_config(str(tmp_path), ["a"])
    assert path == str(tmp_path / "models.config")
    write_models_config(str(tmp_path), ["a", "b"])
    config = _parse(open(path).read())
    assert [m.name for m in config.model_config_list.config] == ["a", "b"]
    local = write_models_config(str(tmp_path), ["a"], None, "models.local.config")
    assert _parse(open(local).read()).model_config_list.config[0].base_path == str(
        tmp_path / "a"
    )
    assert sorted(os.listdir(tmp_path)) == ["models.config", "models.local.config"]


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"model_names": []}, ValueError, "must not be empty"),
        ({"model_names": "abc"}, ValueError, "model_names='abc'"),
        ({"model_names": ["a", "a"]}, ValueError, r"duplicates \['a'\]"),
        ({"model_names": ["../x"]}, ValueError, "model_name='../x'"),
        ({"model_names": [".."]}, ValueError, "model_name='..'"),
        ({"model_names": ["a\\b"]}, ValueError, "model_name="),
        ({"container_base": "models"}, ValueError, "container_base='models'"),
        ({"file_name": "sub/m.config"}, ValueError, "file_name='sub/m.config'"),
        ({"file_name": ".."}, ValueError, "file_name='..'"),
        ({"base_dir": ""}, ValueError, "base_dir=''"),
        ({"base_dir": "/no/such/b"}, FileNotFoundError, "base_dir='/no/such/b'"),
    ],
)  # fmt: skip
def test_write_models_config_rejects_bad_arguments(tmp_path, kwargs, error, message):
    (tmp_path / "models.config").write_text("previous")
    arguments = {"base_dir": str(tmp_path), "model_names": ["a"]}
    arguments.update(kwargs)
    with pytest.raises(error, match=message):
        write_models_config(**arguments)
    assert (tmp_path / "models.config").read_text() == "previous"
    assert os.listdir(tmp_path) == ["models.config"]


def test_served_model_names_lists_folders_with_a_saved_model(tmp_path):
    for folder in ["good/1", "good/2", "no_version/variables", ".tmp-x/1", "empty/3"]:
        (tmp_path / folder).mkdir(parents=True)
    for pb in ["good/2/saved_model.pb", ".tmp-x/1/saved_model.pb"]:
        (tmp_path / pb).write_bytes(b"")
    (tmp_path / "other" / "7").mkdir(parents=True)
    (tmp_path / "other" / "7" / "saved_model.pb").write_bytes(b"")
    (tmp_path / "models.config").write_text("")
    assert served_model_names(str(tmp_path)) == ["good", "other"]
    with pytest.raises(FileNotFoundError, match="base_dir="):
        served_model_names(str(tmp_path / "missing"))
