"""Per-op time of one forward pass: `python -m benchmarks.profile_ops`.

Freezes the layer's tf.function, runs it in a TF1 session with full tracing
(after Grappler and oneDNN rewrites, so fused kernels show as such) and sums
each op's time over several runs. Op times overlap and inflate on a busy
machine: read them as shares of one run, not as wall-clock.

Usage:
    python -m benchmarks.profile_ops [--shape B,T,F] [--mask none|padding|causal]
"""

from __future__ import annotations

import argparse
import collections
from collections.abc import Callable

import tensorflow as tf
from tensorflow.python.framework.convert_to_constants import (
    convert_variables_to_constants_v2,
)

from benchmarks import cases

_SKIPPED = {"Const", "_Arg", "_Retval", "NoOp", "Identity", "Reshape"}


def op_times(
    fn: Callable, inputs: list, runs: int = 10
) -> list[tuple[str, str, float]]:
    """[(node name, op type, milliseconds per run)], slowest first."""
    specs = [tf.TensorSpec(x.shape, x.dtype) for x in inputs]
    frozen = convert_variables_to_constants_v2(
        tf.function(fn, autograph=False).get_concrete_function(*specs)
    )
    graph = tf.Graph()
    with graph.as_default():
        placeholders = [tf.compat.v1.placeholder(s.dtype, s.shape) for s in specs]
        outputs = tf.graph_util.import_graph_def(
            frozen.graph.as_graph_def(),
            input_map={
                t.name: p for t, p in zip(frozen.inputs, placeholders, strict=True)
            },
            return_elements=[t.name for t in frozen.outputs],
            name="",
        )
    feed = dict(zip(placeholders, inputs, strict=True))
    totals: collections.Counter = collections.Counter()
    with tf.compat.v1.Session(graph=graph) as session:
        for _ in range(3):
            session.run(outputs, feed)
        options = tf.compat.v1.RunOptions(
            trace_level=tf.compat.v1.RunOptions.FULL_TRACE
        )
        for _ in range(runs):
            metadata = tf.compat.v1.RunMetadata()
            session.run(outputs, feed, options=options, run_metadata=metadata)
            for device in metadata.step_stats.dev_stats:
                for node in device.node_stats:
                    label = node.timeline_label
                    op = label.split(" = ")[-1].split("(")[0] if " = " in label else ""
                    if op and op not in _SKIPPED:
                        totals[(node.node_name, op)] += node.all_end_rel_micros
    return [(name, op, us / runs / 1e3) for (name, op), us in totals.most_common()]


def _print(title: str, rows: list[tuple[str, str, float]], top: int = 15) -> None:
    total = sum(ms for _, _, ms in rows)
    print(f"== {title}: {total:.2f} ms summed over ops")
    for name, op, ms in rows[:top]:
        print(f"{ms:8.2f} ms {100 * ms / total:5.1f}%  {op:<24} {name}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="2,1024,256", help="B,T,F")
    parser.add_argument("--mask", default="none", choices=cases.MASK_KINDS)
    args = parser.parse_args(argv)
    shape = cases.Shape(*(int(v) for v in args.shape.split(",")))
    causal = args.mask == "causal"
    ours, mha = cases.build_layers(shape, cases.AttentionConfig(), causal=causal)
    x = cases.random_input(shape).numpy()
    if args.mask == "padding":
        mask = cases.padding_mask(shape).numpy()
        _print("SelfAttention", op_times(lambda x, m: ours(x, mask=m), [x, mask]))
        _print(
            "MultiHeadAttention",
            op_times(lambda x, m: mha(x, x, query_mask=m, value_mask=m), [x, mask]),
        )
        return
    _print("SelfAttention", op_times(lambda x: ours(x), [x]))
    _print(
        "MultiHeadAttention",
        op_times(lambda x: mha(x, x, use_causal_mask=causal), [x]),
    )


if __name__ == "__main__":
    main()
