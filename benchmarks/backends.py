"""SelfAttention vs keras.layers.MultiHeadAttention on the current Keras backend.

Usage:
    KERAS_BACKEND=jax python -m benchmarks.backends [--shapes gpu] [--dtype both]
        [--repeats 10] [--flash auto] [--json PATH]
    KERAS_BACKEND=torch python -m benchmarks.backends --shapes cpu-t8192
    python -m benchmarks.backends --shapes tiny --repeats 1 --min-round-s 0  # smoke

Both layers: D = 256, 4 heads x key_dim 64, output projection to D, biases,
the same weights (MultiHeadAttention's copied into SelfAttention by reshape,
checked equal in float32 at a small shape before anything is timed). Each
row times forward and train step of both layers interleaved in one process
and reports medians, the SA/MHA time ratio (median of per-round ratios; >1:
SelfAttention slower), TFLOP/s and temporary memory; rows with `rss` (and
every row with `--rss`) also measure peak RSS of each layer's forward pass in
fresh child processes. Nothing here imports TensorFlow unless the backend is
TensorFlow. Exit status 1 if the equality check fails (nothing is timed).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import sys
import time

from benchmarks import backends_report, machine, pairs, probe, report, runners
from benchmarks.pairs import MHA, SA, Row
from benchmarks.subprocesses import refusal
from benchmarks.timing import Interleaved, interleave

CHECK_BATCH, CHECK_TIME = 2, 64
# max |SA - MHA| allowed, relative to max(1, max |MHA|): float32 on CPU; on a
# GPU float32 matmuls may run in TF32 (10-bit mantissa).
CHECK_TOLERANCE = {"cpu": 1e-4, "gpu": 1e-2}


def _log(message: str) -> None:
    print(f"[backends] {message}", file=sys.stderr, flush=True)


def _short(error: BaseException) -> str:
    """One line: "out of memory", or the error's type and first real line.

    Keras wraps a layer's error as "Exception encountered when calling X",
    the cause on a later line; ANSI bold codes are dropped.
    """
    if runners.out_of_memory(error):
        return "out of memory"
    lines = [
        line.replace("\x1b[1m", "").replace("\x1b[0m", "").strip()
        for line in str(error).splitlines()
    ]
    lines = [line for line in lines if line]
    if len(lines) > 1 and lines[0].startswith("Exception encountered"):
        lines = lines[1:]
    return f"{type(error).__name__}: {lines[0] if lines else ''}"[:200]


# ----------------------------------------------------------------- the check
def _check_row(row: Row) -> Row:
    """`row`'s layers and mask at the small check shape."""
    return dataclasses.replace(
        row,
        name=f"check-{row.name}",
        batch=CHECK_BATCH,
        time=min(row.time, CHECK_TIME),
    )


def _outputs(backend, row: Row, flash: str, x, mask) -> dict:
    """float32 forward outputs {kind: numpy} of both layers."""
    outputs = {}
    for kind in (SA, MHA):
        layer = pairs.build_layer(kind, row, "float32", flash)
        apply = pairs.apply_fn(kind, row)
        prepared = backend.prepare(layer, apply, x, mask, train=False)
        outputs[kind] = prepared.output()
    return outputs


def check(backend, row: Row, flash: str) -> dict:
    """max |SA - MHA| of float32 forward outputs at a small shape (real positions).

    A layer that cannot run (e.g. `--flash on` where no flash kernel exists)
    fails the check, with the error in "error".
    """
    small = _check_row(row)
    result = {
        "label": f"{small.label}, H{small.num_heads}·K{small.key_dim}",
        "config": row.name,
        "mask": row.mask,
        "tolerance": CHECK_TOLERANCE["gpu" if backend.is_gpu() else "cpu"],
        "max_abs_difference": None,
        "passed": False,
    }
    x, mask = pairs.inputs(small)
    try:
        outputs = _outputs(backend, small, flash, x, mask)
    except Exception as error:  # reported, and the run stops
        result["error"] = _short(error)
        return result
    difference = pairs.max_difference(outputs[SA], outputs[MHA], mask)
    scale = max(1.0, float(abs(outputs[MHA]).max()))
    result["max_abs_difference"] = difference
    result["passed"] = bool(difference <= result["tolerance"] * scale)
    return result


