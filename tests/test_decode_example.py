"""Decoding with the key/value cache: the text generation example and the
decode benchmark run end to end on the current KERAS_BACKEND.

`examples/text_generation.py --fast` and `python -m benchmarks.decode
--quick` each run once, in a fresh interpreter (the backend is read at
import), and their output is checked: the cached and uncached generations
produced the same tokens, the benchmark's cached step equals the full
forward and its tables have every row. No timing is asserted.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.backend import BACKEND

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT = 300


def _run(args: list[str], cwd: Path) -> str:
    """Runs `python ARGS` in `cwd` on the current backend; returns stdout."""
    env = dict(os.environ, KERAS_BACKEND=BACKEND, TF_CPP_MIN_LOG_LEVEL="2")
    result = subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=TIMEOUT,
    )
    assert result.returncode == 0, (
        f"{args} exited {result.returncode}\n{result.stdout[-3000:]}\n"
        f"{result.stderr[-3000:]}"
    )
    return result.stdout


@pytest.fixture(scope="module")
def example(tmp_path_factory) -> tuple[str, dict]:
    """(stdout, text_generation.json) of one fast run."""
    out = tmp_path_factory.mktemp("text_generation") / "artifacts"
    script = str(ROOT / "examples" / "text_generation.py")
    stdout = _run([script, "--fast", "--out", str(out)], out.parent)
    return stdout, json.loads((out / "text_generation.json").read_text())


@pytest.fixture(scope="module")
def benchmark(tmp_path_factory) -> tuple[str, dict]:
    """(stdout, JSON) of one quick benchmark run."""
    path = tmp_path_factory.mktemp("decode") / "decode.json"
    stdout = _run(["-m", "benchmarks.decode", "--quick", "--json", str(path)], ROOT)
    return stdout, json.loads(path.read_text())


# JAX trains and generates op by op, each new shape compiled: minutes; on
# TensorFlow the example also exports and checks its generator (a minute and
# a half on 2 shared cores); on PyTorch it trains and generates in 35 s of
# `make test` on the AVX2 EPYC. The slow suite runs it (CI's on TensorFlow).
SLOW = pytest.mark.slow


@SLOW
def test_example_cached_and_uncached_tokens_are_equal(example):
    stdout, report = example
    assert report["backend"] == BACKEND
    assert report["tokens_equal"] is True
    runs = report["uncached"] + report["cached"]
    assert len(runs) == 2  # --fast: one timed run of each
    assert all(run["tokens"] == runs[0]["tokens"] for run in runs)
    assert len(runs[0]["tokens"]) == 24
    assert "cached tokens == uncached tokens: True" in stdout


@SLOW
def test_example_prints_its_lines(example):
    stdout, report = example
    assert re.search(
        r"^training text: keras \S+ LICENSE\S*, \d+ characters, \d+ distinct$",
        stdout,
        re.M,
    )
    assert re.search(r"^trained 20 steps in [0-9.]+ s, loss [0-9.]+$", stdout, re.M)
    for name in ("uncached", "cached"):
        match = re.search(
            rf"^ *{name}: 24 tokens in ([0-9.]+) s, ([0-9.]+) tokens/s "
            r"\(1 timed run\)$",
            stdout,
            re.M,
        )
        assert match, name
        assert float(match.group(1)) > 0 and float(match.group(2)) > 0
    speedup = re.search(r"^speedup with the cache: ([0-9.]+)x$", stdout, re.M)
    assert speedup and float(speedup.group(1)) == pytest.approx(
        report["speedup"], abs=0.01
    )
    generated = report["generated"]
    assert len(generated) == 24 and f"generated: {generated!r}" in stdout


@SLOW
@pytest.mark.tensorflow_only("the generator exports on TensorFlow")
def test_example_serves_its_generator_as_generate_does(example, tmp_path):
    """The exported generator's answer, read by the REST client's parser,
    is `generate`'s tokens; the request body and query.py's inputs file are
    what TF Serving and query.py read."""
    stdout, report = example
    assert report["served"]["tokens_equal_generate"] is True
    assert "served answer == generate: True" in stdout
    request = re.search(r"curl -d @(\S+) ", stdout).group(1)
    body = json.loads(Path(request).read_text())
    assert body["signature_name"] == "generate"
    assert body["inputs"]["prompt_lengths"] == [33, 12]
    inputs = re.search(r"query\.py (\S+) --model char_lm", stdout).group(1)
    assert json.loads(Path(inputs).read_text()) == body["inputs"]


# The benchmark's smoke run, in the slow suite: cached decoding is checked on
# every backend in `make test` by the example above and tests/test_kv_cache.py.
@pytest.mark.slow
def test_benchmark_cached_step_equals_the_full_forward(benchmark):
    _, results = benchmark
    rows = results["rows"]
    assert [(r["context"], r["kind"]) for r in rows] == [
        (context, kind) for context in (32, 64) for kind in ("full", "gqa")
    ]
    for row in rows:
        assert row["max_abs_difference"] < 1e-4, row
        assert row["uncached_ms"] > 0 and row["cached_ms"] > 0
    for gqa in results["gqa"]:
        assert gqa["cache_bytes_full"] == 4 * gqa["cache_bytes_gqa"]


@pytest.mark.slow
def test_benchmark_prints_every_row_and_target(benchmark):
    stdout, results = benchmark
    assert results["machine"]["backend"] == BACKEND
    for context in (32, 64):
        for heads in ("4 (4)", "4 (1)"):
            assert re.search(
                rf"^\| {context} \| {re.escape(heads)} \| [0-9.]+ \| [0-9.]+ \| ",
                stdout,
                re.M,
            ), (context, heads)
        assert re.search(rf"^\| {context} \| \d+ -> \d+ \| 4\.00x \| ", stdout, re.M), (
            context
        )
    targets = re.findall(r"^- (GQA .*): .*, (met|NOT met)$", stdout, re.M)
    assert len(targets) == 6 == len(results["targets"])
