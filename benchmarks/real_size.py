"""Real sizes (issue 54): keras-hub Llamas past 2 GiB, converted, generating
and exported to every generator format, with the memory and time each needs.

Per model (`real_size_child.MODELS`, random weights from one seed), each step
in its own child process (`benchmarks.real_size_child`), so each peak is its
own:

1. build + `convert_causal_lm` + `keras_selfattn.generate` against
   keras-hub's greedy `generate` on an 8-token prompt (8 new tokens): the
   same tokens?
2. - 4. build + convert + `export_generator` to SavedModel, ONNX and LiteRT
   (`max_length` 32), each with its own fresh-process check.
5. - 6. the same for SavedModel and ONNX with the converted model quantized
   to int8 first (`model.quantize("int8")`; LiteRT refuses quantized
   generators in one line: its converter has no int8 batch matmul).

The peak RSS of the child's whole process tree (the export's check included)
is polled with psutil every 0.2 s; it is given in GiB and as a multiple of
the float32 weights. A child the kernel kills for memory (rc -9) is recorded
with the peak it reached, and the run goes on; so is one this script stops
because the machine's available memory fell under `RESERVE_GIB` (shared
machine) or it ran past `--timeout`. The machine (CPU, cores, memory, load
before and after each step) is in the results file.

A run of some steps (`--steps onnx`) keeps the results file's rows of the
other steps, each with the date of its own run. Each row names whether
TensorFlow's oneDNN ops were on in its processes (`TF_ENABLE_ONEDNN_OPTS`,
on unless "0" in the environment the run is given): oneDNN's CPU allocator
keeps the memory it once held (docs/export.md), so a run with it off is a
row of its own.

    make bench-real-size                          # llama-0.6b
    .venv/bin/python -m benchmarks.real_size --model tiny --out /tmp/rs
    .venv/bin/python -m benchmarks.real_size --steps onnx   # ONNX rerun
    TF_ENABLE_ONEDNN_OPTS=0 make bench-real-size  # oneDNN off
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import psutil

from benchmarks import machine, quantized, report
from benchmarks.real_size_child import MODELS

STEPS = ("generate", "saved_model", "onnx", "litert", "saved_model-int8", "onnx-int8")
RESERVE_GIB = 1.0
GIB = 2**30


def _available_gib() -> float:
    return psutil.virtual_memory().available / GIB


def _stop(root: psutil.Process) -> None:
    for process in [*root.children(recursive=True), root]:
        try:
            process.kill()
        except psutil.Error:
            pass


def _uncommitted() -> list[str]:
    """`git status` of keras_selfattn/: the children import it, this process
    does not (so `machine.describe()`'s `layer_modified` stays empty)."""
    completed = subprocess.run(
        ["git", "-C", machine.REPO, "status", "--porcelain", "--", "keras_selfattn"],
        capture_output=True,
        text=True,
    )
    return completed.stdout.splitlines()


def measure(args: list[str], timeout_s: float) -> dict:
    """Runs `args` (on TensorFlow) in a child; its tree's peak RSS and
    peak PSS (a page two of its processes share, TensorFlow's libraries,
    counted once: what the machine holds), wall time, rc, stdout."""
    start = time.perf_counter()
    child = subprocess.Popen(
        args,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "KERAS_BACKEND": "tensorflow"},
    )
    root, peak, peak_pss, stopped = psutil.Process(child.pid), 0, 0, None
    while child.poll() is None:
        try:
            processes = [root, *root.children(recursive=True)]
            # RSS and PSS read together (statm, then smaps_rollup).
            infos = [p.memory_full_info() for p in processes]
            peak = max(peak, sum(info.rss for info in infos))
            peak_pss = max(peak_pss, sum(info.pss for info in infos))
        except psutil.Error:
            pass
        if stopped is None and _available_gib() < RESERVE_GIB:
            stopped = f"stopped: machine's available memory under {RESERVE_GIB} GiB"
            _stop(root)
        elif stopped is None and time.perf_counter() - start > timeout_s:
            stopped = f"stopped: past {timeout_s:.0f} s"
            _stop(root)
        time.sleep(0.2)
    out, err = child.communicate()
    return {
        "rc": child.returncode,
        "stopped": stopped,
        "peak_rss_gib": peak / GIB,
        "peak_pss_gib": peak_pss / GIB,
        "wall_s": time.perf_counter() - start,
        "stdout": out,
        "stderr_tail": err[-2000:],
    }


