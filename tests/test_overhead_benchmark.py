"""`python -m benchmarks.overhead --quick` runs on every backend and writes
complete tables: no timing assertion (benchmarks are not tests), but the
two layers it times must compute the same function (MultiHeadAttention is
the independent reference)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.one_suite("benchmarks.overhead starts one interpreter per backend")
def test_overhead_benchmark_quick(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.overhead", "--quick", "--rounds", "5"]
        + ["--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads((tmp_path / "overhead.json").read_text())
    rows = results["rows"]
    assert [(row["backend"], row["case"]) for row in rows] == [
        (backend, case)
        for backend in ("tensorflow", "jax", "torch")
        for case in ("unpadded", "padded")
    ]
    for row in rows:
        assert row["us_self_attention"] > 0 and row["us_mha"] > 0
        assert math.isfinite(row["ratio"]) and row["ratio"] > 0
        assert row["max_abs_difference"] < 1e-5, row
    markdown = (tmp_path / "overhead.md").read_text()
    assert "| torch | padded |" in markdown and "CPU:" in markdown
