"""Keras's own `model.export` of SelfAttention models: backend x format.

For each backend one interpreter (KERAS_BACKEND set) builds small seeded
models, saves their `predict` outputs and exports every format Keras 3
offers (`tf_saved_model`, `onnx`, `openvino`, `litert`, `torch`), with
dynamic batch and time except where Keras requires fixed shapes (LiteRT from
PyTorch); then one fresh interpreter per runtime (onnxruntime, OpenVINO at
f32, LiteRT, `torch.export.load`, `tf.saved_model.load`), in which keras and
keras_selfattn cannot be imported, runs every artifact of its format and
compares it with `predict` at four shapes (T=5 to 33), token rows padded at
the end and at the start: the issue's two models and one with every feature
of both (on PyTorch also with `flash_attention=False`). The whole matrix
runs once per module (tests/_keras_export_worker.py does the work).

It is in the slow suite: the fast one exports every one of these cells with
the package's own pipeline (tests/test_export_formats.py), which calls this
same `model.export` and checks the artifact in its runtime.

Cells where Keras itself cannot export are checked as refusals, with
Keras's own error.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.one_suite(
        "exports from every backend in interpreters of its own", slow_suite="jax"
    ),
    pytest.mark.slow,
]

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "_keras_export_worker.py"
BACKENDS = ("tensorflow", "jax", "torch")
FORMATS = ("tf_saved_model", "onnx", "openvino", "litert", "torch")
RUNTIMES = ("onnxruntime", "openvino", "litert", "torch", "tensorflow")
TOLERANCE = 1e-4  # max abs error, float32

# Cells Keras refuses (for keras.layers.MultiHeadAttention too), and the text
# of its error.
REFUSALS = {
    ("tensorflow", "torch"): ("Torch export requires PyTorch backend",),
    ("jax", "torch"): ("Torch export requires PyTorch backend",),
    ("jax", "litert"): ("LiteRT export requires TensorFlow or PyTorch backend",),
    # jax2tf's graph keeps an XlaCallModule op, which OpenVINO cannot convert.
    ("jax", "openvino"): ("No conversion rule found for operations: XlaCallModule",),
    # Keras's torch SavedModel export goes through torch_xla; before it gets
    # there, Keras 3.15.1 passes torch.export dynamic shapes that do not
    # match its inputs.
    ("torch", "tf_saved_model"): (
        "between the structure of `inputs` and `dynamic_shapes`",
        "torch_xla",
    ),
}
# What each cell needs installed beyond the backend itself.
NEEDS = {
    "onnx": ("onnx", "onnxruntime"),
    "openvino": ("openvino",),
    "litert": ("ai_edge_litert",),
    "tf_saved_model": ("tensorflow",),
    "torch": ("torch",),
}
NEEDS_ON = {
    ("tensorflow", "onnx"): ("tf2onnx",),
    ("jax", "onnx"): ("jax2onnx",),
    ("jax", "tf_saved_model"): ("tensorflow",),
    ("torch", "onnx"): ("onnxscript",),
    ("torch", "litert"): ("litert_torch", "tensorflow"),
}
CELLS = [(backend, fmt) for backend in BACKENDS for fmt in FORMATS]


def _missing(backend: str, fmt: str) -> list[str]:
    needs = (backend,) + NEEDS[fmt] + NEEDS_ON.get((backend, fmt), ())
    return [name for name in needs if importlib.util.find_spec(name) is None]


def _run_all(commands: list[tuple[list[str], dict, Path]], timeout: int) -> None:
    """Runs the commands at once; raises with the log of any that failed."""
    running = []
    for argv, env, log in commands:
        with open(log, "w") as out:
            running.append(
                (
                    subprocess.Popen(
                        argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT
                    ),
                    log,
                )
            )
    failed = []
    for process, log in running:
        try:
            code = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            code = "timeout"
        if code != 0:
            failed.append(f"{log.name} ({code}):\n{log.read_text()[-3000:]}")
    if failed:
        raise AssertionError("\n\n".join(failed))


def _matrix(out: Path, timeout: int) -> dict:
    """(backend, format) -> list of cells, each with its runtime's result."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    exports = [
        (
            [sys.executable, str(WORKER), "export", str(out)],
            dict(env, KERAS_BACKEND=backend),
            out / f"export_{backend}.log",
        )
        for backend in BACKENDS
        if importlib.util.find_spec(backend) is not None
    ]
    _run_all(exports, timeout)
    checks = [
        (
            [sys.executable, str(WORKER), "check", runtime, str(out)],
            env,
            out / f"check_{runtime}.log",
        )
        for runtime in RUNTIMES
    ]
    _run_all(checks, timeout)
    results, imported = {}, {}
    for runtime in RUNTIMES:
        report = json.loads((out / f"check_{runtime}.json").read_text())
        imported[runtime] = report["imported"]
        for result in report["results"]:
            results[_key(result)] = result
    matrix = {"imported": imported}
    for manifest in out.glob("*/manifest.json"):
        for cell in json.loads(manifest.read_text()):
            cell["result"] = results.get(_key(cell))
            matrix.setdefault((cell["backend"], cell["format"]), []).append(cell)
    return matrix


def _key(cell: dict) -> tuple:
    fixed = cell["fixed_shape"]
    return (
        cell["backend"],
        cell["format"],
        cell["model"],
        None if fixed is None else tuple(fixed),
    )


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    return _matrix(tmp_path_factory.mktemp("keras_export"), timeout=1500)


def _check_cell(matrix: dict, backend: str, fmt: str) -> None:
    missing = _missing(backend, fmt)
    if missing:
        pytest.skip(f"not installed: {', '.join(missing)}")
    cells = matrix[(backend, fmt)]
    assert cells
    for cell in cells:
        what = f"{backend} -> {fmt}, model {cell['model']}"
        if (backend, fmt) in REFUSALS:
            assert cell["status"] == "refused", f"{what}: Keras exported it now"
            assert any(text in cell["error"] for text in REFUSALS[(backend, fmt)]), (
                f"{what}: {cell['error']}"
            )
            continue
        assert cell["status"] == "exported", f"{what}: {cell.get('traceback')}"
        result = cell["result"]
        assert result is not None, f"{what}: no runtime result"
        assert "failure" not in result, f"{what}: {result['failure']}"
        expected = {"2x7", "2x33"}
        if cell["fixed_shape"] is not None:
            expected = {"{}x{}".format(*cell["fixed_shape"])}
        assert expected <= set(result["errors"]), f"{what}: {result['errors']}"
        for shape, error in result["errors"].items():
            assert isinstance(error, float), f"{what} at {shape}: {error}"
            assert error <= TOLERANCE, f"{what} at {shape}: max error {error}"


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_runtimes_run_without_keras(matrix, runtime):
    """The runtimes never imported keras or keras_selfattn."""
    assert matrix["imported"][runtime] == []


@pytest.mark.parametrize("backend,fmt", CELLS, ids=[f"{b}-{f}" for b, f in CELLS])
def test_keras_export_cell(matrix, backend, fmt):
    """Every artifact Keras writes computes `predict`'s numbers at four
    shapes, batch 1 to 3 (dynamic shapes; LiteRT from PyTorch at T=7 and
    T=33, fixed) in its own runtime; Keras's refusals are its own."""
    _check_cell(matrix, backend, fmt)
