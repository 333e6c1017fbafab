"""Targets, the JSON file, the Markdown table and the command line of a
benchmark run."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
from collections.abc import Callable, Sequence
from typing import TypeVar

# Where `make bench` writes its JSON and Markdown results.
RESULTS_DIR = os.path.join(os.path.dirname(__file__), "results")
# A benchmark's plan (`plan`).
P = TypeVar("P")

# section -> (title, [(row key, column header)])
SECTIONS: dict[str, tuple[str, list[tuple[str, str]]]] = {
    "forward": (
        "Forward pass (tf.function): SelfAttention vs keras.layers.MultiHeadAttention",
        [
            ("shape", "(B, T, F)"),
            ("mask", "mask"),
            ("speedup_vs_mha", "speedup vs MHA"),
            ("gflops_ours", "SelfAttention GFLOP/s"),
            ("gflops_mha", "MHA GFLOP/s"),
            ("gflops_matmul", "matmul GFLOP/s"),
            ("fraction_of_matmul", "SelfAttention / matmul"),
            ("max_abs_difference", "max abs diff"),
        ],
    ),
    "training": (
        "Training step (forward + gradients, tf.function), no mask",
        [
            ("shape", "(B, T, F)"),
            ("speedup_vs_mha", "speedup vs MHA"),
            ("gflops_ours", "SelfAttention GFLOP/s"),
            ("gflops_mha", "MHA GFLOP/s"),
            ("gflops_matmul", "matmul GFLOP/s"),
            ("fraction_of_matmul", "SelfAttention / matmul"),
        ],
    ),
    "exported": (
        "Exported model: onnxruntime vs the TF SavedModel signature",
        [
            ("shape", "(B, T, F)"),
            ("onnx_vs_saved_model", "ONNX (tf2onnx) vs SavedModel"),
            ("fused_vs_onnx", "fused ONNX vs unfused ONNX"),
            ("fused_vs_saved_model", "fused ONNX vs SavedModel"),
            ("ms_saved_model", "SavedModel ms"),
            ("ms_onnx", "ONNX ms"),
            ("max_abs_difference", "max abs diff"),
        ],
    ),
    "memory": (
        "Peak memory (RSS) of one forward pass, fresh process each",
        [
            ("layer", "layer"),
            ("shape", "(B, T, F)"),
            ("peak_mib", "peak RSS MiB"),
            ("baseline_mib", "RSS before the pass MiB"),
            ("seconds", "pass s"),
            ("status", "note"),
        ],
    ),
    "long_sequences": (
        "Long sequences: 1 head, key_dim 64, features 64, fresh process each",
        [
            ("case", "case"),
            ("shape", "(B, T, F)"),
            ("chunk_size", "chunk_size"),
            ("sliding_window", "sliding_window"),
            ("peak_mib", "peak RSS MiB"),
            ("speedup", "chunked vs unchunked"),
            ("status", "note"),
        ],
    ),
}

_SPEEDUPS = {
    "speedup_vs_mha",
    "onnx_vs_saved_model",
    "fused_vs_onnx",
    "fused_vs_saved_model",
    "speedup",
    "vs_saved_model",
    "vs_predict",
    "vs_call",
}


def require_tensorflow(name: str, why: str) -> None:
    """Raises ValueError unless Keras runs on TensorFlow, which the benchmark
    `name` needs for `why`."""
    import keras

    backend = keras.backend.backend()
    if backend != "tensorflow":
        raise ValueError(
            f"benchmarks.{name} needs KERAS_BACKEND=tensorflow ({why}). "
            f"Received: backend={backend}"
        )


def _format(key: str, value) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if key in _SPEEDUPS:
        return f"{value:.2f}x"
    if key == "fraction_of_matmul":
        return f"{100 * value:.0f}%"
    if key in ("max_abs_difference", "max_abs_error"):
        return f"{value:.1e}"
    if key in ("peak_mib", "baseline_mib"):
        return f"{value:.0f}"
    if isinstance(value, float):
        return f"{value:.1f}" if value >= 1 else f"{value:.3f}"
    return str(value)


def _find(rows: list[dict], **match) -> dict | None:
    for row in rows:
        if all(row.get(k) == v for k, v in match.items()):
            return row
    return None


def _target(
    name: str,
    row: dict | None,
    key: str,
    check: Callable[[float], bool],
    threshold: str,
) -> dict:
    value = None if row is None else row.get(key, row.get("status"))
    if value is None:
        return {"target": name, "threshold": threshold, "value": None, "met": None}
    if isinstance(value, str):
        return {"target": name, "threshold": threshold, "value": value, "met": None}
    return {
        "target": name,
        "threshold": threshold,
        "value": value,
        "met": bool(check(value)),
    }


def targets(sections: dict[str, list[dict]], shapes: list[str]) -> list[dict]:
    """Issue 5's and 6's targets at `shapes` (labels) with their measured
    values (None: not run)."""
    forward = sections.get("forward", [])
    result = []
    for shape in shapes:
        for mask in ("none", "padding", "causal"):
            result.append(
                _target(
                    f"forward {shape} mask={mask}: SelfAttention vs MHA",
                    _find(forward, shape=shape, mask=mask),
                    "speedup_vs_mha",
                    lambda v: v >= 1.2,
                    ">= 1.20x",
                )
            )
    for shape in shapes:
        result.append(
            _target(
                f"training step {shape}: SelfAttention vs MHA",
                _find(sections.get("training", []), shape=shape),
                "speedup_vs_mha",
                lambda v: v >= 1.1,
                ">= 1.10x",
            )
        )
    result.append(
        _target(
            "forward (2, 1024, 256): fraction of the matmul GFLOP/s",
            _find(forward, shape="(2, 1024, 256)", mask="none"),
            "fraction_of_matmul",
            lambda v: v >= 0.6,
            ">= 60%",
        )
    )
    exported = _find(sections.get("exported", []), shape="(8, 512, 256)")
    result += [
        _target(
            "export (8, 512, 256): onnxruntime vs SavedModel",
            exported,
            "onnx_vs_saved_model",
            lambda v: v >= 1.5,
            ">= 1.50x",
        ),
        _target(
            "export (8, 512, 256): fused ONNX vs unfused ONNX",
            exported,
            "fused_vs_onnx",
            lambda v: v >= 1.25,
            ">= 1.25x",
        ),
        _target(
            "export (8, 512, 256): fused ONNX vs SavedModel",
            exported,
            "fused_vs_saved_model",
            lambda v: v >= 2.0,
            ">= 2.00x",
        ),
    ]
    long_rows = sections.get("long_sequences", [])
    shape = "(1, 32768, 64)"
    result += [
        _target(
            "time 32768, chunk_size set: peak RSS",
            _find(long_rows, case="memory chunked", shape=shape),
            "peak_mib",
            lambda v: v <= 2.5 * 1024,
            "<= 2560 MiB",
        ),
        _target(
            "time 32768, unchunked: peak RSS",
            _find(long_rows, case="memory unchunked", shape=shape),
            "peak_mib",
            lambda v: v > 8 * 1024,
            "> 8192 MiB",
        ),
        _target(
            "time 32768, sliding_window 256: chunked vs unchunked",
            _find(long_rows, case="sliding window", shape=shape),
            "speedup",
            lambda v: v >= 10,
            ">= 10x",
        ),
    ]
    return result


def table(columns: list[tuple[str | Callable, str]], rows: list[dict]) -> list[str]:
    """The one Markdown table writer of the benchmarks.

    Args:
        columns: (cell, header) pairs; a cell is a row key (formatted by
            `_format`, blank if absent) or a function of the row to text.
        rows: one dict per line.

    Returns:
        The header line, the separator, then one line per row.
    """
    lines = [
        "| " + " | ".join(header for _, header in columns) + " |",
        "|" + "---|" * len(columns),
    ]
    for row in rows:
        cells = [
            cell(row) if callable(cell) else _format(cell, row.get(cell))
            for cell, _ in columns
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _target_cell(value, key_hint: str) -> str:
    if value is None:
        return "not measured"
    if isinstance(value, str):
        return value
    return _format(key_hint, value)


def to_markdown(results: dict) -> str:
    """The run as Markdown: machine, method, one table per section, targets."""
    machine = results["machine"]
    config = results["config"]
    lines = [
        "# Benchmark results",
        "",
        f"- Machine: {machine['cpu']}, {machine['cores']} cores "
        f"(load average {machine['load_average_1_5_15min']}), {machine['os']}",
        f"- Software: Python {machine['python']}, TensorFlow "
        f"{machine['tensorflow']}, Keras {machine['keras']}, onnxruntime "
        f"{machine['onnxruntime']}",
        f"- Date: {machine['date_utc']}; mode: {results['mode']}; "
        f"total {results['seconds']:.0f} s",
        "- Method: one process, candidates interleaved (A B C A B C ...); "
        "speedups are medians of the per-round time ratios; GFLOP/s count the "
        "projections, Q K^T, weights x V and the output projection (causal in "
        "full); the matmul ceiling is a square float32 tf.function matmul of "
        "about the same FLOPs, timed in the same rounds. Layers: "
        f"{config['num_heads']} heads, key_dim {config['key_dim']}, output "
        f"projection to {config['output_dim']}, biases, identical weights "
        "(MultiHeadAttention called as mha(x, x)).",
        "",
    ]
    for name, (title, columns) in SECTIONS.items():
        if name not in results["sections"]:
            continue
        lines += [f"## {title}", ""]
        lines += table(columns, results["sections"][name])
        lines.append("")
    lines += [
        "## Targets",
        "",
        "| target | threshold | measured | met |",
        "|---|---|---|---|",
    ]
    for target in results["targets"]:
        hint = "peak_mib" if "RSS" in target["target"] else "speedup"
        if "fraction" in target["target"]:
            hint = "fraction_of_matmul"
        met = {True: "yes", False: "no", None: "-"}[target["met"]]
        lines.append(
            f"| {target['target']} | {target['threshold']} | "
            f"{_target_cell(target['value'], hint)} | {met} |"
        )
    return "\n".join(lines) + "\n"


def write_json(results: dict, path: str) -> None:
    """Writes `results` to `path` (non-finite floats as null), replaced whole."""
    _replace(path, json.dumps(_finite(results), indent=2, allow_nan=False) + "\n")


def _replace(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write(text)
    os.replace(tmp, path)


def _finite(value):
    """`value` with non-finite floats as None (JSON has no NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def write(
    results: dict,
    out_dir: str,
    stem: str = "latest",
    markdown: Callable[[dict], str] | None = None,
) -> tuple[str, str]:
    """Writes `stem`.json and `stem`.md into `out_dir` (each replaced whole).

    Args:
        results: the run.
        out_dir: the folder.
        stem: the files' name.
        markdown: results -> Markdown (default: `to_markdown`, the CPU run's).

    Returns:
        The paths (json, markdown).
    """
    paths = (os.path.join(out_dir, f"{stem}.json"), os.path.join(out_dir, f"{stem}.md"))
    write_json(results, paths[0])
    _replace(paths[1], (markdown or to_markdown)(results))
    return paths


def main(
    doc: str,
    run: Callable[..., dict],
    to_markdown: Callable[[dict], str],
    stem: str,
    helps: dict[str, str],
    argv: Sequence[str] | None = None,
) -> None:
    """The command line of a benchmark taking `--quick`, `--out` and
    `--rounds`: runs `run(quick=..., rounds=...)`, prints its Markdown and
    writes `stem`.json and `stem`.md into `--out` (`write`).

    Args:
        doc: The benchmark's docstring; its first line is `--help`'s.
        run, to_markdown: The benchmark's.
        stem: The results' file name.
        helps: The help of "quick" and "rounds".
        argv: The arguments (None: `sys.argv`).
    """
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=helps["quick"])
    parser.add_argument("--out", default=RESULTS_DIR, help="output folder")
    parser.add_argument("--rounds", type=int, default=None, help=helps["rounds"])
    args = parser.parse_args(argv)
    results = run(quick=args.quick, rounds=args.rounds)
    json_path, markdown_path = write(results, args.out, stem, to_markdown)
    print(to_markdown(results))
    print(f"Wrote {json_path} and {markdown_path} at {datetime.datetime.now()}")


def plan(quick_plan: P, full_plan: P, quick: bool, rounds: int | None) -> P:
    """The plan a run takes from `main`'s `--quick` and `--rounds`.

    Args:
        quick_plan, full_plan: The benchmark's plans, dataclasses with a
            `rounds` field.
        quick: Whether the run is `--quick` (`quick_plan`, else `full_plan`).
        rounds: Interleaved rounds replacing the plan's (None: the plan's).

    Returns:
        The plan, its `rounds` replaced when `rounds` is given.
    """
    chosen = quick_plan if quick else full_plan
    return chosen if rounds is None else dataclasses.replace(chosen, rounds=rounds)
