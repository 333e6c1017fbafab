"""The frame of a benchmark run once per Keras backend (`benchmarks.keras_hub`,
`benchmarks.nested`): its rounds, its results, their Markdown and its command
line."""

from __future__ import annotations

from collections.abc import Callable

import keras

from benchmarks import machine, report

# Interleaved rounds of a `--quick` run and, by default, of a full one.
QUICK_ROUNDS, ROUNDS = 3, 7


def rounds(quick: bool, given: int | None) -> int:
    """The rounds of a run: `given` (`--rounds`), else `QUICK_ROUNDS` or
    `ROUNDS`."""
    return given or (QUICK_ROUNDS if quick else ROUNDS)


def results(rounds: int, rows: list[dict]) -> dict:
    """The run's results: this machine, the Keras backend, `rounds`, `rows`."""
    return {
        "machine": machine.describe(),
        "backend": keras.backend.backend(),
        "rounds": rounds,
        "rows": rows,
    }


def to_markdown(
    results: dict,
    title: str,
    setting: str,
    targets: str,
    columns: list[tuple[str | Callable, str]],
) -> str:
    """`results` as Markdown.

    Args:
        results: The run (`results`).
        title: The heading, followed by the backend in brackets.
        setting: What follows the machine and the rounds on their line.
        targets: The paragraph of the targets.
        columns: The rows' table's (`report.table`).

    Returns:
        The heading, the machine line, the targets and the table.
    """
    m = results["machine"]
    lines = [
        f"# {title} ({results['backend']})",
        "",
        f"{m['cpu']}, {m['cores']} cores, load {m['load_average_1_5_15min']}, "
        f"commit {m['git_commit']}, {m['date_utc']}; {results['rounds']} rounds, "
        f"{setting}",
        "",
        targets,
        "",
        *report.table(columns, results["rows"]),
    ]
    return "\n".join(lines) + "\n"


def main(
    doc: str,
    run: Callable[..., dict],
    to_markdown: Callable[[dict], str],
    prefix: str,
) -> None:
    """`report.main` for a benchmark run once per Keras backend: its results
    are `prefix`_<backend>.json and .md, `--quick` one small case in
    `QUICK_ROUNDS` rounds, `ROUNDS` by default (`rounds`)."""
    report.main(
        doc,
        run,
        to_markdown,
        f"{prefix}_{keras.backend.backend()}",
        {
            "quick": f"one small case, {QUICK_ROUNDS} rounds",
            "rounds": f"rounds (default {ROUNDS})",
        },
    )