def run_checks(backend, rows: list[Row], flash: str) -> list[dict]:
    """One check per distinct (D, H, K, mask) among `rows`."""
    checks, seen = [], set()
    for row in rows:
        key = (row.features, row.num_heads, row.key_dim, row.mask)
        if key in seen:
            continue
        seen.add(key)
        result = check(backend, row, flash)
        _log(f"check {backends_report.check_line(result)}")
        checks.append(result)
    return checks


# ---------------------------------------------------------------- one row
def estimate(row: Row) -> int:
    """`pairs.estimated_bytes` of a row: its training step when it has one
    (the larger), else its forward pass."""
    return pairs.estimated_bytes(row.batch, row.time, row.num_heads, train=row.train)


def _too_big(backend, row: Row) -> str | None:
    """Why a CPU row is not run (its (B, H, T, T) tensors would not fit in
    host memory; on a GPU an out-of-memory error is caught and reported)."""
    if backend.is_gpu():
        return None
    return refusal(estimate(row))


def _prepare(backend, row: Row, dtype: str, flash: str, result: dict) -> dict:
    """Zero-argument calls "{kind} {mode}" of both layers, warmed up.

    Fills result's temporary memory fields and `errors` (a layer or mode
    that fails, e.g. out of memory, is left out of the timing).
    """
    x, mask = pairs.inputs(row)
    calls = {}
    for kind, short in ((SA, "sa"), (MHA, "mha")):
        try:
            layer = pairs.build_layer(kind, row, dtype, flash)
            apply = pairs.apply_fn(kind, row)
            prepared = backend.prepare(layer, apply, x, mask, train=row.train)
        except Exception as error:  # reported in the row
            result["errors"][short] = _short(error)
            backend.release()
            continue
        for mode, call in prepared.calls.items():
            try:
                call()
                memory = prepared.memory(mode)
            except Exception as error:  # reported in the row
                result["errors"][f"{short} {mode}"] = _short(error)
                backend.release()
                continue
            result[f"{short}_{mode}_mib"] = None if memory is None else memory / 2**20
            calls[f"{kind} {mode}"] = call
    return calls


def _timing_fields(timing: Interleaved, row: Row) -> dict:
    """Medians (ms), SA/MHA ratios and TFLOP/s of each timed mode."""
    fields = {"rounds": len(next(iter(timing.times.values())))}
    flops = {
        "forward": pairs.forward_flops(row),
        "train": pairs.train_flops(row),
    }
    for mode in ("forward", "train"):
        for kind, short in ((SA, "sa"), (MHA, "mha")):
            name = f"{kind} {mode}"
            if name in timing.times:
                seconds = timing.median(name)
                fields[f"{short}_{mode}_ms"] = 1e3 * seconds
                fields[f"{short}_{mode}_tflops"] = flops[mode] / seconds / 1e12
        if f"{SA} {mode}" in timing.times and f"{MHA} {mode}" in timing.times:
            # speedup(a, b) = median over rounds of time_a / time_b.
            fields[f"{mode}_ratio"] = timing.speedup(f"{SA} {mode}", f"{MHA} {mode}")
            fields[f"{mode}_ratio_quartiles"] = list(
                timing.quartiles(f"{SA} {mode}", f"{MHA} {mode}")
            )
    return fields


