"""Formats by their names: the checks' `paths` ({format: artifact}) and the
generic `export(model, path, format, **options)`; their refusals are one
ValueError naming the argument and the value, before any work."""

from __future__ import annotations

import os

import pytest

from keras_selfattn.export import export, verify, verify_decode_step, verify_generator
from tests import model_zoo


@pytest.fixture(scope="module")
def model():
    return model_zoo.attention_only()


def test_paths_naming_an_unknown_format_is_refused(model):
    with pytest.raises(ValueError, match=r"`paths` must name formats.*'keras'"):
        verify(model, paths={"keras": "m.keras"})


def test_a_format_given_by_its_keyword_and_by_paths_is_refused(model):
    with pytest.raises(ValueError) as caught:
        verify(model, onnx_path="a.onnx", paths={"onnx": "b.onnx"})
    message = str(caught.value)
    assert "given twice" in message and "onnx_path='a.onnx'" in message, message
    assert "paths={'onnx': 'b.onnx'}" in message, message


@pytest.mark.slow_on("jax", "two decoding checks compiled op by op: 31 s")
def test_paths_is_read_by_every_check(model, tmp_path):
    """The artifact given by `paths` is the one looked for on disk."""
    missing = str(tmp_path / "missing.onnx")
    with pytest.raises(FileNotFoundError, match="missing.onnx"):
        verify(model, paths={"onnx": missing})
    decoder = model_zoo.decoder_language_model()
    with pytest.raises(FileNotFoundError, match="missing.onnx"):
        verify_decode_step(decoder, max_length=8, paths={"onnx": missing})
    # A generator is never an OpenVINO artifact (export_decode_step is).
    with pytest.raises(ValueError, match=r"`paths` must name formats.*'openvino'"):
        verify_generator(decoder, max_length=8, paths={"openvino": "m.xml"})


def test_export_refuses_an_unknown_format_and_a_foreign_option(model, tmp_path):
    with pytest.raises(ValueError) as caught:
        export(model, tmp_path / "m.keras", "keras")
    message = str(caught.value)
    assert "format='keras'" in message and "'onnx'" in message, message
    # ONNX is written from every backend; `shape` is LiteRT's option.
    with pytest.raises(ValueError, match=r"ONNX export takes no `shape`"):
        export(model, tmp_path / "m.onnx", "onnx", shape=(1, 2))
    assert os.listdir(tmp_path) == []


@pytest.mark.slow
@pytest.mark.tensorflow_only("a SavedModel and an ONNX file from TensorFlow")
def test_one_pipeline_export_checks_several_formats_and_leaves_all_or_none(
    tmp_path, monkeypatch
):
    """`pipeline.export(target, {format: path})`: a decoding step in two
    formats, one check for both; when it fails, neither appears."""
    from keras_selfattn.export import ParityError, pipeline
    from keras_selfattn.export.decode_step import DecodeStepExport

    model = model_zoo.decoder_language_model()
    paths = {"saved_model": tmp_path / "serving", "onnx": tmp_path / "step.onnx"}
    checks = {"atol": 1e-4, "rtol": 1e-4}
    step = DecodeStepExport(model, 8, {"name": "lm", "opset": None}, checks)
    checked = []

    def failing(staged):
        checked.append(sorted(staged))
        raise ParityError("differs", None)

    monkeypatch.setattr(step, "check", failing)
    with pytest.raises(ParityError):
        pipeline.export(step, paths)
    assert checked == [["onnx", "saved_model"]] and os.listdir(tmp_path) == []
    monkeypatch.undo()
    written = pipeline.export(step, paths)
    assert written == {
        "saved_model": str(tmp_path / "serving" / "lm" / "1"),
        "onnx": str(tmp_path / "step.onnx"),
    }
    assert sorted(os.listdir(tmp_path)) == ["serving", "step.onnx"]
