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
import os
import time
from dataclasses import dataclass, field

from benchmarks import cases, exported, layer_bench, machine, report, subprocesses

RESULTS_DIR = os.path.join(os.path.dirname(__file__), "results")


@dataclass(frozen=True)
class Plan:
    """Sizes and repetitions of one run."""

    config: cases.AttentionConfig
    forward_shapes: list[cases.Shape]
    export_shapes: list[cases.Shape]
    memory_times: list[int]
    long_time: int
    long_window: int
    long_chunk: int
    rounds: int
    min_round_s: float
    long_rounds: int
    in_process: bool = False
    full_shapes: list[str] = field(default_factory=list)


FULL = Plan(
    config=cases.AttentionConfig(num_heads=4, key_dim=64, output_dim=256),
    forward_shapes=[
        cases.Shape(8, 128, 256),
        cases.Shape(2, 1024, 256),
        cases.Shape(1, 4096, 256),
    ],
    export_shapes=[cases.Shape(8, 512, 256), cases.Shape(1, 4096, 256)],
    memory_times=[4096, 8192],
    long_time=32768,
    long_window=256,
    long_chunk=512,
    rounds=15,
    min_round_s=0.1,
    long_rounds=3,
    full_shapes=["(8, 128, 256)", "(2, 1024, 256)", "(1, 4096, 256)"],
)

QUICK = Plan(
    config=cases.AttentionConfig(num_heads=2, key_dim=8, output_dim=16),
    forward_shapes=[cases.Shape(2, 16, 16)],
    export_shapes=[cases.Shape(2, 16, 16)],
    memory_times=[64],
    long_time=256,
    long_window=16,
    long_chunk=64,
    rounds=3,
    min_round_s=0.0,
    long_rounds=2,
    in_process=True,
)


def _sections(plan: Plan) -> dict:
    config = plan.config
    timing = (plan.rounds, plan.min_round_s)
    features = plan.forward_shapes[0].features
    return {
        "forward": lambda: layer_bench.forward_rows(
            plan.forward_shapes, config, *timing
        ),
        "training": lambda: layer_bench.training_rows(
            plan.forward_shapes, config, *timing
        ),
        "exported": lambda: exported.exported_rows(plan.export_shapes, config, *timing),
        "memory": lambda: subprocesses.memory_rows(
            plan.memory_times,
            features,
            config.num_heads,
            config.key_dim,
            config.output_dim,
            plan.in_process,
        ),
        "long_sequences": lambda: subprocesses.long_sequence_rows(
            plan.long_time,
            plan.long_window,
            plan.long_chunk,
            plan.long_rounds,
            plan.in_process,
        ),
    }


def run(quick: bool = False, only: list[str] | None = None) -> dict:
    """Runs the benchmarks and returns the results (see `report`).

    Args:
        quick: tiny sizes and few rounds (for the smoke test).
        only: names of the sections to run (default: all).

    Returns:
        {"machine", "mode", "seconds", "sections", "targets"}.
    """
    plan = QUICK if quick else FULL
    start = time.perf_counter()
    sections = {}
    for name, measure in _sections(plan).items():
        if only and name not in only:
            continue
        section_start = time.perf_counter()
        sections[name] = measure()
        print(
            f"[bench] {name}: {time.perf_counter() - section_start:.0f} s", flush=True
        )
    return {
        "machine": machine.describe(),
        "mode": "quick" if quick else "full",
        "config": dataclasses.asdict(plan.config),
        "seconds": time.perf_counter() - start,
        "sections": sections,
        "targets": report.targets(sections, plan.full_shapes),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, few rounds")
    parser.add_argument("--out", default=RESULTS_DIR, help="output folder")
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
