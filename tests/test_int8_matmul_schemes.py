"""The int8 matmul schemes of `benchmarks.int8_matmul` against numpy's
integer products: uint8 x uint8 (the default ONNX file's matmul where its
probe finds uint8 x int8 inexact), the split (uint8 x int8, K doubled) and
int8 x int8 are exact on every CPU; uint8 x int8 (Keras's integers + 128
times W) only where the CPU has VNNI or AMX (without, ONNX Runtime's kernel
saturates pairs of products in 16-bit lanes). Onnxruntime only; the
benchmark's run itself is the slow smoke test below.
"""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks import int8_matmul, machine
from tests.benchmark_runs import run_quick


def test_every_scheme_computes_the_integer_product():
    pytest.importorskip("onnxruntime")
    rng = np.random.default_rng(1)
    q = rng.integers(-127, 128, (8, 64)).astype(np.int8)
    w = rng.integers(-127, 128, (64, 24)).astype(np.int8)
    q[0], w[:, 0] = 127, 127  # the largest pairs: 255 x 127 twice saturates 16 bits
    expected = q.astype(np.int64) @ w.astype(np.int64)
    # float32 holds every sum here (|q @ w| < 64 * 127 * 128 < 2**24).
    exact_everywhere = {
        int8_matmul.UNSIGNED,
        int8_matmul.SPLIT,
        "int8 x int8",
        "float MatMul",
    }
    for scheme, (model, a) in int8_matmul.matmul_models(q, w).items():
        result = int8_matmul.session(model, 1).run(None, {"a": a})[0]
        error = np.abs(result - expected).max() / np.abs(expected).max()
        if scheme == int8_matmul.DYNAMIC and machine.vnni_flags():
            assert error < 0.02  # its own per-tensor quantization
        elif scheme in exact_everywhere or machine.vnni_flags():
            np.testing.assert_array_equal(result, expected, err_msg=scheme)
        else:  # x86 without VNNI: the uint8 x int8 kernel (quantize_dynamic's
            # too) saturates the pairs (98% off on 2026-11-28's AVX2 EPYC)
            assert error > 0.02, scheme


@pytest.mark.slow  # 4 checked exports and 2 tiny timings: about 15 s
@pytest.mark.one_suite(
    "benchmarks.int8_matmul runs in its own KERAS_BACKEND=tensorflow interpreter"
)
def test_the_benchmark_reports_every_section(tmp_path):
    loaded, _ = run_quick("int8_matmul", tmp_path, 600)
    assert [r["scheme"] for r in loaded["matmul"]] == list(int8_matmul.OPERANDS) * 2
    for row in loaded["matmul"]:
        assert row["ms"] > 0 and row["vs_float"] > 0, row
        if row["scheme"] in (int8_matmul.UNSIGNED, int8_matmul.SPLIT, "int8 x int8"):
            assert row["exact"] == "yes", row
    files = [r["file"] for r in loaded["layer"]]
    assert files == list(int8_matmul.FILES) * 2
    for row in loaded["layer"]:
        assert row["ms"] > 0 and row["vs_anchor"] > 0, row
        if row["file"] == "int8" or (
            row["file"] == int8_matmul.NO_PROBE and machine.vnni_flags()
        ):
            assert row["max_abs_diff"] < 1e-4, row  # Keras's own integers
    assert loaded["ops"][-1]["op"] == "total"
    assert loaded["ops"][-1]["int8"] > 0
