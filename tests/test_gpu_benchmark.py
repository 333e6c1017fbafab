"""`python -m benchmarks.backends` runs end to end on the
current backend, tiny shapes.

The suite runs under each Keras backend, so this runs the GPU benchmark on
CPU with the `tiny` rows but the RSS one (every mask, both dtype policies, the
training step) once per backend, in a fresh interpreter; the peak-RSS child
processes run once, in one suite.
No timing is asserted: benchmarks are not tests. On JAX and torch that
interpreter has TensorFlow blocked (`import tensorflow` fails, as on a
machine with only keras + jax or keras + torch), and no TensorFlow module may
be loaded.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import keras
import numpy as np
import pytest

import benchmarks
from benchmarks import backends, pairs, probe, subprocesses

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BACKEND = keras.backend.backend()
MARKER = "TENSORFLOW_MODULES="
# Runs benchmarks.backends as __main__. With "block", sys.modules["tensorflow"] is
# None: `import tensorflow` raises ModuleNotFoundError and
# importlib.util.find_spec("tensorflow") returns None, as when it is not
# installed. Prints the TensorFlow modules loaded at the end.
RUNNER = textwrap.dedent(
    f"""
    import json, runpy, sys

    if sys.argv[1] == "block":
        sys.modules["tensorflow"] = None
    sys.argv = ["benchmarks.backends", *sys.argv[2:]]
    try:
        runpy.run_module("benchmarks.backends", run_name="__main__", alter_sys=True)
    finally:
        loaded = [
            name
            for name, module in list(sys.modules.items())
            if name.split(".")[0] == "tensorflow" and module is not None
        ]
        print({MARKER!r} + json.dumps(sorted(loaded)))
    """
)


# The tiny rows the per-backend run times (the RSS row runs once, below).
TIMED = [row for row in pairs.TINY_ROWS if not row.rss]


def _expected_rows() -> set[tuple[str, str]]:
    return {
        (row.name, dtype)
        for row in TIMED
        for dtype in pairs.DTYPES
        if row.dtypes is None or dtype in row.dtypes
    }


# One tiny run per backend: PyTorch's in `make test` (the GPU machine has
# keras, JAX and PyTorch, no TensorFlow; JAX's run compiles every shape: 16 s
# on 2 shared AVX2 cores), TensorFlow's and JAX's in `make test-slow`.
ON_TORCH_IN_MAKE_TEST = pytest.mark.slow_on(
    "tensorflow", "jax", "the backends benchmark's tiny run"
)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """(completed process, loaded JSON) of one tiny run on this backend."""
    path = tmp_path_factory.mktemp("gpu") / "gpu.json"
    mode = "allow" if BACKEND == "tensorflow" else "block"
    args = ["--shapes", *(row.name for row in TIMED), "--repeats", "1"]
    args += ["--min-round-s", "0", "--json", str(path)]
    completed = subprocess.run(
        [sys.executable, "-c", RUNNER, mode, *args],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        cwd=REPO,
        env={**os.environ, "KERAS_BACKEND": BACKEND},
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    with open(path, encoding="utf-8") as handle:
        return completed, json.load(handle)


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


@ON_TORCH_IN_MAKE_TEST
def test_every_row_is_in_the_json_and_the_table(smoke):
    completed, results = smoke
    assert results["machine"]["backend"] == BACKEND
    assert results["machine"]["device"]
    found = {(row["name"], row["dtype"]) for row in results["rows"]}
    assert found == _expected_rows()
    table = [line for line in completed.stdout.splitlines() if line.startswith("| ")]
    assert table[0].startswith("| backend | device | dtype | row | SA fwd ms")
    for row in results["rows"]:
        assert any(f"| {row['dtype']} | {row['label']} |" in line for line in table)
    assert len(table) == 1 + len(results["rows"])


@ON_TORCH_IN_MAKE_TEST
def test_times_ratios_and_flops_are_finite_and_positive(smoke):
    _, results = smoke
    for row in results["rows"]:
        assert not row.get("status") and not row["errors"], row
        modes = ("forward", "train") if row["train"] else ("forward",)
        for mode in modes:
            for layer in ("sa", "mha"):
                assert _positive(row[f"{layer}_{mode}_ms"]), (row["name"], mode)
                assert _positive(row[f"{layer}_{mode}_tflops"]), (row["name"], mode)
            assert _positive(row[f"{mode}_ratio"]), (row["name"], mode)
        if not row["train"]:
            assert "sa_train_ms" not in row


@pytest.mark.slow
@pytest.mark.one_suite("two child interpreters on a fixed backend (jax)")
def test_peak_rss_comes_from_child_processes(monkeypatch):
    # The children read KERAS_BACKEND; jax: no TensorFlow needed there.
    monkeypatch.setenv("KERAS_BACKEND", "jax")
    (row,) = [row for row in pairs.TINY_ROWS if row.rss]
    result = probe.peak_rss(row.to_dict(), "float32", "auto", runs=1)
    for layer in ("self_attention", "mha"):
        measured = result[layer]
        assert measured["peak_mib"] >= measured["baseline_mib"] > 0, measured
        assert measured["peak_mib_runs"] == [measured["peak_mib"]]


@ON_TORCH_IN_MAKE_TEST
def test_the_two_layers_compute_the_same_function(smoke):
    _, results = smoke
    checks = results["checks"]
    assert sorted(c["mask"] for c in checks) == sorted(pairs.MASKS)
    for check in checks:
        assert check["passed"], check
        assert check["max_abs_difference"] < 1e-4, check


@pytest.mark.skipif(BACKEND == "tensorflow", reason="TensorFlow is the backend")
@ON_TORCH_IN_MAKE_TEST
def test_no_tensorflow_module_is_imported(smoke):
    completed, _ = smoke
    line = [x for x in completed.stdout.splitlines() if x.startswith(MARKER)][-1]
    assert json.loads(line[len(MARKER) :]) == []


def test_forward_flops_by_hand():
    # B1, T4, D8, H2, K3: projections 4 * 2*1*4*8*2*3 = 1536; attention
    # 4*1*2*16*3 = 384, causal counted in full too (one convention).
    row = pairs.Row("r", 1, 4, features=8, num_heads=2, key_dim=3)
    assert pairs.forward_flops(row) == 1536 + 384
    causal = pairs.Row("r", 1, 4, features=8, num_heads=2, key_dim=3, mask="causal")
    assert pairs.forward_flops(causal) == 1536 + 384
    assert pairs.train_flops(row) == 3 * (1536 + 384)
    # output projection to 5 instead of 8: 3 * 384 + 2*1*4*2*3*5 = 1392
    narrow = pairs.Row("r", 1, 4, features=8, num_heads=2, key_dim=3, output_dim=5)
    assert pairs.forward_flops(narrow) == 1392 + 384


def test_mha_weights_map_to_self_attention_columns_per_head():
    row = pairs.Row("r", 1, 4, features=5, num_heads=2, key_dim=3)
    mha = pairs.mha_weights(row)
    sa = pairs.to_self_attention(mha, row)
    assert [w.shape for w in sa] == [(5, 6), (6,)] * 3 + [(6, 5), (5,)]
    # head h of the query kernel: columns [h*K:(h+1)*K]
    np.testing.assert_array_equal(sa[0][:, 3:6], mha[0][:, 1, :])
    np.testing.assert_array_equal(sa[1][3:6], mha[1][1])
    # output kernel: rows [h*K:(h+1)*K] read head h
    np.testing.assert_array_equal(sa[6][3:6], mha[6][1])


def test_shapes_accept_rows_and_groups_only():
    names = [row.name for row in pairs.select_rows(["tiny", "tiny-none"])]
    assert names == [row.name for row in pairs.TINY_ROWS]
    assert len(pairs.select_rows(["gpu"])) == 5
    with pytest.raises(ValueError, match="Unknown shape"):
        pairs.select_rows(["b9-t1"])


def test_flash_is_passed_to_both_layers_unless_auto():
    row = pairs.TINY_ROWS[0]
    for flash in pairs.FLASH:
        layer = pairs.build_layer(pairs.SA, row, "float32", flash=flash)
        assert layer.built
    assert pairs.flash_kwargs("auto") == {}
    assert pairs.flash_kwargs("on") == {"flash_attention": True}
    assert pairs.flash_kwargs("off") == {"flash_attention": False}
    with pytest.raises(ValueError, match="flash must be one of"):
        pairs.flash_kwargs("yes")


# ------------------------------------------------------------- memory estimate
GIB = 2**30


def test_both_callers_give_the_one_estimate():
    # (B, H, T) = (2, 4, 1024): a (B, H, T, T) float32 tensor is 32 MiB; the
    # estimate is 3.25 of them for a forward pass, 8.5 for a training step,
    # and per block of 256 queries (B, H, 256, T) when chunked.
    copy = 2 * 4 * 1024 * 1024 * 4
    forward_row = pairs.Row("r", 2, 1024, num_heads=4, train=False)
    train_row = pairs.Row("r", 2, 1024, num_heads=4, train=True)
    spec = subprocesses.spec("mha", 2, 1024, 256, 4, 64, None)
    chunked = subprocesses.spec(
        "self_attention", 2, 1024, 256, 4, 64, None, chunk_size=256
    )
    assert backends.estimate(forward_row) == subprocesses.estimate(spec)
    assert subprocesses.estimate(spec) == int(3.25 * copy)
    assert backends.estimate(train_row) == int(8.5 * copy)
    assert subprocesses.estimate(chunked) == int(3.25 * copy / 4)
    # A chunk longer than the sequence is the whole sequence.
    longer = subprocesses.spec(
        "self_attention", 2, 1024, 256, 4, 64, None, chunk_size=4096
    )
    assert subprocesses.estimate(longer) == subprocesses.estimate(spec)


def test_the_estimate_has_one_home(monkeypatch):
    calls = []

    def recorded(*args, **kwargs):
        calls.append((args, kwargs))
        return 123

    monkeypatch.setattr(pairs, "estimated_bytes", recorded)
    row = pairs.Row("r", 3, 64, num_heads=2, train=True)
    spec = subprocesses.spec("self_attention", 3, 64, 32, 2, 16, None, chunk_size=8)
    assert backends.estimate(row) == 123 == subprocesses.estimate(spec)
    assert calls == [
        ((3, 64, 2), {"train": True}),
        ((3, 64, 2), {"chunk_size": 8}),
    ]
    # No other benchmark module has an estimator of its own.
    folder = Path(benchmarks.__file__).parent
    defining = [
        path.name
        for path in sorted(folder.glob("*.py"))
        if "def estimated_bytes" in path.read_text(encoding="utf-8")
    ]
    assert defining == ["pairs.py"]


class _Machine:
    """A backend stand-in: only whether it is a GPU matters here."""

    def __init__(self, gpu: bool):
        self._gpu = gpu

    def is_gpu(self) -> bool:
        return self._gpu


def test_cases_that_would_not_fit_are_not_started(monkeypatch):
    # 4 GiB available; the margin is 1.5 GiB. (1, 4, 8192): 1 GiB a copy.
    monkeypatch.setattr(subprocesses, "available_bytes", lambda: 4 * GIB)

    def no_child(*args, **kwargs):
        raise AssertionError("a case that does not fit was started")

    monkeypatch.setattr(probe, "run_child", no_child)
    monkeypatch.setattr(probe, "run", no_child)
    big = pairs.Row("big", 1, 8192, num_heads=4, train=False)  # 3.25 GiB
    assert backends._too_big(_Machine(gpu=False), big) == (
        "not run: needs about 4.8 GiB, 4.0 GiB available"
    )
    assert backends._too_big(_Machine(gpu=True), big) is None  # host memory only
    small = pairs.Row("small", 1, 4096, num_heads=4, train=False)  # 0.8 GiB
    assert backends._too_big(_Machine(gpu=False), small) is None
    spec = subprocesses.spec("self_attention", 1, 8192, 64, 4, 16, None)
    assert subprocesses.peak_memory(spec) == {
        "status": "not run: needs about 4.8 GiB, 4.0 GiB available"
    }
    chunked = subprocesses.spec(
        "self_attention", 1, 8192, 64, 4, 16, None, chunk_size=512
    )
    assert subprocesses.refusal(subprocesses.estimate(chunked)) is None
    assert subprocesses.speed(chunked, spec, rounds=1)["status"].startswith("not run")
