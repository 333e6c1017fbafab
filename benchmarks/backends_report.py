"""The Markdown of `python -m benchmarks.backends` (table: `report.table`)."""

from __future__ import annotations

from benchmarks import report

# (function of a result row -> cell text, header)
COLUMNS = [
    (lambda r: r["backend"], "backend"),
    (lambda r: r["device"], "device"),
    (lambda r: r["dtype"], "dtype"),
    (lambda r: r["label"], "row"),
    (lambda r: _ms(r.get("sa_forward_ms")), "SA fwd ms"),
    (lambda r: _ms(r.get("mha_forward_ms")), "MHA fwd ms"),
    (lambda r: _ratio(r.get("forward_ratio")), "fwd SA/MHA"),
    (lambda r: _ms(r.get("sa_train_ms")), "SA train ms"),
    (lambda r: _ms(r.get("mha_train_ms")), "MHA train ms"),
    (lambda r: _ratio(r.get("train_ratio")), "train SA/MHA"),
    (lambda r: _pair(r, "{}_forward_tflops", _tflops), "fwd TFLOP/s SA / MHA"),
    (lambda r: _pair(r, "{}_train_tflops", _tflops), "train TFLOP/s SA / MHA"),
    (lambda r: _pair(r, "{}_forward_mib", _mib), "fwd mem MiB SA / MHA"),
    (lambda r: _pair(r, "{}_train_mib", _mib), "train mem MiB SA / MHA"),
    (lambda r: _rss(r.get("peak_rss")), "peak RSS MiB SA / MHA"),
    (lambda r: _note(r), "note"),
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


def table(rows: list[dict]) -> list[str]:
    """The Markdown table, one line per result row."""
    return report.table(COLUMNS, rows)


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
        f"flash {settings['flash']}",
        f"- Memory: {results['memory_kind'] or 'n/a on this device'}; peak RSS "
        "from fresh child processes (VmHWM)",
        "",
    ]
    lines += [f"- check {check_line(check)}" for check in results["checks"]]
    if not all(check["passed"] for check in results["checks"]):
        return "\n".join(lines + ["", "Nothing timed: the equality check failed."])
    return "\n".join(lines + [""] + table(results["rows"])) + "\n"