def step_row(model: str, step: str, work: str, timeout_s: float) -> dict:
    """One step (module docstring) in a fresh child process."""
    before = machine.describe()
    args = [sys.executable, "-m", "benchmarks.real_size_child", step, model, work]
    measured = measure(args, timeout_s)
    row = {
        "model": model,
        "step": step,
        "onednn": _onednn(),
        "cpu": _cpu(before),
        "date_utc": before["date_utc"],
        "load_before": before["load_average_1_5_15min"],
    }
    lines = measured.pop("stdout").strip().splitlines()
    if measured["rc"] == 0 and lines:
        row.update(json.loads(lines[-1]))
        measured.pop("stderr_tail")
    row.update(measured)
    row["load_after"] = machine.describe()["load_average_1_5_15min"]
    return row


def _onednn() -> str:
    """ "on" or "off": TensorFlow's oneDNN ops in the steps' processes."""
    return "off" if os.environ.get("TF_ENABLE_ONEDNN_OPTS") == "0" else "on"


def _cpu(described: dict) -> str:
    """The CPU and its integer features: "AMD EPYC (AVX2)"."""
    features = ", ".join(quantized.cpu_features() or []) or "features unknown"
    return f"{described['cpu']} ({features})"


def _key(row: dict) -> tuple[str, str, str, str]:
    return row["model"], row["step"], row.get("onednn", "on"), row.get("cpu", "")


def run(models: list[str], steps: list[str], work: str, timeout_s: float) -> dict:
    """Every step of every model; the machine named."""
    before = machine.describe()
    available = _available_gib()
    rows = []
    for model in models:
        folder = os.path.join(work, model)
        os.makedirs(folder, exist_ok=True)
        for step in steps:
            row = step_row(model, step, folder, timeout_s)
            weights = next((r["weights_gib"] for r in rows if "weights_gib" in r), None)
            weights = row.get("weights_gib", weights)
            if weights:
                row["weights_gib"] = weights
                row["peak_x_weights"] = row["peak_rss_gib"] / weights
            rows.append(row)
            sys.stdout.write(_line(row) + "\n")
            sys.stdout.flush()
    return {
        "machine": before,
        "load_average_after": machine.describe()["load_average_1_5_15min"],
        "memory_available_gib_before": available,
        "keras_selfattn_uncommitted": _uncommitted(),
        "backend": "tensorflow",
        "request": (
            "batch 1, 8-token prompt, 8 new greedy tokens; exports max_length 32"
        ),
        "rows": rows,
    }


def merged(results: dict, path: str) -> dict:
    """`results` with the rows of the results file at `path` (an earlier
    run's) for the steps this run did not run, in `STEPS`' order per model."""
    if not os.path.exists(path):
        return results
    with open(path, encoding="utf-8") as file:
        earlier = json.load(file)
    ran = {_key(row) for row in results["rows"]}
    kept = [row for row in earlier["rows"] if _key(row) not in ran]
    for row in kept:
        row.setdefault("date_utc", earlier["machine"]["date_utc"])
        row.setdefault("onednn", "on")
    models = list(dict.fromkeys(row["model"] for row in [*kept, *results["rows"]]))
    rows = sorted(
        [*kept, *results["rows"]],
        key=lambda row: (
            models.index(row["model"]),
            STEPS.index(row["step"]),
            row["onednn"],
            row.get("cpu", ""),
        ),
    )
    return {**results, "rows": rows}


def _line(row: dict) -> str:
    return (
        f"{row['model']} {row['step']}: rc {row['rc']}, peak "
        f"{row['peak_rss_gib']:.2f} GiB, {row['wall_s']:.0f} s"
        + (f" ({row['stopped']})" if row["stopped"] else "")
    )


def _status(row: dict) -> str:
    if row["stopped"]:
        return row["stopped"]
    if row["rc"] == -9:
        return "killed for memory (rc -9)"
    if row["rc"] != 0:
        lines = (row.get("stderr_tail") or "").strip().splitlines()
        said = f": {lines[-1].split(': ', 1)[-1]}" if lines else ""
        return f"failed (rc {row['rc']}){said}"
    if row["step"] == "generate":
        return "keras-hub's tokens" if row["tokens_equal"] else "tokens differ"
    return f"written ({row['written_gib']:.2f} GiB), checked in a fresh process"


