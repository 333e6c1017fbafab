"""Every export refusal is one line that names the format, the cause and what
to do; converters print nothing unless asked, and nothing is left on disk.

A converter is made to fail the way they do (a long message, its own
diagnostics on file descriptor 2): the exporter raises one `ExportError`
line naming the telling line, keeps the converter's exception as
`__cause__` and what it printed as `log`, and the command line prints them
with `--verbose` only. Bad destinations are refused in one line for every
format of the table.
"""

from __future__ import annotations

import os

import keras
import pytest

from keras_selfattn import SelfAttention
from keras_selfattn.export import (
    ExportError,
    export_litert,
    export_onnx,
    export_openvino,
    export_saved_model,
)
from keras_selfattn_cli import main
from keras_selfattn_runtimes import table

pytestmark = pytest.mark.tensorflow_only("tf2onnx is the converter made to fail")

CAUSE = "the converter cannot express tf.SomeOp"


def _model() -> keras.Model:
    keras.utils.set_random_seed(0)
    x = keras.Input((None, 8), name="x")
    return keras.Model(x, SelfAttention(num_heads=2)(x))


@pytest.fixture
def failing_converter(monkeypatch):
    """tf2onnx writes diagnostics to fd 2 and to Python's streams, then
    raises a many-line error whose cause is on its third line."""
    # tf2onnx.convert (Keras's own ONNX route) binds the real function when
    # first imported: imported here first, a later test's conversion is not
    # left with this one.
    import tf2onnx.convert  # noqa: F401
    import tf2onnx.tfonnx

    def convert(*args, **kwargs):
        os.write(2, b"E0000 converter.cc:12] lowering failed\n")
        print("converter: trying harder")
        raise RuntimeError(
            f"Traceback (most recent call last)\n  frame\nerror: {CAUSE}\n"
        )

    # The conversion's tf2onnx step (`format.convert_to_onnx` imports it
    # when it runs).
    monkeypatch.setattr(tf2onnx.tfonnx, "process_tf_graph", convert)


def test_a_failing_converter_is_one_quiet_line(failing_converter, tmp_path, capfd):
    model = _model()
    capfd.readouterr()  # what building the model printed (TensorFlow's log)
    with pytest.raises(ExportError) as caught:
        export_onnx(model, tmp_path / "out" / "m.onnx")
    message = str(caught.value)
    assert len(message.splitlines()) == 1, message
    assert message.startswith("ONNX conversion failed: ") and CAUSE in message
    assert message.endswith("export a SavedModel instead, or pass another opset")
    assert isinstance(caught.value.__cause__, RuntimeError)
    assert "lowering failed" in caught.value.log and "trying harder" in caught.value.log
    printed = capfd.readouterr()
    assert printed.out == "" and printed.err == ""
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("verbose", [False, True])
def test_the_command_line_shows_the_converters_log_only_when_verbose(
    failing_converter, tmp_path, capsys, verbose
):
    model_path = tmp_path / "m.keras"
    _model().save(model_path)
    argv = ["export", str(model_path), "--onnx", str(tmp_path / "m.onnx")]
    status = main((["--verbose"] if verbose else []) + argv)
    err = capsys.readouterr().err
    assert status == 1
    assert err.splitlines()[-1].startswith("keras-selfattn: error: ONNX conversion")
    assert CAUSE in err.splitlines()[-1]
    if verbose:
        assert "Traceback" in err and "lowering failed" in err
    else:
        assert len(err.splitlines()) == 1, err


def _exporters(tmp_path):
    model = _model()
    return {
        "saved_model": lambda path: export_saved_model(model, path, "m"),
        "onnx": lambda path: export_onnx(model, path),
        "litert": lambda path: export_litert(model, path),
        "openvino": lambda path: export_openvino(model, path),
    }


def test_every_file_format_refuses_another_formats_suffix_and_a_folder(tmp_path):
    (tmp_path / "folder").mkdir()
    for name, export in _exporters(tmp_path).items():
        row = table.BY_NAME[name]
        if row.suffix is None:
            continue
        others = [r.suffix for r in table.FILE_ROWS if r.suffix != row.suffix]
        for path, fragment in [
            (tmp_path / f"m{others[0]}", f"must end with {row.suffix!r}"),
            (tmp_path / "folder", "must name a file"),
        ]:
            with pytest.raises(ValueError) as caught:
                export(path)
            message = str(caught.value)
            assert len(message.splitlines()) == 1 and fragment in message, message
    assert sorted(os.listdir(tmp_path)) == ["folder"]


def test_a_file_where_the_serving_folder_goes_is_refused_by_name(tmp_path):
    (tmp_path / "serving").write_text("not a folder")
    with pytest.raises(ValueError, match="`base_dir` must be a folder") as caught:
        _exporters(tmp_path)["saved_model"](tmp_path / "serving")
    assert len(str(caught.value).splitlines()) == 1


def test_a_native_log_line_is_never_the_cause():
    """TensorFlow's and XLA's native log (a CUDA probe's "error" on a CPU
    machine) is printed on the side; the cause is the converter's own."""
    from keras_selfattn.export.formats._base import cause

    log = (
        "E0000 00:00:1795609818.445214   21881 cuda_platform.cc:52] failed call "
        "to cuInit: INTERNAL: CUDA error: Failed call to cuInit: UNKNOWN ERROR\n"
        "W0000 00:00:1795609818.5 x.cc:1] error: not this one either\n"
    )
    error = RuntimeError("Symbolic dimension comparison 'time' >= '0' is inconclusive")
    assert cause(error, log) == str(error)
