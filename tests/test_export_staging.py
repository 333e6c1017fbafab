"""LiteRT and OpenVINO exports: refused when wrong, staged, named, atomic.

Under TensorFlow in this process (the runtimes still run in fresh ones): an
export whose artifact computes something else is refused with nothing left
on disk; OpenVINO's bf16 is reported under its own label; artifacts Keras's
own `model.export` wrote verify too; killed runs' temporaries are removed by
the next run, other names' and live runs' are not; an interrupt landing right
after a folder or file is made leaves nothing.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from keras_selfattn.export import (
    ParityError,
    _files,
    export_litert,
    export_openvino,
    verify,
)
from keras_selfattn.export.formats import litert
from keras_selfattn.serving import write_models_config
from tests import model_zoo
from tests.files import atomic_file

pytestmark = pytest.mark.tensorflow_only("LiteRT and OpenVINO from TensorFlow")


@pytest.fixture(scope="module")
def classifier():
    return model_zoo.masked_classifier(seed=0)


@pytest.fixture(scope="module")
def keras_written(classifier, tmp_path_factory):
    """The classifier exported by Keras's own model.export (output_0 names)."""
    root = tmp_path_factory.mktemp("keras_written")
    classifier.export(str(root / "m.tflite"), format="litert", verbose=False)
    classifier.export(str(root / "m.onnx"), format="onnx", verbose=False)
    return root


def test_an_artifact_that_computes_something_else_is_refused(
    classifier, tmp_path, monkeypatch
):
    """The written file is another model's (as Keras's torch LiteRT route
    was for grouped-query attention): the check fails, nothing appears."""
    impostor = model_zoo.masked_classifier(seed=5)
    real_write = litert.FORMAT.write
    from keras_selfattn.export.forward.graph import build_endpoint

    def write_impostor(target, path, options):
        real_write(build_endpoint(impostor).target(), path, options)

    monkeypatch.setattr(litert.FORMAT, "write", write_impostor)
    with pytest.raises(ParityError, match="differ from Keras") as caught:
        export_litert(classifier, tmp_path / "out" / "m.tflite")
    assert {row.runtime for row in caught.value.report.rows} == {"litert"}
    assert os.listdir(tmp_path) == []


@pytest.mark.slow  # an OpenVINO export checked twice: 8 s
def test_openvino_writes_both_files_and_reports_bf16_apart(classifier, tmp_path):
    path = export_openvino(classifier, tmp_path / "m.xml")
    assert sorted(os.listdir(tmp_path)) == ["m.bin", "m.xml"]
    report = verify(
        classifier,
        openvino_path=path,
        shapes=[(2, 7)],
        openvino_precision="bf16",
        atol=0.05,
        rtol=0.05,
    )
    assert [row.runtime for row in report.rows] == ["openvino_bf16"]
    with pytest.raises(ValueError, match="openvino_precision='fp8'"):
        verify(classifier, openvino_path=path, openvino_precision="fp8")


@pytest.mark.slow  # Keras's own exports in two formats, verified: 7 s
def test_artifacts_keras_wrote_itself_verify(classifier, keras_written):
    report = verify(
        classifier,
        litert_path=keras_written / "m.tflite",
        onnx_path=keras_written / "m.onnx",
        shapes=[(2, 7), (3, 33)],
    )
    assert report.ok and {row.runtime for row in report.rows} == {"litert", "onnx"}
    other = model_zoo.masked_classifier(seed=6)
    with pytest.raises(ParityError, match="differ from Keras"):
        verify(other, litert_path=keras_written / "m.tflite", shapes=[(2, 7)])


@pytest.mark.parametrize(
    "path, message",
    [
        ("m.onnx", "must end with '.tflite'"),
        ("", "non-empty path"),
        ("dir/", "must name a file"),
    ],
)
def test_bad_paths_are_refused_before_any_work(classifier, tmp_path, path, message):
    with pytest.raises(ValueError, match=message):
        export_litert(classifier, f"{tmp_path}/{path}" if path else path)
    assert os.listdir(tmp_path) == []


def test_bad_shape_is_refused(classifier, tmp_path):
    with pytest.raises(ValueError, match=r"Received: shape=\(0, 4\)"):
        export_litert(classifier, tmp_path / "m.tflite", shape=(0, 4))


def test_next_run_removes_temporaries_of_killed_runs_only(tmp_path):
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    dead_pid = int(dead.stdout)
    killed = tmp_path / f".m.onnx.tmp-{dead_pid}-abc"
    live = tmp_path / f".m.onnx.tmp-{os.getpid()}-def"
    other_name = tmp_path / f".n.onnx.tmp-{dead_pid}-ghi"
    for folder in (killed, live, other_name):
        folder.mkdir()
    with atomic_file(str(tmp_path / "m.onnx")) as tmp:
        with open(tmp, "w") as handle:
            handle.write("x")
    assert sorted(os.listdir(tmp_path)) == sorted(
        ["m.onnx", live.name, other_name.name]
    )


class _InterruptAfter:
    """Wraps an `os` function: calls it, then raises KeyboardInterrupt after
    the `after`-th call, as a signal landing right after it would."""

    def __init__(self, real, after: int):
        self.real, self.after, self.calls = real, after, 0

    def __call__(self, *args, **kwargs):
        result = self.real(*args, **kwargs)
        self.calls += 1
        if self.calls == self.after:
            raise KeyboardInterrupt
        return result


def _write_config(path: str) -> None:
    write_models_config(os.path.dirname(path), ["clf"])


# The signal handler raises between two bytecodes, so KeyboardInterrupt can
# land after a folder or file is made and before its name is kept: interrupt
# after each of the creating calls of one write (two missing parents and the
# temporary for exports; the temporary file for models.config) and the tree
# must be as before.
@pytest.mark.parametrize(
    "write, function, calls",
    [
        (lambda target: _files.atomic_directory(target).__enter__(), "mkdir", 3),
        (lambda target: atomic_file(target).__enter__(), "mkdir", 3),
        (_write_config, "open", 1),
    ],
    ids=["export_directory", "export_file", "models_config"],
)
def test_an_interrupt_right_after_a_creating_call_leaves_nothing(
    tmp_path, monkeypatch, write, function, calls
):
    target = tmp_path / "new" / "deeper" / "m"
    if function == "open":
        target.parent.mkdir(parents=True)
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    real = getattr(os, function)
    for after in range(1, calls + 1):
        interrupting = _InterruptAfter(real, after)
        monkeypatch.setattr(os, function, interrupting)
        with pytest.raises(KeyboardInterrupt):
            write(str(target))
        monkeypatch.setattr(os, function, real)
        assert interrupting.calls == after
        assert sorted(str(p) for p in tmp_path.rglob("*")) == before, after
