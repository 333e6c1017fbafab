"""Machine description, Markdown table and JSON file of `python -m benchmarks.gpu`."""

from __future__ import annotations

import datetime
import hashlib
import json
import math
import os
import platform
import subprocess
import sys

import keras

from benchmarks import machine

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (header, function of a result row -> cell text)
COLUMNS = [
    ("backend", lambda r: r["backend"]),
    ("device", lambda r: r["device"]),
    ("dtype", lambda r: r["dtype"]),
    ("row", lambda r: r["label"]),
    ("SA fwd ms", lambda r: _ms(r.get("sa_forward_ms"))),
    ("MHA fwd ms", lambda r: _ms(r.get("mha_forward_ms"))),
    ("fwd SA/MHA", lambda r: _ratio(r.get("forward_ratio"))),
    ("SA train ms", lambda r: _ms(r.get("sa_train_ms"))),
    ("MHA train ms", lambda r: _ms(r.get("mha_train_ms"))),
    ("train SA/MHA", lambda r: _ratio(r.get("train_ratio"))),
    ("fwd TFLOP/s SA / MHA", lambda r: _pair(r, "{}_forward_tflops", _tflops)),
    ("train TFLOP/s SA / MHA", lambda r: _pair(r, "{}_train_tflops", _tflops)),
    ("fwd mem MiB SA / MHA", lambda r: _pair(r, "{}_forward_mib", _mib)),
    ("train mem MiB SA / MHA", lambda r: _pair(r, "{}_train_mib", _mib)),
    ("peak RSS MiB SA / MHA", lambda r: _rss(r.get("peak_rss"))),
    ("note", lambda r: _note(r)),
]


def _ms(value: float | None) -> str:
    if value is None:
        return ""
    return f"{value:.3g}" if value < 100 else f"{value:.0f}"


def _ratio(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}x"


def _tflops(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3g}"


def _mib(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def _pair(row: dict, key: str, fmt) -> str:
    sa, mha = row.get(key.format("sa")), row.get(key.format("mha"))
    if sa is None and mha is None and key.format("sa") not in row:
        return ""
    return f"{fmt(sa)} / {fmt(mha)}"


def _rss(rss: dict | None) -> str:
    if not rss:
        return ""
    return f"{rss['self_attention']['peak_mib']:.0f} / {rss['mha']['peak_mib']:.0f}"


def _note(row: dict) -> str:
    parts = [row["status"]] if row.get("status") else []
    parts += [f"{name}: {message}" for name, message in row.get("errors", {}).items()]
    return "; ".join(parts).replace("|", "/")


def _git(*args: str) -> str | None:
    try:
        completed = subprocess.run(
            ["git", "-C", REPO, *args],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return completed.stdout.strip()


def _memory_gib() -> float | None:
    try:
        with open("/proc/meminfo", encoding="utf-8") as meminfo:
            for line in meminfo:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / 1024**2, 1)
    except OSError:
        pass
    return None


def _layer_sources() -> tuple[str, list[str], list[str]]:
    """SHA-256 of the loaded keras_selfattn modules' sources, their paths, and
    those that differ from the commit."""
    paths = sorted(
        os.path.relpath(module.__file__, REPO)
        for name, module in list(sys.modules.items())
        if (name == "keras_selfattn" or name.startswith("keras_selfattn."))
        and getattr(module, "__file__", None)
    )
    digest = hashlib.sha256()
    for path in paths:
        digest.update(path.encode())
        with open(os.path.join(REPO, path), "rb") as source:
            digest.update(source.read())
    status = _git("status", "--porcelain", "--", *paths) if paths else ""
    modified = [line[3:] for line in (status or "").splitlines()]
    return digest.hexdigest()[:16], paths, modified


def describe(backend) -> dict:
    """Machine, software, device, date, and the layer's source.

    `layer_sha256` hashes the sources of the keras_selfattn modules this run
    loaded, and `layer_modified` lists those that differ from `git_commit`,
    so a "before" run can be told from an "after" run while the layer is
    being changed in the same checkout.
    """
    layer_sha256, layer_files, modified = _layer_sources()
    return {
        "cpu": machine._cpu_model(),
        "cores": os.cpu_count(),
        "memory_gib": _memory_gib(),
        "load_average_1_5_15min": machine._load_average(),
        "os": platform.platform(),
        "python": platform.python_version(),
        "keras": keras.__version__,
        "backend": backend.name,
        "backend_version": backend.version(),
        "device": backend.device(),
        "git_commit": _git("rev-parse", "--short", "HEAD"),
        "layer_sha256": layer_sha256,
        "layer_files": layer_files,
        "layer_modified": modified,
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime(
            "%Y-%m-%d %H:%M UTC"
        ),
    }


def table(rows: list[dict]) -> list[str]:
    """The Markdown table, one line per result row."""
    lines = [
        "| " + " | ".join(header for header, _ in COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    for row in rows:
        lines.append("| " + " | ".join(cell(row) for _, cell in COLUMNS) + " |")
    return lines


def check_line(check: dict) -> str:
    """One equality check: max |SA - MHA|, the tolerance, ok or FAILED."""
    text = f"{check['label']} float32: "
    if check.get("error"):
        return text + f"FAILED, a layer did not run: {check['error']}"
    verdict = "ok" if check["passed"] else "FAILED"
    return text + (
        f"max |SA - MHA| = {check['max_abs_difference']:.2e} "
        f"(tolerance {check['tolerance']:.0e} x max(1, max |MHA|)): {verdict}"
    )


def to_markdown(results: dict) -> str:
    """Machine and settings, the equality checks, then the table."""
    m = results["machine"]
    settings = results["settings"]
    commit = f"{m['git_commit'] or 'unknown'}, layer sources {m['layer_sha256']}"
    if m["layer_modified"]:
        commit += f" (modified: {', '.join(m['layer_modified'])})"
    lines = [
        f"- Machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB "
        f"(load average {m['load_average_1_5_15min']}), {m['os']}",
        f"- Software: Python {m['python']}, Keras {m['keras']}, {m['backend']} "
        f"{m['backend_version']}; device {m['device']}; commit {commit}",
        f"- Date: {m['date_utc']}; rounds {settings['repeats']} (interleaved); "
        f"flash {settings['flash']} (SelfAttention takes flash_attention: "
        f"{settings['sa_accepts_flash_attention']})",
        f"- Memory: {results['memory_kind'] or 'n/a on this device'}; peak RSS "
        "from fresh child processes (VmHWM)",
        "",
    ]
    lines += [f"- check {check_line(check)}" for check in results["checks"]]
    if not all(check["passed"] for check in results["checks"]):
        return "\n".join(lines + ["", "Nothing timed: the equality check failed."])
    return "\n".join(lines + [""] + table(results["rows"])) + "\n"


def write_json(results: dict, path: str) -> None:
    """Writes `results` (NaN-free) to `path`, replaced whole."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as handle:
        json.dump(_finite(results), handle, indent=2, allow_nan=False)
        handle.write("\n")
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
