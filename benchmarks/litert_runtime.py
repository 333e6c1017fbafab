"""The memory a LiteRT generator file takes to run, by way of running it.

LiteRT's Interpreter (its default XNNPACK delegate, as the export's check
runs a file of at most 1 GiB) packs each weight once per subgraph that
reads it: a generator's file has four (the "generate" prompt pass and its
loop body, "prefill", "decode"). On LiteRT's builtin kernels (XNNPACK off,
as the check runs a larger file) it reads the mapped file's weights as
they are. LiteRT's CompiledModel with an XNNPACK weight cache file packs
each once for all of them, into the file, and maps it. Each way
runs in a process of its own (`benchmarks.litert_runtime_child`): its peak
RSS (polled every 0.2 s, as `benchmarks.real_size` polls), the time to load
and answer a first greedy request, a request's median after, and whether
the tokens are the Interpreter's (which the export's check compared with
Keras's).

    .venv/bin/python -m benchmarks.litert_runtime --model llama-0.6b
    .venv/bin/python -m benchmarks.litert_runtime --file g.tflite --vocabulary 32000

Without `--file`, the model's generator is exported first
(`benchmarks.real_size_child litert`, its fresh-process check included).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from benchmarks import machine, report
from benchmarks.real_size import measure
from benchmarks.real_size_child import FILES, MODELS

WAYS = (
    ("interpreter", "Interpreter (default XNNPACK delegate)"),
    ("builtin", "Interpreter, builtin kernels (XNNPACK off)"),
    ("compiled_model", "CompiledModel, XNNPACK weight cache written"),
    ("compiled_model", "CompiledModel, XNNPACK weight cache mapped"),
)
GIB = 2**30


def _child(*args: str) -> list[str]:
    return [sys.executable, "-m", *args]


def run(path: str, vocabulary: int, work: str, timeout_s: float) -> list[dict]:
    """Each of `WAYS` on the file at `path`, in order (the cache file is
    written by the first CompiledModel and mapped by the second)."""
    cache = os.path.join(work, "weights.xnnpack_cache")
    rows, first = [], None
    for way, label in WAYS:
        args = _child(
            "benchmarks.litert_runtime_child", way, path, str(vocabulary), cache
        )
        measured = measure(args, timeout_s)
        row = {"way": label, "peak_rss_gib": measured["peak_rss_gib"]}
        if measured["rc"] != 0:
            row["result"] = f"failed (rc {measured['rc']}): " + (
                measured["stopped"] or measured["stderr_tail"].strip()[-300:]
            )
        else:
            record = json.loads(measured["stdout"].strip().splitlines()[-1])
            first = first or record["tokens"]
            row.update(
                load_and_first_s=record["load_and_first_s"],
                request_s=record["request_s"],
                result="the Interpreter's tokens"
                if record["tokens"] == first
                else "other tokens",
            )
        if os.path.exists(cache):
            row["cache_gib"] = os.path.getsize(cache) / GIB
        rows.append(row)
    return rows


def to_markdown(results: dict) -> str:
    info = results["machine"]
    return "\n".join(
        [
            "# A LiteRT generator file's memory, by way of running it",
            "",
            f"{info['cpu']}, {info['cores']} cores, {info['memory_gib']} GiB, "
            f"shared; load average (1/5/15 min) {info['load_average_1_5_15min']}; "
            f"{info['date_utc']}, commit {info['git_commit']}; ai-edge-litert "
            f"{info.get('ai_edge_litert')}. {results['file']}. Each way in a "
            "process of its own, 2 threads; peak RSS polled every 0.2 s; a "
            "greedy request of an 8-token prompt and 8 new tokens.",
            "",
            *report.table(
                [
                    ("way", "way"),
                    (lambda r: f"{r['peak_rss_gib']:.2f} GiB", "peak RSS"),
                    (
                        lambda r: (
                            f"{r['load_and_first_s']:.1f} s"
                            if "load_and_first_s" in r
                            else ""
                        ),
                        "load + first request",
                    ),
                    (
                        lambda r: f"{r['request_s']:.2f} s" if "request_s" in r else "",
                        "a request after",
                    ),
                    (
                        lambda r: (
                            f"{r['cache_gib']:.2f} GiB" if "cache_gib" in r else ""
                        ),
                        "weight cache file",
                    ),
                    ("result", "result"),
                ],
                results["rows"],
            ),
            "",
        ]
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="llama-0.6b")
    parser.add_argument("--file", help="a LiteRT generator file (else exported)")
    parser.add_argument("--vocabulary", type=int, help="with --file")
    parser.add_argument("--timeout", type=float, default=1800.0, help="per way, s")
    parser.add_argument("--work", default=None)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=args.work) as work:
        path, vocabulary = args.file, args.vocabulary
        if path is None:
            step = ("benchmarks.real_size_child", "litert", args.model, work)
            exported = measure(_child(*step), args.timeout)
            if exported["rc"] != 0:
                raise SystemExit(f"export failed: {exported['stderr_tail']}")
            path = os.path.join(work, FILES["litert"])
            vocabulary = MODELS[args.model]["vocabulary_size"]
        elif vocabulary is None:
            parser.error("--file needs --vocabulary")
        file = f"{os.path.getsize(path) / GIB:.2f} GiB file"
        if args.file is None:
            file = f"{args.model}'s generator ({file}, max_length 32)"
        results = {
            "machine": machine.describe(),
            "file": file,
            "rows": run(path, vocabulary, work, args.timeout),
        }
    stem = f"litert_runtime_{args.model.replace('.', '_')}"
    paths = report.write(results, args.out, stem=stem, markdown=to_markdown)
    sys.stdout.write(to_markdown(results) + f"\n{paths[0]}\n")


if __name__ == "__main__":
    main()