def measure_row(backend, row: Row, dtype: str, args: argparse.Namespace) -> dict:
    """One (row, dtype): peak RSS children (if asked), then interleaved timing."""
    rss = row.rss or args.rss
    result = {
        "backend": backend.name,
        "device": backend.device(),
        "dtype": dtype,
        "label": row.label,
        **row.to_dict(),
        "forward_flops": pairs.forward_flops(row),
        "errors": {},
    }
    reason = _too_big(backend, row)
    if reason:
        result["status"] = reason
        return result
    if rss:
        try:
            result["peak_rss"] = probe.peak_rss(
                row.to_dict(), dtype, args.flash, args.rss_runs
            )
        except (RuntimeError, OSError, ValueError) as error:
            result["errors"]["rss"] = _short(error)
    calls = _prepare(backend, row, dtype, args.flash, result)
    if calls:
        timing = interleave(
            calls, rounds=args.repeats, warmup=0, min_round_s=args.min_round_s
        )
        result.update(_timing_fields(timing, row))
        result["times_s"] = timing.times
    del calls
    gc.collect()
    backend.release()
    return result


# ---------------------------------------------------------------- the run
def run(args: argparse.Namespace) -> dict:
    """Checks, then every (row, dtype); returns the results (see backends_report)."""
    backend = runners.current()
    rows = pairs.select_rows(args.shapes)
    dtypes = pairs.DTYPES if args.dtype == "both" else (args.dtype,)
    results = {
        "machine": machine.describe(backend),
        "memory_kind": backend.memory_kind,
        "settings": {
            "shapes": args.shapes,
            "dtype": args.dtype,
            "repeats": args.repeats,
            "min_round_s": args.min_round_s,
            "flash": args.flash,
            "rss_runs": args.rss_runs,
        },
        "checks": run_checks(backend, rows, args.flash),
        "rows": [],
    }
    if not all(c["passed"] for c in results["checks"]):
        return results
    start = time.perf_counter()
    for row in rows:
        wanted = [d for d in dtypes if row.dtypes is None or d in row.dtypes]
        if not wanted:
            results["rows"].append(_skipped(backend, row, dtypes))
        for dtype in wanted:
            row_start = time.perf_counter()
            results["rows"].append(measure_row(backend, row, dtype, args))
            _log(f"{row.name} {dtype}: {time.perf_counter() - row_start:.0f} s")
    results["seconds"] = time.perf_counter() - start
    return results


def _skipped(backend, row: Row, dtypes: tuple[str, ...]) -> dict:
    return {
        "backend": backend.name,
        "device": backend.device(),
        "dtype": "/".join(dtypes),
        "label": row.label,
        **row.to_dict(),
        "errors": {},
        "status": f"not run: this row runs in {', '.join(row.dtypes or ())} only",
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="rows: "
        + ", ".join(pairs.PRESETS)
        + "; groups: "
        + ", ".join(f"{k} = {' '.join(v)}" for k, v in pairs.GROUPS.items()),
    )
    parser.add_argument(
        "--shapes", nargs="+", default=["gpu"], help="rows or groups (default: gpu)"
    )
    parser.add_argument("--dtype", choices=[*pairs.DTYPES, "both"], default="both")
    parser.add_argument("--repeats", type=int, default=10, help="interleaved rounds")
    parser.add_argument(
        "--min-round-s",
        type=float,
        default=0.1,
        help="each timed sample repeats a call until about this long",
    )
    parser.add_argument(
        "--flash",
        choices=list(pairs.FLASH),
        default="auto",
        help="flash_attention for both layers (auto: pass nothing)",
    )
    parser.add_argument(
        "--rss",
        action="store_true",
        help="peak RSS of every row's forward pass (fresh child processes)",
    )
    parser.add_argument(
        "--rss-runs", type=int, default=3, help="child processes per layer"
    )
    parser.add_argument("--json", metavar="PATH", help="write the results here")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.rss_runs < 1:
        parser.error("--repeats and --rss-runs must be >= 1")
    try:
        pairs.select_rows(args.shapes)
    except ValueError as error:
        parser.error(str(error))
    return args


def main(argv: list[str] | None = None) -> int:
    """Runs, prints the Markdown, writes the JSON; 1 if the check failed."""
    args = parse_args(argv)
    results = run(args)
    print(backends_report.to_markdown(results), flush=True)
    if args.json:
        report.write_json(results, args.json)
        _log(f"wrote {args.json}")
    return 0 if all(c["passed"] for c in results["checks"]) else 1


if __name__ == "__main__":
    sys.exit(main())
