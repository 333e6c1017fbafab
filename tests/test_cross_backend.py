"""examples/cross_backend.py: trained on JAX or PyTorch, exported under TensorFlow.

The example runs as a driver in a fresh interpreter for each training
backend (JAX and PyTorch, in the TensorFlow slow suite, with its refusals:
several interpreters each); the driver starts its train stage with
`KERAS_BACKEND=jax` or `torch` and its export stage with
`KERAS_BACKEND=tensorflow`, each in its own process. Beyond the example's
own checks (which make it exit non-zero), this test reads what it wrote:
the .npz records which backend trained the model, and here the .keras file,
the SavedModel (through TensorFlow's loader) and the ONNX file (in
onnxruntime) are checked against the predictions the training backend made.

The example starts its own backend processes whatever the suite's backend,
so the test runs in one suite (`one_suite`); the .keras file is loaded in
that suite's process, whatever its backend.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

# Every test starts interpreters (the drivers: a training and an export
# interpreter each, the exports checked in fresh processes; the refusals:
# 6-12 s each): the TensorFlow slow suite, which CI runs.
pytestmark = [
    pytest.mark.one_suite(
        "spawns its own jax, torch and tensorflow processes", slow_suite="tensorflow"
    ),
    pytest.mark.slow,
]

SCRIPT = Path(__file__).resolve().parent.parent / "examples" / "cross_backend.py"
TRAIN_BACKENDS = ("jax", "torch")
ATOL = 1e-5
TIMEOUT = 600


def run_script(out: Path, *args: str, backend: str | None = None):
    """Runs the example with `--out out`; KERAS_BACKEND unset unless given."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("KERAS_BACKEND", None)
    if backend is not None:
        env["KERAS_BACKEND"] = backend
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args, "--out", str(out)],
        capture_output=True,
        text=True,
        cwd=out.parent,
        env=env,
        timeout=TIMEOUT,
    )


