"""Export and verify on every Keras backend, each run in its own process.

Each case starts a fresh interpreter with KERAS_BACKEND set, so the module
means the same under any backend of the suite and runs in one of them
(`one_suite`). Here: imports, the jax2tf SavedModel with warmup, the CLI on
JAX, and `verify` of TensorFlow's exports from the other backends. The
backend x format matrix and its refusals are in test_export_formats.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_selfattn  # noqa: F401  (registers SelfAttention)
from keras_selfattn.export import verify
from keras_selfattn.serving import read_warmup_file

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONSOLE = os.path.join(os.path.dirname(sys.executable), "keras-selfattn")
TIMEOUT = 300
WAY = "load it under KERAS_BACKEND=tensorflow and export there"

pytestmark = pytest.mark.one_suite("starts interpreters for fixed backends")


def _env(backend: str) -> dict[str, str]:
    return dict(
        os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=REPO
    )


def run_python(backend: str, code: str) -> subprocess.CompletedProcess:
    """Runs `code` in a fresh interpreter on `backend`; fails on a non-zero exit."""
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        cwd=REPO,
        env=_env(backend),
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return result


def run_cli(backend: str, *argv) -> subprocess.CompletedProcess:
    return subprocess.run(
        [CONSOLE, *map(str, argv)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        cwd=REPO,
        env=_env(backend),
    )


def error_line(result: subprocess.CompletedProcess) -> str:
    """The CLI's one error line (after TensorFlow's import-time log lines)."""
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    ours = [
        line
        for line in result.stderr.splitlines()
        if line.startswith("keras-selfattn:")
    ]
    assert ours == [result.stderr.strip().splitlines()[-1]], result.stderr
    return ours[0]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Model files saved under TensorFlow (a .keras file loads anywhere)."""
    root = tmp_path_factory.mktemp("backends")
    run_python(
        "tensorflow",
        f"""
        from tests import model_zoo
        model_zoo.masked_classifier(seed=0).save({str(root / "clf.keras")!r})
        model_zoo.attention_only(seed=0).save({str(root / "plain.keras")!r})
        model_zoo.attention_with_mask_input(seed=0).save(
            {str(root / "masked.keras")!r})
        """,
    )
    return root


# ------------------------------------------------------------------ imports
# PyTorch's interpreter imports torch (14 s): in the TensorFlow slow suite.
@pytest.mark.parametrize(
    "backend",
    [
        "jax",
        pytest.param(
            "torch",
            marks=[
                pytest.mark.slow,
                pytest.mark.one_suite(
                    "starts a torch interpreter", slow_suite="tensorflow"
                ),
            ],
        ),
    ],
)
def test_importing_the_package_adds_no_tensorflow(backend):
    """Only what Keras itself imports on the backend; the exporters, serving
    and CLI import TensorFlow, tf2onnx, onnx and gRPC on use."""
    heavy = ("tensorflow", "tf2onnx", "onnx", "grpc", "tensorflow_serving")
    result = run_python(
        backend,
        f"""
        import sys
        import keras
        heavy = {heavy!r}
        before = {{name for name in heavy if name in sys.modules}}
        import keras_selfattn, keras_selfattn.export, keras_selfattn.serving
        from keras_selfattn_cli import build_parser
        from keras_selfattn.serving import RestClient, served_model_names
        build_parser()
        print(sorted({{name for name in heavy if name in sys.modules}} - before))
        """,
    )
    assert result.stdout.strip() == "[]"


# --------------------------------------------------------------- SavedModel
@pytest.mark.slow
@pytest.mark.parametrize("model_file", ["plain.keras", "masked.keras"])
def test_jax_saved_model_export_is_checked_and_matches_keras(
    saved, tmp_path, model_file
):
    """jax2tf SavedModel with warmup records, checked against Keras on JAX,
    then verified again from this process and replayed through TensorFlow.

    `masked.keras` feeds a separate boolean mask input: the signature gives
    every time axis one symbol, so the layer sees mask and inputs agree.
    """
    path = saved / model_file
    result = run_python(
        "jax",
        f"""
        import keras, keras_selfattn
        from keras_selfattn.export import export_saved_model
        model = keras.models.load_model({str(path)!r})
        print(export_saved_model(model, {str(tmp_path)!r}, "m", warmup=True))
        """,
    )
    version_dir = result.stdout.strip().splitlines()[-1]
    assert version_dir == str(tmp_path / "m" / "1")
    assert (tmp_path / "models.config").is_file()
    model = keras.models.load_model(path)
    assert verify(model, version_dir).ok
    signature = tf.saved_model.load(version_dir).signatures["serving_default"]
    warmup = os.path.join(version_dir, "assets.extra", "tf_serving_warmup_requests")
    for request in read_warmup_file(warmup):
        inputs = {k: tf.make_ndarray(v) for k, v in request.inputs.items()}
        outputs = signature(**{k: tf.constant(v) for k, v in inputs.items()})
        arrays = [inputs[tensor.name] for tensor in model.inputs]
        expected = model(arrays if len(arrays) > 1 else arrays[0], training=False)
        np.testing.assert_allclose(
            next(iter(outputs.values())).numpy(),
            keras.ops.convert_to_numpy(expected),
            atol=1e-5,
        )


@pytest.mark.slow
def test_jax_cli_exports_a_saved_model_and_refuses_litert(saved, tmp_path):
    result = run_cli(
        "jax", "export", saved / "clf.keras", "--saved-model", tmp_path / "serving"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Verifying against Keras ... done" in result.stdout
    rows = [line.split() for line in result.stdout.splitlines() if line[:6] == "saved_"]
    assert len(rows) == 4 and all(row[-1] == "yes" for row in rows)
    assert (tmp_path / "serving" / "clf" / "1" / "saved_model.pb").is_file()

    before = sorted(os.listdir(tmp_path))
    result = run_cli(
        "jax",
        "export",
        saved / "clf.keras",
        "--saved-model",
        tmp_path / "serving",
        "--litert",
        tmp_path / "clf.tflite",
    )
    line = error_line(result)
    assert "LiteRT export does not run on the jax backend" in line and WAY in line
    assert result.stdout == ""  # refused before the model is even loaded
    assert sorted(os.listdir(tmp_path)) == before
    assert os.listdir(tmp_path / "serving" / "clf") == ["1"]


# ------------------------------------------------------------------ verify
@pytest.fixture(scope="module")
def tf_exports(saved):
    """A SavedModel and an ONNX file exported under TensorFlow."""
    result = run_cli(
        "tensorflow",
        "export",
        saved / "clf.keras",
        "--saved-model",
        saved / "serving",
        "--onnx",
        saved / "clf.onnx",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return saved / "serving" / "clf" / "1", saved / "clf.onnx"


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_verify_runs_on_every_backend(saved, tf_exports, backend):
    version_dir, onnx_file = tf_exports
    result = run_cli(
        backend,
        "verify",
        saved / "clf.keras",
        "--saved-model",
        version_dir,
        "--onnx",
        onnx_file,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [
        line.split()
        for line in result.stdout.splitlines()
        if line.startswith(("saved_model ", "onnx "))
    ]
    assert len(rows) == 8 and all(row[-1] == "yes" for row in rows)
