"""The benchmark code runs at a tiny size and writes complete tables.

No timing assertions: benchmarks are not tests. These tests check that the
benchmark runs end to end, that its JSON and Markdown are complete, that its
numbers are positive and finite, and that the two layers it compares compute
the same function. The CPU benchmark runs in this process (TensorFlow
suite only); `benchmarks.runtimes --quick` runs once, in its own
KERAS_BACKEND=tensorflow interpreter (one_suite).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from benchmarks import cases, cpu, report, runtimes, subprocesses, timing

ROOT = Path(__file__).resolve().parents[1]
tensorflow_only = pytest.mark.tensorflow_only(
    "the CPU benchmark runs tf.function, SavedModel and ONNX"
)
one_suite = pytest.mark.one_suite(
    "benchmarks.runtimes runs in its own KERAS_BACKEND=tensorflow interpreter"
)

# Keys every row of a section has (a value, or a "status" saying why not).
REQUIRED = {
    "forward": {
        "shape",
        "mask",
        "speedup_vs_mha",
        "gflops_ours",
        "gflops_mha",
        "gflops_matmul",
        "fraction_of_matmul",
        "max_abs_difference",
    },
    "training": {"shape", "speedup_vs_mha", "gflops_ours", "gflops_mha"},
    "exported": {
        "shape",
        "onnx_vs_saved_model",
        "fused_vs_onnx",
        "fused_vs_saved_model",
        "max_abs_difference",
    },
}


def _numbers(row: dict):
    for key, value in row.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            yield key, value


@pytest.fixture(scope="module")
def quick_results(tmp_path_factory):
    results = cpu.run(quick=True)
    out = tmp_path_factory.mktemp("bench")
    json_path, markdown_path = report.write(results, str(out))
    with open(json_path, encoding="utf-8") as handle:
        loaded = json.load(handle)
    with open(markdown_path, encoding="utf-8") as handle:
        markdown = handle.read()
    return loaded, markdown


@tensorflow_only
def test_every_section_has_complete_rows(quick_results):
    loaded, _ = quick_results
    assert set(loaded["sections"]) == set(report.SECTIONS)
    for name, rows in loaded["sections"].items():
        assert rows, name
        for row in rows:
            missing = REQUIRED.get(name, set()) - set(row)
            assert not missing, (name, missing)
            if name in ("memory", "long_sequences"):
                has_number = "peak_mib" in row or "speedup" in row
                assert has_number or "status" in row, row


@tensorflow_only
def test_numbers_are_positive_and_finite(quick_results):
    loaded, _ = quick_results
    for name, rows in loaded["sections"].items():
        for row in rows:
            for key, value in _numbers(row):
                assert math.isfinite(value), (name, key, value)
                if key == "max_abs_difference":
                    assert value >= 0, (name, key, value)
                else:
                    assert value > 0, (name, key, value)


@tensorflow_only
def test_compared_layers_compute_the_same_function(quick_results):
    loaded, _ = quick_results
    for row in loaded["sections"]["forward"]:
        assert row["max_abs_difference"] < 1e-4, row
    for row in loaded["sections"]["exported"]:
        assert row["max_abs_difference"] < 1e-4, row


@tensorflow_only
def test_markdown_has_machine_every_section_and_row(quick_results):
    loaded, markdown = quick_results
    machine = loaded["machine"]
    for key in ("cpu", "cores", "tensorflow", "keras", "onnxruntime", "date_utc"):
        assert machine[key], key
        assert str(machine[key]) in markdown, key
    for name, (title, _) in report.SECTIONS.items():
        section = markdown.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]
        table_lines = [line for line in section.splitlines() if line.startswith("|")]
        # header + separator + one line per row
        assert len(table_lines) == 2 + len(loaded["sections"][name]), name
    assert "## Targets" in markdown
    for target in loaded["targets"]:
        assert set(target) == {"target", "threshold", "value", "met"}
        assert target["target"] in markdown


def test_forward_flops_counts_every_matmul():
    # (B, T, F) = (1, 2, 3), 1 head, key_dim 4, output 5, counted by hand:
    # Q/K/V 3 * 2*2*3*4 = 144, Q K^T 2*2*2*4 = 32, weights x V 32, output
    # 2*2*4*5 = 80.
    shape = cases.Shape(1, 2, 3)
    config = cases.AttentionConfig(num_heads=1, key_dim=4, output_dim=5)
    assert cases.forward_flops(shape, config) == 144 + 32 + 32 + 80
    assert cases.training_flops(shape, config) == 3 * 288


@tensorflow_only
def test_cpu_layers_share_weights_and_compute_the_same_function():
    # The pair of benchmarks.cpu comes from pairs.build_layer; checked here
    # against numpy attention written out independently.
    shape = cases.Shape(2, 5, 6)
    config = cases.AttentionConfig(num_heads=2, key_dim=3, output_dim=4)
    ours, mha = cases.build_layers(shape, config)
    x = np.random.default_rng(3).normal(size=(2, 5, 6)).astype("float32")
    wq, bq, wk, bk, wv, bv, wo, bo = mha.get_weights()
    q = np.einsum("btd,dhk->bhtk", x, wq) + bq[None, :, None]
    k = np.einsum("btd,dhk->bhtk", x, wk) + bk[None, :, None]
    v = np.einsum("btd,dhk->bhtk", x, wv) + bv[None, :, None]
    scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(3)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    expected = np.einsum("bhtk,hko->bto", weights @ v, wo) + bo
    np.testing.assert_allclose(np.asarray(ours(x)), expected, atol=1e-5)
    np.testing.assert_allclose(np.asarray(mha(x, x)), expected, atol=1e-5)


def test_speedup_is_the_median_of_per_round_ratios():
    result = timing.Interleaved({"a": [2.0, 4.0, 6.0], "b": [1.0, 1.0, 3.0]})
    # per-round a / b = 2, 4, 2
    assert result.speedup("a", "b") == 2.0
    assert result.median("a") == 4.0
    spread = timing.Interleaved({"a": [2.0, 4.0, 6.0, 8.0], "b": [1.0] * 4})
    # exclusive quartiles of 2, 4, 6, 8
    assert spread.quartiles("a", "b") == (2.5, 7.5)


def test_interleave_alternates_the_order():
    calls = []
    timing.interleave(
        {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")},
        rounds=2,
        warmup=0,
        min_round_s=0.0,
    )
    # one calibration call each, then round 1 (a, b) and round 2 (b, a)
    assert calls == ["a", "b", "a", "b", "b", "a"]


def test_targets_compare_with_the_issue_thresholds():
    sections = {
        "forward": [
            {"shape": "(2, 1024, 256)", "mask": "none", "speedup_vs_mha": 1.3,
             "fraction_of_matmul": 0.5},
            {"shape": "(2, 1024, 256)", "mask": "padding", "speedup_vs_mha": 1.1},
        ],
        "exported": [
            {"shape": "(8, 512, 256)", "onnx_vs_saved_model": 1.6,
             "fused_vs_onnx": "not run: needs about 9.0 GiB"},
        ],
    }  # fmt: skip
    found = {t["target"]: t for t in report.targets(sections, ["(2, 1024, 256)"])}
    forward = "forward (2, 1024, 256) mask={}: SelfAttention vs MHA"
    assert found[forward.format("none")]["met"] is True
    assert found[forward.format("padding")]["met"] is False
    assert found[forward.format("causal")]["value"] is None
    fraction = found["forward (2, 1024, 256): fraction of the matmul GFLOP/s"]
    assert fraction["met"] is False
    assert found["export (8, 512, 256): onnxruntime vs SavedModel"]["met"] is True
    fused = found["export (8, 512, 256): fused ONNX vs unfused ONNX"]
    assert fused["met"] is None and fused["value"].startswith("not run")


@pytest.mark.slow
@tensorflow_only
def test_memory_probe_runs_in_a_fresh_process():
    spec = subprocesses.spec("self_attention", 1, 32, 16, 2, 8, 16)
    result = subprocesses.peak_memory(spec)
    assert result["peak_mib"] >= result["baseline_mib"] > 0
    assert result["seconds"] > 0


@pytest.fixture(scope="module")
def runtimes_results(tmp_path_factory):
    """`python -m benchmarks.runtimes --quick` in a fresh TensorFlow interpreter."""
    out = tmp_path_factory.mktemp("runtimes")
    command = [
        sys.executable,
        "-m",
        "benchmarks.runtimes",
        "--quick",
        "--out",
        str(out),
    ]
    done = subprocess.run(
        command,
        cwd=ROOT,
        env={**os.environ, "KERAS_BACKEND": "tensorflow"},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    with open(out / "runtimes.json", encoding="utf-8") as handle:
        loaded = json.load(handle)
    markdown = (out / "runtimes.md").read_text(encoding="utf-8")
    assert markdown in done.stdout  # the table printed is the table written
    return loaded, markdown


@one_suite
def test_runtimes_time_every_runtime_at_every_shape(runtimes_results):
    loaded, markdown = runtimes_results
    expected = {"keras_predict", "keras_call", "saved_model", *runtimes.NEEDS}
    shapes = {f"({b}, {t})" for b, t in runtimes.QUICK.shapes}
    seen = {(row["shape"], row["runtime"]) for row in loaded["rows"]}
    assert seen == {(shape, name) for shape in shapes for name in expected}
    for row in loaded["rows"]:
        if "status" in row:  # a runtime that is not installed
            assert row["status"].startswith("not installed: pip install"), row
            continue
        for key in ("ms", "vs_saved_model", "vs_predict", "vs_call"):
            assert math.isfinite(row[key]) and row[key] > 0, row
        assert f"| {row['shape']} | {row['runtime']} |" in markdown
    machine = loaded["machine"]
    for key in ("cpu", "load_average_1_5_15min", "tensorflow", "keras",
                "onnxruntime", "ai_edge_litert", "openvino", "git_commit"):  # fmt: skip
        assert str(machine[key]) in markdown, key
    assert machine["cpu"] and machine["load_average_1_5_15min"]


@one_suite
def test_runtimes_agree_with_keras(runtimes_results):
    loaded, _ = runtimes_results
    for row in loaded["rows"]:
        if "status" in row:
            continue
        # OpenVINO's default may compute in bf16; every other runtime is f32.
        bound = 5e-2 if row["runtime"] == "openvino_default" else 1e-4
        assert 0 <= row["max_abs_error"] < bound, row


def test_runtimes_tokens_are_right_padded():
    ids = runtimes.tokens(3, 10)
    lengths = (ids != 0).sum(axis=1)
    assert lengths.tolist() == [5, 7, 10]
    for row, length in zip(ids, lengths, strict=True):
        assert (row[:length] > 0).all() and (row[length:] == 0).all()
