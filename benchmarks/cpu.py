"""`python -m benchmarks.cpu`: SelfAttention vs MultiHeadAttention on the CPU
(TensorFlow), prints and writes the tables (`make bench` runs it first).

Usage:
    python -m benchmarks.cpu [--quick] [--out DIR] [--only SECTION ...]

`--quick` uses tiny sizes and few rounds (seconds; the test suite runs it so
the code cannot rot); its numbers mean nothing. Results go to
DIR/latest.json and DIR/latest.md (default DIR: benchmarks/results).
"""

from __future__ import annotations

import argparse
import dataclasses
import time

from benchmarks import cases, exported, layer_bench, machine, report, subprocesses


def _memory_rows(plan: cases.Plan) -> list[dict]:
    config = plan.config
    return subprocesses.memory_rows(
        plan.memory_times,
        plan.forward_shapes[0].features,
        config.num_heads,
        config.key_dim,
        config.output_dim,
        plan.in_process,
    )


def _long_sequence_rows(plan: cases.Plan) -> list[dict]:
    return subprocesses.long_sequence_rows(
        plan.long_time,
        plan.long_window,
        plan.long_chunk,
        plan.long_rounds,
        plan.in_process,
    )


# section -> function of the plan returning its rows
SECTIONS = {
    "forward": layer_bench.forward_rows,
    "training": layer_bench.training_rows,
    "exported": exported.exported_rows,
    "memory": _memory_rows,
    "long_sequences": _long_sequence_rows,
}


def run(quick: bool = False, only: list[str] | None = None) -> dict:
    """Runs the benchmarks and returns the results (see `report`).

    Args:
        quick: tiny sizes and few rounds (for the smoke test).
        only: names of the sections to run (default: all).

    Returns:
        {"machine", "mode", "seconds", "sections", "targets"}.
    """
    plan = cases.QUICK if quick else cases.FULL
    start = time.perf_counter()
    sections = {}
    for name, measure in SECTIONS.items():
        if only and name not in only:
            continue
        section_start = time.perf_counter()
        sections[name] = measure(plan)
        print(
            f"[bench] {name}: {time.perf_counter() - section_start:.0f} s", flush=True
        )
    return {
        "machine": machine.describe(),
        "mode": "quick" if quick else "full",
        "config": dataclasses.asdict(plan.config),
        "seconds": time.perf_counter() - start,
        "sections": sections,
        "targets": report.targets(
            sections,
            [s.label for s in plan.forward_shapes] if plan.judges_targets else [],
        ),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, few rounds")
    parser.add_argument("--out", default=report.RESULTS_DIR, help="output folder")
    parser.add_argument(
        "--only",
        nargs="+",
        choices=list(report.SECTIONS),
        help="run only these sections",
    )
    args = parser.parse_args(argv)
    results = run(quick=args.quick, only=args.only)
    json_path, markdown_path = report.write(results, args.out)
    with open(markdown_path, encoding="utf-8") as markdown:
        print(markdown.read())
    print(f"Wrote {json_path} and {markdown_path}")


if __name__ == "__main__":
    main()
