"""Where an ONNX generator's time goes: `python -m benchmarks.onnx_profile`.

Runs two greedy requests through an exported generator
(`export_generator(..., "onnx")`) in ONNX Runtime with
`SessionOptions.enable_profiling` and sums the second one's kernel events:
the kernels run per new token in the `Loop` body, and the time by op type,
in the body and outside it (the prompt pass and what runs once per
request). Kernel times overlap with thread-pool waits and inflate on a
busy machine: read them as shares of one request.

    python -m benchmarks.onnx_profile FILE.onnx [--batch 1] [--prompt 16] \\
        [--new 64] [--vocabulary 32000] [--spinning 0]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import tempfile

import numpy as np

from benchmarks.generation import greedy_request


def body_nodes(path: str) -> set[str]:
    """The names of the nodes in the model's `Loop` bodies (any depth)."""
    import onnx

    names: set[str] = set()

    def walk(graph, inside):
        for node in graph.node:
            if inside:
                names.add(node.name)
            for attribute in node.attribute:
                for inner in [
                    *attribute.graphs,
                    *([attribute.g] * attribute.HasField("g")),
                ]:
                    walk(inner, inside or node.op_type == "Loop")

    walk(onnx.load(path, load_external_data=False).graph, False)
    return names


def profile(path: str, request: dict, spinning: bool = True) -> list[dict]:
    """The kernel events ("Node" events ending in `_kernel_time`) of the
    second of two requests."""
    import onnxruntime

    options = onnxruntime.SessionOptions()
    if not spinning:
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.enable_profiling = True
    options.profile_file_prefix = os.path.join(tempfile.mkdtemp(), "profile")
    session = onnxruntime.InferenceSession(path, options)
    session.run(None, request)  # warm: prepacking, allocations
    session.run(None, request)
    with open(session.end_profiling()) as file:
        events = json.load(file)
    kernels = [
        e
        for e in events
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")
    ]
    # The second request's events: the last half of each node's runs.
    half = len(kernels) // 2
    return kernels[half:]


def summary(path: str, events: list[dict], new: int) -> dict:
    """Kernels per token and milliseconds by op type, body and outside.

    A body node is one of the file's `Loop` bodies, or one that ran more
    than once in the request: ONNX Runtime renames the nodes of an `If`
    it folds into the body when the session loads (an int8 layer's
    choice of kernel)."""
    body = body_nodes(path)
    names = [event["name"][: -len("_kernel_time")] for event in events]
    body |= {name for name, count in collections.Counter(names).items() if count > 1}
    runs = collections.Counter()
    times: dict[str, collections.Counter] = {
        "body": collections.Counter(),
        "outside": collections.Counter(),
    }
    for event in events:
        node = event["name"][: -len("_kernel_time")]
        where = "body" if node in body else "outside"
        op = event.get("args", {}).get("op_name", "?")
        runs[where] += 1
        times[where][op] += event["dur"] / 1000.0
    return {
        "kernels_per_token": runs["body"] / max(new - 1, 1),
        "kernels_outside_the_loop": runs["outside"],
        "body_ms_per_token": sum(times["body"].values()) / max(new - 1, 1),
        "outside_ms": sum(times["outside"].values()),
        "body_ms_by_op": dict(times["body"].most_common(15)),
        "outside_ms_by_op": dict(times["outside"].most_common(10)),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--vocabulary", type=int, default=32000)
    parser.add_argument("--spinning", type=int, default=1)
    args = parser.parse_args(argv)
    prompts = np.random.default_rng(0).integers(
        4, args.vocabulary, (args.batch, args.prompt)
    )
    request = greedy_request(prompts.astype(np.int32), args.new, args.vocabulary)
    events = profile(args.path, request, bool(args.spinning))
    print(json.dumps(summary(args.path, events, args.new), indent=1))


if __name__ == "__main__":
    main()