def drive(out: Path, train_backend: str) -> tuple[Path, str]:
    """(out, stdout) of the fast driver run; fails on a non-zero exit."""
    out.mkdir(parents=True)
    result = run_script(out, "--train-backend", train_backend, "--fast")
    assert result.returncode == 0, (
        f"cross_backend --train-backend {train_backend} exited "
        f"{result.returncode}\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    )
    return out, result.stdout


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Callable[[str], tuple[Path, str]]:
    """runs(train backend) -> (out folder, driver stdout), run once each."""
    root = tmp_path_factory.mktemp("cross_backend")

    @functools.cache
    def run(backend: str) -> tuple[Path, str]:
        return drive(root / backend / "artifacts", backend)

    return run


def saved_arrays(out: Path, backend: str) -> dict[str, np.ndarray]:
    with np.load(out / f"cross_backend_{backend}.npz") as saved:
        return {key: saved[key] for key in saved.files}


@pytest.mark.parametrize("backend", TRAIN_BACKENDS)
def test_driver_runs_each_stage_under_its_backend(runs, backend):
    out, stdout = runs(backend)
    train_step = stdout.index(f"step 1/2, train: KERAS_BACKEND={backend} ")
    export_step = stdout.index("step 2/2, export: KERAS_BACKEND=tensorflow ")
    trained = re.search(rf"stage 1: training under Keras 3\.\S+ on {backend}\n", stdout)
    assert trained and train_step < trained.start() < export_step
    assert "loading under Keras 3." in stdout[export_step:]
    assert str(saved_arrays(out, backend)["backend"]) == backend
    assert f"trained on {backend}, exported and verified on tensorflow: ok" in stdout


@pytest.mark.parametrize("backend", TRAIN_BACKENDS)
def test_printed_checks_within_tolerance(runs, backend):
    _, stdout = runs(backend)
    assert re.search(r"11 weights, bit-identical: embed/embeddings, attention/", stdout)
    diffs = re.findall(
        r"^  (.+): max abs diff (\S+) \(tolerance 1e-05\)$", stdout, re.M
    )
    assert sorted(what for what, _ in diffs) == sorted(
        [
            f"predictions, tensorflow vs {backend}",
            f"attention outputs, tensorflow vs {backend}",
            f"saved_model vs {backend}",
            f"onnx vs {backend}",
        ]
    )
    assert all(float(diff) <= ATOL for _, diff in diffs)
    assert (
        f"padded positions: max |.| = 0 on {backend}, max |.| = 0 on tensorflow"
        in stdout
    )
    rows = re.findall(
        r"^(saved_model|onnx)\s+(\d+x\d+)[ a-z]*\s+\S+\s+\S+\s+(\S+)$", stdout, re.M
    )
    assert len(rows) == 8 and {ok for *_, ok in rows} == {"yes"}


@pytest.mark.parametrize("backend", TRAIN_BACKENDS)
def test_keras_file_loads_here_with_the_trained_weights(runs, backend):
    """Loaded in this process (the one suite's backend) with only `import
    keras_selfattn`."""
    import keras

    import keras_selfattn  # noqa: F401  (registers SelfAttention)

    out, _ = runs(backend)
    saved = saved_arrays(out, backend)
    model = keras.models.load_model(out / f"cross_backend_{backend}.keras")
    assert [w.path for w in model.weights] == saved["weight_paths"].tolist()
    for i, weight in enumerate(model.weights):
        np.testing.assert_array_equal(
            keras.ops.convert_to_numpy(weight.value), saved[f"weight_{i}"]
        )
    tokens = saved["tokens"]
    assert (tokens == 0).any() and (tokens[:, 0] != 0).all()  # padded, not empty
    np.testing.assert_allclose(
        model.predict(tokens, verbose=0), saved["predictions"], rtol=0, atol=ATOL
    )
    attention = saved["attention_output"]
    assert np.all(attention[tokens == 0] == 0.0)
    assert np.all(np.abs(attention[tokens != 0]).sum(axis=-1) > 0.0)


@pytest.mark.parametrize("backend", TRAIN_BACKENDS)
def test_exports_reproduce_the_training_backend(runs, backend):
    """SavedModel and ONNX, run by their own runtimes, match JAX/torch."""
    import onnxruntime
    import tensorflow as tf

    out, _ = runs(backend)
    saved = saved_arrays(out, backend)
    tokens, expected = saved["tokens"], saved["predictions"]
    (version,) = (out / "serving" / f"cross_backend_{backend}").iterdir()
    assert version.name == "1"
    signature = tf.saved_model.load(str(version)).signatures["serving_default"]
    (served,) = signature(tokens=tf.constant(tokens)).values()
    np.testing.assert_allclose(served.numpy(), expected, rtol=0, atol=ATOL)
    onnx_file = out / f"cross_backend_{backend}.onnx"
    session = onnxruntime.InferenceSession(str(onnx_file))
    (got,) = session.run(None, {"tokens": tokens})
    np.testing.assert_allclose(got, expected, rtol=0, atol=ATOL)
    # Nothing hidden (temporary files or export folders) is left behind.
    assert not [p for p in out.rglob(".*")]


@pytest.mark.parametrize(
    ("stage", "process_backend", "message"),
    [
        (
            "train",
            "tensorflow",
            "needs KERAS_BACKEND=jax, but this process runs Keras on 'tensorflow'",
        ),
        (
            "export",
            "jax",
            "needs KERAS_BACKEND=tensorflow, but this process runs Keras on 'jax'",
        ),
    ],
    ids=["train-under-tensorflow", "export-under-jax"],
)
def test_stage_refuses_the_wrong_backend(tmp_path, stage, process_backend, message):
    out = tmp_path / "artifacts"
    result = run_script(
        out, "--stage", stage, "--train-backend", "jax", backend=process_backend
    )
    assert result.returncode == 1
    assert message in result.stderr
    assert not list(out.iterdir())