def _phases(row: dict) -> str:
    keys = ("build_s", "keras_hub_generate_s", "convert_s", "quantize_s")
    keys += ("generate_s", "export_and_check_s")
    names = {
        "build_s": "build",
        "keras_hub_generate_s": "keras-hub generate",
        "convert_s": "convert",
        "quantize_s": "quantize",
        "generate_s": "generate",
        "export_and_check_s": "export + check",
    }
    return ", ".join(f"{names[k]} {row[k]:.0f} s" for k in keys if k in row)


def to_markdown(results: dict) -> str:
    info = results["machine"]
    lines = [
        "# Real sizes: keras-hub Llamas past 2 GiB (issue 54)",
        "",
        f"{info['cpu']}, {info['cores']} cores, {info['memory_gib']} GiB, "
        f"shared; load average (1/5/15 min) before "
        f"{info['load_average_1_5_15min']}, after "
        f"{results['load_average_after']}; {info['date_utc']}, commit "
        f"{info['git_commit']}"
        + (
            f" (uncommitted: {', '.join(results['keras_selfattn_uncommitted'])})"
            if results.get("keras_selfattn_uncommitted")
            else ""
        )
        + f"; TensorFlow {info.get('tensorflow')}, Keras "
        f"{info.get('keras')}. Random weights (one seed); "
        f"{results['request']}. Peak RSS: the step's whole process tree "
        "(the export's fresh-process check included), polled every 0.2 s; "
        "x weights: over the model's float32 weights (an int8 step's too, "
        "as built before its quantization). Peak PSS: the same "
        "tree's proportional set size (a page its processes share, such as "
        "TensorFlow's libraries in the Keras process and a TensorFlow check, "
        "counted once), read with it (rows before 2026-11-30 06:20 UTC "
        "have none). Each step is a fresh "
        "process that builds the model first (its time is in the total); "
        "the header's machine, load and commit are the last run's, each "
        "row's CPU, run and load its own (rows run before 2026-12-01 23:30 "
        "UTC did not record their CPU: docs/export.md names each figure's "
        "machine). oneDNN: TensorFlow's oneDNN ops in the "
        'step\'s processes ("off": `TF_ENABLE_ONEDNN_OPTS=0` in its environment; '
        "its allocator keeps every block it once held). "
        f"{results['memory_available_gib_before']:.1f} GiB available before; "
        f"a step is stopped when the machine's falls under {RESERVE_GIB} GiB.",
        "",
        *report.table(
            [
                ("model", "model"),
                (
                    lambda r: (
                        f"{r['weights_gib']:.2f} GiB" if "weights_gib" in r else ""
                    ),
                    "weights",
                ),
                ("step", "step"),
                ("onednn", "oneDNN"),
                (lambda r: r.get("cpu", "not recorded"), "CPU"),
                (lambda r: f"{r['peak_rss_gib']:.2f} GiB", "peak RSS"),
                (
                    lambda r: (
                        f"{r['peak_x_weights']:.1f}x" if "peak_x_weights" in r else ""
                    ),
                    "x weights",
                ),
                (
                    lambda r: (
                        f"{r['peak_pss_gib']:.2f} GiB "
                        f"({r['peak_pss_gib'] / r['weights_gib']:.1f}x)"
                        if "peak_pss_gib" in r and "weights_gib" in r
                        else ""
                    ),
                    "peak PSS",
                ),
                (lambda r: f"{r['wall_s']:.0f} s", "total"),
                (_phases, "phases"),
                (_status, "result"),
                (lambda r: str(r["load_before"]), "load before"),
                (lambda r: r.get("date_utc", ""), "run"),
            ],
            results["rows"],
        ),
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), action="append")
    parser.add_argument("--steps", nargs="+", choices=STEPS, default=list(STEPS))
    parser.add_argument("--timeout", type=float, default=1800.0, help="per step, s")
    parser.add_argument("--work", default=None, help="the exported files")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    models = args.model or ["llama-0.6b"]
    with tempfile.TemporaryDirectory(dir=args.work) as work:
        results = run(models, args.steps, work, args.timeout)
    stem = "real_size_" + "_".join(m.replace(".", "_") for m in models)
    results = merged(results, os.path.join(args.out, f"{stem}.json"))
    paths = report.write(results, args.out, stem=stem, markdown=to_markdown)
    sys.stdout.write(to_markdown(results) + f"\n{paths[0]}\n")


if __name__ == "__main__":
    main()
