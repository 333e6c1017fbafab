"""SelfAttention under tf.distribute: MirroredStrategy and MultiWorkerMirrored.

The distributed runs happen in subprocesses (tests/_distributed_worker.py):
two logical CPU devices must be configured before TensorFlow initializes,
and a multi-worker cluster needs one process per worker. The reference is
the same model, initial weights, data order and SGD steps on one device, in
this process. Both runs use the same global batch, so the synchronous
gradient all-reduce must give the single-device weights up to float32
rounding (measured max difference about 3e-8; tolerance 1e-6).

Every subprocess has a timeout and runs in its own process group, which is
killed on timeout or failure, so nothing outlives the test.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import keras
import numpy as np
import pytest

import keras_selfattn
from keras_selfattn.export import export_saved_model, verify
from tests import _distributed_worker as worker

pytestmark = pytest.mark.tensorflow_only("tf.distribute strategies")

WORKER = str(Path(worker.__file__).resolve())
ROOT = str(Path(keras_selfattn.__file__).resolve().parents[1])
ATOL = 1e-6
TIMEOUT = 240  # seconds per subprocess; normal runs take 15-60 s


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", KERAS_BACKEND="tensorflow")
    env.pop("TF_CONFIG", None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def _start(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    with open(log, "wb") as out:
        return subprocess.Popen(
            [sys.executable, WORKER, *args],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # own process group, killed as a whole
        )


def _kill(process: subprocess.Popen) -> None:
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    process.wait()


@contextlib.contextmanager
def _processes():
    started: list[subprocess.Popen] = []
    try:
        yield started
    finally:
        for process in started:
            _kill(process)


def _wait_all(processes, logs, timeout: float) -> None:
    """Waits for every process to exit 0; fails as soon as one does not."""
    deadline = time.monotonic() + timeout
    while any(process.poll() is None for process in processes):
        for process, log in zip(processes, logs, strict=True):
            code = process.poll()
            if code not in (None, 0):  # the others would wait for it forever
                pytest.fail(f"worker exited with {code}; log:\n{_tail(log)}")
        if time.monotonic() > deadline:
            pytest.fail(f"workers timed out after {timeout} s:\n{_tail(logs[0])}")
        time.sleep(0.2)
    for process, log in zip(processes, logs, strict=True):
        assert process.returncode == 0, f"worker failed; log:\n{_tail(log)}"


def _tail(log: Path) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-30:])


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _load_weights(path: Path) -> list[np.ndarray]:
    with np.load(path) as data:
        return [data[f"w{i}"] for i in range(len(data.files))]


@pytest.fixture(scope="module")
def single_device():
    """(initial weights, weights after training on one device)."""
    model = worker.build_model()
    initial = [np.asarray(w) for w in model.get_weights()]
    return initial, worker.train(model)


def _assert_same_training(weights, single_device) -> None:
    initial, expected = single_device
    assert len(weights) == len(expected)
    for got, want in zip(weights, expected, strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=ATOL)
    # The steps really moved the weights, far beyond the tolerance.
    moved = max(np.abs(w - i).max() for w, i in zip(expected, initial, strict=True))
    assert moved > 1000 * ATOL


@pytest.mark.slow  # a second interpreter with two logical devices
def test_mirrored_two_devices_matches_single_device(tmp_path, single_device):
    out, log = tmp_path / "mirrored.npz", tmp_path / "mirrored.log"
    with _processes() as started:
        started.append(_start(["mirrored", str(out)], _env(), log))
        _wait_all(started, [log], TIMEOUT)
    _assert_same_training(_load_weights(out), single_device)


@pytest.mark.slow
def test_multiworker_trains_saves_exports_and_verifies(tmp_path, single_device):
    ports = _free_ports(2)
    cluster = {"worker": [f"127.0.0.1:{port}" for port in ports]}
    logs = [tmp_path / f"worker{index}.log" for index in range(2)]
    with _processes() as started:
        for index in range(2):
            config = {"cluster": cluster, "task": {"type": "worker", "index": index}}
            env = _env(TF_CONFIG=json.dumps(config))
            started.append(_start(["multiworker", str(tmp_path)], env, logs[index]))
        _wait_all(started, logs, TIMEOUT)

    chief = _load_weights(tmp_path / "weights_0.npz")
    other = _load_weights(tmp_path / "weights_1.npz")
    for a, b in zip(chief, other, strict=True):
        np.testing.assert_array_equal(a, b)  # the workers stayed in sync
    _assert_same_training(chief, single_device)

    model = keras.models.load_model(tmp_path / "model.keras", safe_mode=True)
    for saved, trained in zip(model.get_weights(), chief, strict=True):
        np.testing.assert_array_equal(saved, trained)
    version_dir = export_saved_model(model, tmp_path / "serving", "mwms")
    report = verify(model, saved_model_dir=version_dir)
    assert report.ok and len(report.rows) >= 4, str(report)
