"""One build per export: the graph an export writes (the forward pass's
endpoint, the decoding step, the generator) is built once, and its check
reuses it instead of building it again from the model."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import pytest

from keras_selfattn.export import export_decode_step, export_generator, export_onnx
from tests import model_zoo
from tests.test_generation import token_model

pytestmark = pytest.mark.tensorflow_only("ONNX and generator exports via TensorFlow")


@contextlib.contextmanager
def counted(name: str):
    """Counts calls of the package's function `name`, wherever a module of
    the package holds it (each module that imported it by name)."""
    calls = []
    patched = []
    for module in list(sys.modules.values()):
        if not getattr(module, "__name__", "").startswith("keras_selfattn"):
            continue
        original = vars(module).get(name)
        if not callable(original):
            continue

        def counting(*args, _original=original, **kwargs):
            calls.append(args)
            return _original(*args, **kwargs)

        setattr(module, name, counting)
        patched.append((module, original))
    assert patched, f"no module holds {name}"
    try:
        yield calls
    finally:
        for module, original in patched:
            setattr(module, name, original)


REPO = Path(__file__).resolve().parents[1]
# The export's own code: its package, the serving files it writes with, the
# formats' table. CONTRIBUTING.md gives the figure (Keras's own: 3 modules).
EXPORT_CODE = (
    "keras_selfattn/export/",
    "keras_selfattn/serving/",
    "keras_selfattn_runtimes/",
)
MOST_EXPORT_MODULES = 20


@contextlib.contextmanager
def modules_run():
    """The files of this checkout whose Python code runs in the block (a
    function called or a module imported)."""
    files = set()

    def profile(frame, event, arg):
        if event == "call":
            files.add(frame.f_code.co_filename)

    sys.setprofile(profile)
    try:
        yield files
    finally:
        sys.setprofile(None)


def test_a_forward_export_builds_its_endpoint_once(tmp_path):
    model = model_zoo.causal_multihead()
    # Imported by a first export, so the count is of the modules whose code
    # an export runs, whichever tests ran before in this process.
    export_onnx(model, tmp_path / "first.onnx")
    with counted("build_endpoint") as calls, modules_run() as files:
        export_onnx(model, tmp_path / "model.onnx")
    assert len(calls) == 1
    run = {
        Path(f).resolve().relative_to(REPO).as_posix()
        for f in files
        if Path(f).resolve().is_relative_to(REPO)
    }
    export_code = sorted(f for f in run if f.startswith(EXPORT_CODE))
    # Neither another format's module nor ONNX's passes a float model
    # without fusion does not need.
    others = (
        "saved_model",
        "litert",
        "openvino",
        "torch",
        "onnx/fused",
        "onnx/integer",
    )
    assert not [
        f
        for f in export_code
        if f.startswith(tuple(f"keras_selfattn/export/formats/{o}" for o in others))
    ], export_code
    assert len(export_code) <= MOST_EXPORT_MODULES, export_code


@pytest.mark.slow  # a three-format decoding-step export: 18 s
def test_a_decoding_step_export_builds_its_step_once(tmp_path):
    model = model_zoo.decoder_language_model()
    with counted("build_decode_step") as calls:
        export_decode_step(model, tmp_path / "step.onnx", "onnx", max_length=8)
    assert len(calls) == 1


@pytest.mark.slow  # a SavedModel generator and its fresh-process check: 50 s
def test_a_generator_export_builds_its_generator_once(tmp_path):
    with counted("build_generator") as calls:
        export_generator(
            token_model(), tmp_path, "saved_model", max_length=8, name="lm"
        )
    assert len(calls) == 1
