"""The benchmark code runs at a tiny size and writes complete tables.

No timing assertions: benchmarks are not tests. These tests check that the
benchmark runs end to end, that its JSON and Markdown are complete, that its
numbers are positive and finite, and that the two layers it compares compute
the same function. The CPU benchmark runs in this process (TensorFlow
suite only); `benchmarks.runtimes --quick` and `benchmarks.quantized --quick`
(slow) run once each, in their own KERAS_BACKEND=tensorflow interpreter
(one_suite).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import re
from decimal import Decimal

import numpy as np
import pytest

from benchmarks import cases, cpu, quantized, report, runtimes, subprocesses, timing
from tests.benchmark_runs import run_quick

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


# The quick benchmark run these read: 31 s of make test on 2 shared AVX2 cores.
QUICK_RUN = pytest.mark.slow


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
@QUICK_RUN
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
@QUICK_RUN
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
@QUICK_RUN
def test_compared_layers_compute_the_same_function(quick_results):
    loaded, _ = quick_results
    for row in loaded["sections"]["forward"]:
        assert row["max_abs_difference"] < 1e-4, row
    for row in loaded["sections"]["exported"]:
        assert row["max_abs_difference"] < 1e-4, row


@tensorflow_only
@QUICK_RUN
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
    return run_quick("runtimes", tmp_path_factory.mktemp("runtimes"), 300)


@pytest.mark.slow  # checked exports in every format
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


@pytest.mark.slow
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


@pytest.mark.slow  # 13 checked exports: about 70 s on 2 shared cores
@pytest.mark.one_suite(
    "benchmarks.quantized runs in its own KERAS_BACKEND=tensorflow interpreter"
)
def test_quantized_reports_every_runtime_and_precision(tmp_path):
    loaded, markdown = run_quick("quantized", tmp_path, 600)
    expected = [
        (runtime, precision)
        for runtime in quantized.RUNTIMES
        for precision in quantized.PRECISIONS
    ] + [("onnx", quantized.ANCHOR)]
    assert [(r["runtime"], r["precision"]) for r in loaded["files"]] == expected
    vnni = loaded["machine"]["vnni"]  # its flags, [] for none, None off x86
    shapes = [f"({b}, {t})" for b, t in quantized.QUICK.shapes]
    timed = expected + [("keras", precision) for precision in quantized.PRECISIONS]
    assert [(r["shape"], r["runtime"], r["precision"]) for r in loaded["rows"]] == [
        (shape, *key) for shape in shapes for key in timed
    ]
    files = {(r["runtime"], r["precision"]): r for r in loaded["files"]}
    for key, row in files.items():
        if "status" in row:  # the exporter refused, or the runtime is missing
            assert row["status"].startswith(("not exported:", "not installed:")), row
            continue
        assert row["bytes"] > 0 and row["stored_as"], row
        assert f"| {key[0]} | {key[1]} | {row['stored_as']} |" in markdown
    for runtime in quantized.RUNTIMES:
        if "not installed" not in files[(runtime, "float")].get("status", ""):
            assert 0 < files[(runtime, "int8")]["size_vs_float"] < 1, runtime
    assert 0 < files[("onnx", quantized.ANCHOR)]["size_vs_float"] < 1
    for row in loaded["rows"]:
        if "status" in row:
            assert row["status"] == files[(row["runtime"], row["precision"])]["status"]
            continue
        if row["runtime"] == "keras":  # the models themselves, in Keras: no file
            assert row["precision"] == "float" or row["vs_float"] > 0, row
        assert math.isfinite(row["ms"]) and row["ms"] > 0, row
        assert 0 <= row["max_abs_diff"] < 1, row
        if row["precision"] != "float":
            assert row["vs_float"] > 0, row
        if row["runtime"] == "onnx" and row["precision"] == "int8":
            assert row["time_vs_anchor"] > 0, row
    assert "## Targets" in markdown and loaded["targets"]
    assert "VNNI: " in markdown and all(flag in markdown for flag in vnni or [])


# ------------------------------------------------------------ memory estimate
@pytest.mark.slow
@tensorflow_only
def test_the_memory_estimate_bounds_measured_growth():
    # TensorFlow's largest forward in copies of (B, H, T, T) was
    # MultiHeadAttention with a causal mask (2.76 at T = 4096): its measured
    # peak growth in a fresh process stays under pairs.estimated_bytes.
    spec = subprocesses.spec("mha", 1, 2048, 64, 4, 16, None, causal=True)
    result = subprocesses.peak_memory(spec)
    growth = (result["peak_mib"] - result["baseline_mib"]) * 2**20
    copy = 1 * 4 * 2048 * 2048 * 4
    assert copy < growth < subprocesses.estimate(spec), (growth / copy, result)


# -------------------------------------------------------------- decode report
def _half_unit(text: str) -> float:
    """Half a unit of the last digit `text` shows ("0.822": 0.0005)."""
    return 0.5 * 10.0 ** Decimal(text).as_tuple().exponent


def _shows(text: str, value: float) -> bool:
    """Whether `text` is `value` rounded to the digits `text` shows."""
    return abs(float(text) - value) <= _half_unit(text) * (1 + 1e-9)


def _tables(markdown: str) -> list[list[dict[str, str]]]:
    """Every Markdown table of `markdown`, as one {header: cell} per line."""
    tables, lines = [], []
    for line in [*markdown.splitlines(), ""]:
        if line.startswith("|"):
            lines.append([cell.strip() for cell in line.strip("|").split("|")])
        elif lines:
            header, _, *body = lines
            tables.append([dict(zip(header, row, strict=True)) for row in body])
            lines = []
    return tables


def _check_quartiles(cell: str, ratio: dict) -> None:
    match = re.fullmatch(r"([0-9.]+) \(([0-9.]+)-([0-9.]+)\)", cell)
    assert match, cell
    for text, key in zip(match.groups(), ("median", "q1", "q3"), strict=True):
        assert _shows(text, ratio[key]), (cell, ratio)


def _check_decode_report(markdown: str, results: dict) -> None:
    """Every cell, target and model figure of the decode report against the
    results it was given (the JSON it records)."""
    rows, gqa_rows = _tables(markdown)
    assert len(rows) == len(results["rows"])
    for cells, row in zip(rows, results["rows"], strict=True):
        assert cells["context"] == str(row["context"])
        heads = f"{row['num_heads']} ({row['num_key_value_heads']})"
        assert cells["heads (kv heads)"] == heads
        assert _shows(cells["uncached ms/token"], row["uncached_ms"]), cells
        assert _shows(cells["cached ms/token"], row["cached_ms"]), cells
        _check_quartiles(cells["cached speedup (quartiles)"], row["speedup"])
        assert _shows(cells["cache MiB"], row["cache_bytes"] / 2**20), cells
        assert _shows(cells["max abs diff"], row["max_abs_difference"]), cells
    assert len(gqa_rows) == len(results["gqa"])
    for cells, gqa in zip(gqa_rows, results["gqa"], strict=True):
        assert cells["context"] == str(gqa["context"])
        full, grouped = cells["cache bytes, full -> GQA"].split(" -> ")
        assert [int(full), int(grouped)] == [
            gqa["cache_bytes_full"],
            gqa["cache_bytes_gqa"],
        ]
        ratio = cells["memory ratio"].removesuffix("x")
        assert _shows(ratio, gqa["memory_ratio"]), cells
        _check_quartiles(cells["GQA/full time, cached step"], gqa["cached_time_ratio"])
        _check_quartiles(
            cells["GQA/full time, full forward"], gqa["uncached_time_ratio"]
        )
    lines = re.findall(r"^- (.+): ([^,:]+), (met|NOT met)$", markdown, re.M)
    assert len(lines) == len(results["targets"])
    for (text, measured, met), target in zip(lines, results["targets"], strict=True):
        assert text == target["target"]
        assert f"{target['threshold']:g}x" in text or target["unit"] == "time_ratio"
        assert text.endswith(f"context {target['context']}")
        assert _shows(re.search(r"[0-9]+\.[0-9]+", measured).group(), target["value"])
        assert (met == "met") == target["met"]
    model = results["model"]
    match = re.search(
        r"^- Model: (\d+) causal SelfAttention layers with residuals, D=(\d+), "
        r"(\d+) heads x key_dim (\d+), RoPE \(max wavelength (\d+)\), biases, "
        r"output_dim=(\d+); (\w+), batch (\d+); GQA: num_key_value_heads = "
        r"num_heads / (\d+)$",
        markdown,
        re.M,
    )
    assert match, markdown
    assert list(match.groups()) == [
        str(v)
        for v in (
            model["layers"],
            model["features"],
            model["num_heads"],
            model["key_dim"],
            f"{model['rope_max_wavelength']:g}",
            model["output_dim"],
            model["dtype"],
            model["batch"],
            results["settings"]["gqa_divisor"],
        )
    ]


def _leaves(value):
    if isinstance(value, dict):
        for item in value.values():
            yield from _leaves(item)
    elif isinstance(value, list):
        for item in value:
            yield from _leaves(item)
    else:
        yield value


def _numbers_not_in(markdown: str, results: dict) -> list[str]:
    """Numbers of `markdown` that are neither in a string of `results` nor
    one of its numbers (cache bytes also in MiB) at the digits shown."""
    leaves = list(_leaves(results))
    strings = [leaf for leaf in leaves if isinstance(leaf, str)]
    numbers = [
        float(leaf)
        for leaf in leaves
        if isinstance(leaf, (int, float)) and not isinstance(leaf, bool)
    ]
    numbers += [row["cache_bytes"] / 2**20 for row in results["rows"]]
    return [
        token
        for token in re.findall(r"\d+(?:\.\d+)?(?:e[+-]\d+)?", markdown)
        if not any(token in text for text in strings)
        and not any(_shows(token, number) for number in numbers)
    ]


def _decode_results() -> dict:
    """Results as `benchmarks.decode.run` returns them, with made-up numbers."""
    from benchmarks import decode

    rows, gqa = [], []
    for context, scale in ((512, 1.0), (2048, 7.0)):
        for kind, kv_heads in (("full", 8), ("gqa", 2)):
            rows.append(
                {
                    "context": context,
                    "kind": kind,
                    "num_heads": 8,
                    "cache_shape": [1, 2, context, kv_heads, 32],
                    "num_key_value_heads": kv_heads,
                    "uncached_ms": 26.71 * scale,
                    "cached_ms": 3.8813 / kv_heads,
                    "speedup": {"median": 6.87 * scale, "q1": 6.79, "q3": 6.94},
                    "cache_bytes": 4 * 2 * context * kv_heads * 32 * 4,
                    "max_abs_difference": 4.83e-7 * scale,
                }
            )
        gqa.append(
            {
                "context": context,
                "cache_bytes_full": 4 * 2 * context * 8 * 32 * 4,
                "cache_bytes_gqa": 4 * 2 * context * 2 * 32 * 4,
                "memory_ratio": 4.0,
                "cached_time_ratio": {"median": 0.853, "q1": 0.8, "q3": 1.234},
                "uncached_time_ratio": {"median": 1.004, "q1": 0.98, "q3": 1.031},
            }
        )
    return {
        "machine": {
            "cpu": "Test CPU",
            "cores": 3,
            "memory_gib": 7.5,
            "load_average_1_5_15min": [1.25, 2.5, 3.75],
            "os": "Linux-9.9",
            "python": "3.99.1",
            "keras": "9.8.7",
            "backend": "jax",
            "backend_version": "0.0.1",
            "device": "cpu",
            "git_commit": "abc1234",
            "date_utc": "2031-01-02 03:04 UTC",
        },
        "settings": {"rounds": 13, "gqa_divisor": 4},
        "model": {
            "layers": 4,
            "features": 256,
            "num_heads": 8,
            "key_dim": 32,
            "output_dim": 256,
            "causal": True,
            "rope_max_wavelength": 10000.0,
            "use_bias": True,
            "dtype": "float32",
            "batch": 1,
        },
        "compiled": "jax.jit",
        "rows": rows,
        "gqa": gqa,
        "targets": decode.targets(rows, gqa),
    }


def test_decode_report_shows_the_results_numbers_only():
    from benchmarks import decode

    results = _decode_results()
    markdown = decode.to_markdown(results)
    _check_decode_report(markdown, results)
    assert _numbers_not_in(markdown, results) == []
    assert "| 2048 | 8 (2) | 186.970 | 1.941 | 48.1 (6.8-6.9) | 4.000 | 3.4e-06 |" in (
        markdown
    )
    met = {t["target"]: t["met"] for t in results["targets"]}
    assert met["cached decode >= 5x faster per token than recomputing, context 512"]
    assert met["cached decode >= 20x faster per token than recomputing, context 2048"]
    assert not met["GQA full forward no slower than full heads, context 512"]
    # The checks fail when the report and the results disagree.
    changed = _decode_results()
    changed["rows"][1]["uncached_ms"] += 0.01
    with pytest.raises(AssertionError):
        _check_decode_report(markdown, changed)
    changed = _decode_results()
    changed["model"]["key_dim"] = 16
    with pytest.raises(AssertionError):
        _check_decode_report(markdown, changed)
    assert _numbers_not_in(markdown + "\n- typed in: 6.5x", results) == ["6.5"]


def test_decode_quartiles_stay_within_the_rounds():
    # decode --quick times 2 rounds, where exclusive quartiles extrapolate
    # (ratios 1 and 3: 0.5 and 3.5); its table once showed a time ratio's
    # quartiles as "(-0.1-4.6)".
    two = timing.Interleaved({"a": [1.0, 3.0], "b": [1.0, 1.0]})
    assert two.quartiles("a", "b") == (1.0, 3.0)
    three = timing.Interleaved({"a": [1.0, 3.0, 2.0], "b": [1.0, 1.0, 1.0]})
    assert three.quartiles("a", "b") == (1.0, 3.0)


@pytest.fixture(scope="module")
def decode_quick(tmp_path_factory) -> tuple[str, dict]:
    """(printed Markdown, recorded JSON) of `benchmarks.decode --quick`."""
    from benchmarks import decode

    path = tmp_path_factory.mktemp("decode") / "decode.json"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert decode.main(["--quick", "--json", str(path)]) == 0
    return printed.getvalue(), json.loads(path.read_text(encoding="utf-8"))


@pytest.mark.slow
def test_decode_prints_the_numbers_it_records(decode_quick):
    from benchmarks import decode

    printed, recorded = decode_quick
    assert printed == decode.to_markdown(recorded)
    _check_decode_report(printed, recorded)
    assert _numbers_not_in(printed, recorded) == []


@pytest.mark.slow
def test_decode_records_the_model_it_measured(decode_quick):
    from benchmarks import decode

    _, recorded = decode_quick
    settings, model = decode.QUICK, recorded["model"]
    assert model["features"] == settings.features
    assert model["layers"] == settings.layers
    # SelfAttention's default key_dim: features // num_heads.
    assert model["key_dim"] == settings.features // settings.num_heads
    kv_heads = {"full": settings.num_heads, "gqa": settings.num_heads // 4}
    for row in recorded["rows"]:
        kv = kv_heads[row["kind"]]
        assert row["num_key_value_heads"] == kv
        assert row["cache_shape"] == [1, 2, row["context"], kv, model["key_dim"]]
        # one float32 cache per layer
        assert row["cache_bytes"] == settings.layers * 4 * math.prod(row["cache_shape"])


@pytest.mark.slow  # seven checked exports and three backends: about 2 minutes
@pytest.mark.one_suite(
    "benchmarks.generation runs TensorFlow here and children per backend"
)
def test_generation_times_every_candidate_with_the_same_tokens(tmp_path):
    loaded, markdown = run_quick("generation", tmp_path, 900)
    rows = loaded["rows"]
    tensorflow = [row for row in rows if row["backend"] == "tensorflow"]
    assert [(row["threads"], row["candidate"]) for row in tensorflow] == [
        ("default", "generate"),
        ("default", "saved_model_generator"),
        ("default", "saved_model_generator_xla"),
        ("default", "onnx_generator"),
        ("default", "saved_model_step"),
        ("default", "onnx_step"),
        ("intra-op 1, inter-op 1", "saved_model_generator"),
        ("intra-op 1, inter-op 1", "saved_model_step"),
    ]
    for row in tensorflow:
        assert row["same_tokens"] is True, row
        assert row["tokens_per_s"] > 0 and row["vs_saved_model_step"] > 0, row
    for backend in ("jax", "torch"):
        (row,) = [row for row in rows if row["backend"] == backend]
        assert row.get("tokens_per_s", 0) > 0, row
    assert [t["target"].split()[0] for t in loaded["targets"]] == [
        "saved_model_generator",
        "saved_model_generator_xla",
        "saved_model_generator",
    ]
    assert "TensorFlow threads: intra-op 1" in loaded["targets"][-1]["target"]
