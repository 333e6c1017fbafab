"""The warning a large generator export gives in a TensorFlow process with
oneDNN's ops on (`tensorflow_env.onednn_memory_warning`)."""

import platform

import keras
import pytest

from keras_selfattn import SelfAttention
from keras_selfattn.export import export_generator, tensorflow_env

GIB = 2**30
X86_LINUX = platform.system() == "Linux" and platform.machine().lower() in (
    "x86_64",
    "amd64",
)


@pytest.mark.skipif(
    not X86_LINUX, reason="oneDNN's ops are TensorFlow's default on x86 Linux"
)
@pytest.mark.parametrize("setting", [None, "1"])
def test_large_model_on_tensorflow_with_onednn_on_warns(monkeypatch, setting):
    if setting is None:
        monkeypatch.delenv(tensorflow_env.ONEDNN, raising=False)
    else:
        monkeypatch.setenv(tensorflow_env.ONEDNN, setting)
    note = tensorflow_env.onednn_memory_warning(int(2.21 * GIB), "tensorflow")
    assert note is not None
    assert "TF_ENABLE_ONEDNN_OPTS=0" in note
    assert f"TF_ENABLE_ONEDNN_OPTS={setting or 'unset'}" in note
    assert "2.21 GiB" in note


@pytest.mark.parametrize(
    "setting, weight_bytes, backend",
    [
        ("0", 3 * GIB, "tensorflow"),  # off
        (None, GIB - 1, "tensorflow"),  # small
        (None, 3 * GIB, "jax"),  # the writer process runs it off
        (None, 3 * GIB, "torch"),
    ],
)
def test_no_warning_off_small_or_other_backends(
    monkeypatch, setting, weight_bytes, backend
):
    if setting is None:
        monkeypatch.delenv(tensorflow_env.ONEDNN, raising=False)
    else:
        monkeypatch.setenv(tensorflow_env.ONEDNN, setting)
    assert tensorflow_env.onednn_memory_warning(weight_bytes, backend) is None


def _model():
    tokens = keras.Input((None,), dtype="int32")
    h = keras.layers.Embedding(11, 8)(tokens)
    h = SelfAttention(num_heads=2, causal=True)(h)
    return keras.Model(tokens, keras.layers.Dense(11)(h))


def test_small_generator_export_does_not_warn(tmp_path, monkeypatch, recwarn):
    monkeypatch.delenv(tensorflow_env.ONEDNN, raising=False)
    with pytest.raises(ValueError, match="export_format"):
        export_generator(_model(), str(tmp_path / "g"), "openvino", max_length=8)
    assert not [w for w in recwarn if "oneDNN" in str(w.message)]


@pytest.mark.skipif(
    not X86_LINUX or keras.backend.backend() != "tensorflow",
    reason="oneDNN's ops in this process: TensorFlow's, on x86 Linux",
)
def test_export_generator_warns_past_the_threshold(tmp_path, monkeypatch):
    monkeypatch.delenv(tensorflow_env.ONEDNN, raising=False)
    monkeypatch.setattr(tensorflow_env, "LARGE_WEIGHT_BYTES", 1)
    with pytest.warns(UserWarning, match="TF_ENABLE_ONEDNN_OPTS=0 before"):
        with pytest.raises(ValueError, match="export_format"):
            export_generator(_model(), str(tmp_path / "g"), "openvino", max_length=8)
    assert not (tmp_path / "g").exists()
