"""Peak RSS of one layer's forward pass, each in a fresh child process.

A process's peak RSS only grows, so one layer's peak would hide the other's
if both ran in one process: each number comes from its own child,
`python -m benchmarks.gpu_probe SPEC`, which prints {"baseline_mib",
"peak_mib", "seconds"}. The peak is VmHWM from /proc/self/status (not
`ru_maxrss`, which keeps the parent's peak across fork + exec); the baseline
is VmRSS after building the layer and a warm-up call at a tiny length (and,
on JAX, compiling the full-size call), just before the measured pass. The
child uses the current KERAS_BACKEND and imports TensorFlow only if that is
"tensorflow". SPEC is JSON: {"row": Row fields, "layer": "self_attention" or
"mha", "dtype": policy, "flash": "auto" | "on" | "off"}.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

from benchmarks.probe import _status_mib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WARMUP_TIME = 16


def measure(spec: dict) -> dict:
    """One forward pass of `spec`'s layer; its RSS before and peak, in MiB."""
    from benchmarks import gpu_backends, gpu_cases

    row = gpu_cases.Row.from_dict(spec["row"])
    kind = spec["layer"]
    backend = gpu_backends.current()
    layer = gpu_cases.build_layer(kind, row, spec["dtype"], spec["flash"])
    apply = gpu_cases.apply_fn(kind, row)
    x, mask = gpu_cases.inputs(row)
    full = backend.prepare(layer, apply, x, mask, train=False)
    small_x, small_mask = gpu_cases.inputs(row, time=min(WARMUP_TIME, row.time))
    backend.prepare(layer, apply, small_x, small_mask, train=False).calls["forward"]()
    baseline = _status_mib("VmRSS")
    start = time.perf_counter()
    full.calls["forward"]()
    seconds = time.perf_counter() - start
    return {
        "baseline_mib": baseline,
        "peak_mib": _status_mib("VmHWM"),
        "seconds": seconds,
    }


def run_child(spec: dict, timeout_s: float = 1800) -> dict:
    """`measure(spec)` in a fresh interpreter; raises RuntimeError if it fails."""
    completed = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_probe", json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
        cwd=REPO,
    )
    if completed.returncode != 0:
        tail = completed.stderr.strip().splitlines()[-3:]
        raise RuntimeError(
            f"gpu_probe {spec['layer']} failed (exit {completed.returncode}): {tail}"
        )
    return json.loads(completed.stdout.strip().splitlines()[-1])


def _summary(results: list[dict]) -> dict:
    peaks = [r["peak_mib"] for r in results]
    baselines = [r["baseline_mib"] for r in results]
    return {
        "peak_mib": statistics.median(peaks),
        "baseline_mib": statistics.median(baselines),
        "growth_mib": statistics.median(
            r["peak_mib"] - r["baseline_mib"] for r in results
        ),
        "seconds": statistics.median(r["seconds"] for r in results),
        "peak_mib_runs": peaks,
    }


def peak_rss(row_dict: dict, dtype: str, flash: str, runs: int) -> dict:
    """{layer: medians over `runs` children}, children of the two layers in turn.

    The order alternates (SA MHA, MHA SA, ...), so neither layer always runs
    after the other on a machine whose load drifts.
    """
    layers = ["self_attention", "mha"]
    results: dict[str, list[dict]] = {layer: [] for layer in layers}
    for index in range(runs):
        for layer in layers if index % 2 == 0 else layers[::-1]:
            spec = {"row": row_dict, "layer": layer, "dtype": dtype, "flash": flash}
            results[layer].append(run_child(spec))
    return {layer: _summary(values) for layer, values in results.items()}


def main(argv: list[str]) -> None:
    # If memory runs out, let the kernel pick this process, not a neighbour.
    with open("/proc/self/oom_score_adj", "w", encoding="utf-8") as adj:
        adj.write("1000")
    print(json.dumps(measure(json.loads(argv[0]))))


if __name__ == "__main__":
    main(sys.argv[1:])
