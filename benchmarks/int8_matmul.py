"""int8 matmul schemes on ONNX Runtime: one matmul, the whole layer, its ops.

Usage:
    python -m benchmarks.int8_matmul [--quick] [--out DIR] [--rounds N]

Three sections, each at one thread and at ONNX Runtime's default thread
count, sessions without spin-waiting between calls (as
`benchmarks.quantized` runs them):

- matmul: one M x K by K x N product (1024 x 512 x 1536) on Keras's int8
  integers (activations q and kernel W both -127 to 127, drawn uniformly),
  by each way of running it on ONNX Runtime's integer kernels, all in
  `MatMulIntegerToFloat`: q + 128 times W (uint8 x int8, zero point 128:
  the default ONNX file's matmul where its probe finds the kernel exact,
  and the no-probe file's), q + 128 times W + 128 (uint8 x uint8, zero
  points 128: the default's elsewhere), the earlier default's split
  (max(q, 0) and max(-q, 0) side by side times [W; -W], uint8 x int8, K
  doubled), int8 x int8; and float `MatMul` (the float file's op).
  `quantize_dynamic`'s op (`DynamicQuantizeMatMul`: float activations in,
  quantized per tensor inside) is timed with the float input. "exact"
  compares the integer sums with numpy's (int64): a kernel that saturates
  computes other numbers.
- layer: the model of `benchmarks.quantized` (D = 512, 8 heads) exported to
  ONNX float, int8 (default), and `quantize_dynamic` of the float file,
  the default file with each `If` replaced by its uint8 x int8 branch (no
  probe: what the deprecated `int8_matmul="vnni"` wrote; wrong on x86 CPUs
  without VNNI or AMX) and with its probe made to fail (what CPUs without
  VNNI or AMX run: uint8 x uint8), timed interleaved at (8, 128)
  and (2, 512); the error is against the quantized Keras model.
- ops: where each file's time goes, from ONNX Runtime's profiler (one
  thread): milliseconds per call by op type.

Timings interleave the candidates (A B C ... C B A ...); ratios are medians
of per-round ratios. The rows name the CPU's integer features (AVX2, VNNI,
AMX). The layer and ops sections need the TensorFlow backend. Writes
DIR/int8_matmul.json and DIR/int8_matmul.md (default DIR:
benchmarks/results).
"""

from __future__ import annotations

import collections
import json
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from benchmarks import machine, quantized, report, timing
from benchmarks.timing import interleave

SIGNED, UNSIGNED = "uint8 x int8", "uint8 x uint8"
SPLIT = "split, K doubled"
DYNAMIC = "DynamicQuantizeMatMul (float in)"
NO_PROBE = "int8 no probe"
FILES = ("float", "int8", NO_PROBE, "int8 probe failed", quantized.ANCHOR)
# The default file's probe: the exact sums it expects of the machine's kernel.
PROBED = "int8_probe_exact"
THREADS = (1, 0)  # 0: ONNX Runtime's default (one per core)


def _cell(key: str, form: str) -> Callable[[dict], str]:
    """A table cell: the row's `key` written as `form`, blank where absent."""
    return lambda row: "" if row.get(key) is None else form.format(row[key])


MATMUL_COLUMNS = [
    ("threads", "threads"),
    ("scheme", "scheme"),
    ("operands", "operands"),
    (_cell("ms", "{:.2f}"), "ms / call"),
    (_cell("vs_float", "{:.2f}x"), "speedup vs float"),
    (_cell("vs_signed", "{:.2f}x"), "time / uint8 x int8's"),
    ("exact", "exact"),
    ("cpu_features", "CPU"),
]
LAYER_COLUMNS = [
    ("shape", "(batch, time)"),
    ("threads", "threads"),
    ("file", "ONNX file"),
    (_cell("ms", "{:.2f}"), "ms / call"),
    (_cell("vs_float", "{:.2f}x"), "speedup vs float"),
    (_cell("vs_anchor", "{:.2f}x"), "time / quantize_dynamic's"),
    (lambda row: f"{row['max_abs_diff']:.1e}", "max abs diff vs int8 Keras"),
    ("cpu_features", "CPU"),
]


@dataclass(frozen=True)
class Plan(timing.Plan):
    """The matmul's M x K x N, the layer's width and the calls profiled, with
    what `timing.Plan` times (the layer's shapes)."""

    mkn: tuple[int, int, int]
    d_model: int
    profiled_calls: int


FULL = Plan(
    (1024, 512, 1536), 512, 30, shapes=[(8, 128), (2, 512)], rounds=25, min_round_s=0.1
)
QUICK = Plan((64, 64, 96), 128, 2, shapes=[(2, 16)], rounds=2, min_round_s=0.0)
# The help of `--quick` and `--rounds`.
_HELPS = {"quick": "tiny sizes, 2 rounds", "rounds": "rounds per table"}


def session(model, threads: int, profile_prefix: str | None = None):
    """An ONNX Runtime CPU session (a path or serialized bytes) that does not
    spin between calls; `threads` 0: the default count."""
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.intra_op_num_threads = threads
    if profile_prefix is not None:
        options.enable_profiling = True
        options.profile_file_prefix = profile_prefix
    return onnxruntime.InferenceSession(
        model, options, providers=["CPUExecutionProvider"]
    )


def _single_op(op: str, inputs: dict, constants: dict, domain: str = "") -> bytes:
    """A model of one node: `inputs` name -> array (graph inputs, in order
    first), `constants` name -> array (initializers); output "y"."""
    from onnx import TensorProto, helper, numpy_helper

    names = [*inputs, *constants]
    node = helper.make_node(op, names, ["y"], domain=domain)
    graph = helper.make_graph(
        [node],
        op,
        [
            helper.make_tensor_value_info(
                name, helper.np_dtype_to_tensor_dtype(value.dtype), value.shape
            )
            for name, value in inputs.items()
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(value, name) for name, value in constants.items()],
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets).SerializeToString()


def matmul_models(q: np.ndarray, w: np.ndarray) -> dict:
    """scheme -> (serialized model, its input); each computes q @ w (the
    integer ones as float, per-column scale 1, so the sums are exact in
    float32 up to 2**24)."""
    n = w.shape[1]
    unit = {"a_scale": np.float32(1.0), "b_scale": np.ones(n, np.float32)}
    shifted = (q.astype(np.int16) + 128).astype(np.uint8)
    operands = {
        SIGNED: (shifted, w, np.uint8(128), np.int8(0)),
        UNSIGNED: (
            shifted,
            (w.astype(np.int16) + 128).astype(np.uint8),
            np.uint8(128),
            np.uint8(128),
        ),
        SPLIT: (
            np.concatenate([np.maximum(q, 0), np.maximum(-q, 0)], 1).astype(np.uint8),
            np.concatenate([w, -w], 0),
            np.uint8(0),
            np.int8(0),
        ),
        "int8 x int8": (q, w, np.int8(0), np.int8(0)),
    }
    models = {}
    for scheme, (a, b, a_zero, b_zero) in operands.items():
        constants = {"b": b, **unit, "a_zero": a_zero, "b_zero": b_zero}
        models[scheme] = (
            _single_op("MatMulIntegerToFloat", {"a": a}, constants, "com.microsoft"),
            a,
        )
    x = q.astype(np.float32)
    models["float MatMul"] = (
        _single_op("MatMul", {"a": x}, {"b": w.astype(np.float32)}),
        x,
    )
    dynamic = {"b": w, "b_scale": np.float32(1.0), "b_zero": np.int8(0)}
    models[DYNAMIC] = (
        _single_op("DynamicQuantizeMatMul", {"a": x}, dynamic, "com.microsoft"),
        x,
    )
    return models


OPERANDS = {
    SIGNED: "q + 128 x W, zero point 128 (default where exact; no-probe file)",
    UNSIGNED: "q + 128 x W + 128, zero points 128 (default elsewhere)",
    SPLIT: "uint8 (M, 2K) x int8 (2K, N) (the default before)",
    "int8 x int8": "int8 x int8",
    "float MatMul": "float32",
    DYNAMIC: "float32 in, uint8 per tensor x int8",
}


def matmul_rows(plan: Plan, features: str) -> list[dict]:
    """The matmul section: every scheme at each thread count."""
    m, k, n = plan.mkn
    rng = np.random.default_rng(0)
    q = rng.integers(-127, 128, (m, k)).astype(np.int8)
    w = rng.integers(-127, 128, (k, n)).astype(np.int8)
    expected = (q.astype(np.int64) @ w.astype(np.int64)).astype(np.float64)
    models = matmul_models(q, w)
    rows = []
    for threads in THREADS:
        calls, exact = {}, {}
        for scheme, (model, a) in models.items():
            s = session(model, threads)
            calls[scheme] = lambda s=s, a=a: s.run(None, {"a": a})
            if scheme != DYNAMIC:
                exact[scheme] = bool(np.array_equal(calls[scheme]()[0], expected))
        result = interleave(calls, rounds=plan.rounds, min_round_s=plan.min_round_s)
        for scheme in models:
            rows.append(
                {
                    "threads": threads or "default",
                    "scheme": scheme,
                    "operands": OPERANDS[scheme],
                    "ms": 1e3 * result.median(scheme),
                    "vs_float": result.speedup("float MatMul", scheme),
                    "vs_signed": result.speedup(scheme, SIGNED),
                    "exact": {True: "yes", False: "no"}.get(exact.get(scheme), "n/a"),
                    "cpu_features": features,
                }
            )
    return rows


def export_files(by_precision: dict, directory: str) -> dict[str, str]:
    """The ONNX files of `FILES`, by name (the default ones checked, the
    two made from the default file not)."""
    import onnx
    from onnx import numpy_helper
    from onnxruntime.quantization import QuantType, quantize_dynamic

    from keras_selfattn import export

    path = {name: os.path.join(directory, f"{name}.onnx") for name in FILES}
    export.export_onnx(by_precision["float"], path["float"])
    export.export_onnx(by_precision["int8"], path["int8"])
    quantize_dynamic(path["float"], path[quantized.ANCHOR], weight_type=QuantType.QInt8)
    proto = onnx.load(path["int8"])
    for tensor in proto.graph.initializer:
        if tensor.name == PROBED:  # an exact sum no kernel computes: the If's else
            wrong = numpy_helper.to_array(tensor) + 1
            tensor.CopyFrom(numpy_helper.from_array(wrong, tensor.name))
    onnx.save(proto, path["int8 probe failed"])
    onnx.save(_without_probe(onnx.load(path["int8"])), path[NO_PROBE])
    return path


def _without_probe(proto):
    """`proto` with each `If` replaced by its then branch (uint8 x int8, the
    kernel the probe asks about), its output renamed to the `If`'s; the
    probe is left unread."""
    nodes = []
    for node in proto.graph.node:
        if node.op_type != "If":
            nodes.append(node)
            continue
        branch = next(a.g for a in node.attribute if a.name == "then_branch")
        inner = list(branch.node)
        inner[-1].output[0] = node.output[0]
        nodes.extend(inner)
    del proto.graph.node[:]
    proto.graph.node.extend(nodes)
    return proto


def layer_rows(paths: dict, keras_int8, plan: Plan, features: str) -> list[dict]:
    """The layer section: the files interleaved per shape and thread count."""
    rows = []
    for batch, time_steps in plan.shapes:
        rng = np.random.default_rng(batch * 10007 + time_steps)
        x = rng.standard_normal((batch, time_steps, plan.d_model)).astype(np.float32)
        expected = np.asarray(keras_int8.predict_on_batch(x))
        for threads in THREADS:
            sessions = {name: session(path, threads) for name, path in paths.items()}
            calls: dict[str, Callable] = {
                name: (lambda s=s, x=x: s.run(None, {"x": x})[0])
                for name, s in sessions.items()
            }
            errors = {
                n: float(np.max(np.abs(c() - expected))) for n, c in calls.items()
            }
            result = interleave(calls, rounds=plan.rounds, min_round_s=plan.min_round_s)
            for name in paths:
                rows.append(
                    {
                        "shape": f"({batch}, {time_steps})",
                        "threads": threads or "default",
                        "file": name,
                        "ms": 1e3 * result.median(name),
                        "vs_float": result.speedup("float", name),
                        "vs_anchor": result.speedup(name, quantized.ANCHOR),
                        "max_abs_diff": errors[name],
                        "cpu_features": features,
                    }
                )
    return rows


def op_profile(path: str, x: np.ndarray, calls: int, directory: str) -> dict:
    """op type -> milliseconds per call, from ONNX Runtime's profiler (one
    thread)."""
    s = session(path, 1, os.path.join(directory, "profile"))
    for _ in range(calls):
        s.run(None, {"x": x})
    trace = s.end_profiling()
    with open(trace, encoding="utf-8") as handle:
        events = json.load(handle)
    os.remove(trace)
    by_op: collections.Counter = collections.Counter()
    for event in events:
        if event.get("cat") == "Node" and event["name"].endswith("_kernel_time"):
            by_op[event["args"]["op_name"]] += event["dur"] / 1e3 / calls
    return dict(by_op)


def ops_rows(paths: dict, plan: Plan, directory: str) -> list[dict]:
    """The ops section at the last shape: one row per op type, a column per
    file (ms per call), the largest first, then the totals."""
    batch, time_steps = plan.shapes[-1]
    x = np.random.default_rng(0).standard_normal((batch, time_steps, plan.d_model))
    x = x.astype(np.float32)
    profiles = {
        name: op_profile(path, x, plan.profiled_calls, directory)
        for name, path in paths.items()
    }
    ops = sorted(
        {op for p in profiles.values() for op in p},
        key=lambda op: -max(p.get(op, 0.0) for p in profiles.values()),
    )
    rows = [
        {"op": op, **{n: p.get(op, 0.0) for n, p in profiles.items()}} for op in ops
    ]
    rows.append({"op": "total", **{n: sum(p.values()) for n, p in profiles.items()}})
    return rows


def run(quick: bool = False, rounds: int | None = None) -> dict:
    """The three sections (`quick`: tiny sizes, two rounds).

    Returns:
        {"machine", "mode", "plan", "seconds", "matmul", "layer", "ops"}.
    """
    report.require_tensorflow("int8_matmul", "its ONNX export")
    plan = report.plan(QUICK, FULL, quick, rounds)
    start = time.perf_counter()
    features = ", ".join(quantized.cpu_features() or ["unknown"]) or "none"
    matmul = matmul_rows(plan, features)
    by_precision = quantized.models(plan.d_model)
    with tempfile.TemporaryDirectory() as directory:
        paths = export_files(by_precision, directory)
        layer = layer_rows(paths, by_precision["int8"], plan, features)
        ops = ops_rows(paths, plan, directory)
    return {
        "machine": machine.describe(),
        "cpu_features": features,
        "mode": "quick" if quick else "full",
        "plan": {"mkn": plan.mkn, "d_model": plan.d_model, "rounds": plan.rounds},
        "seconds": time.perf_counter() - start,
        "matmul": matmul,
        "layer": layer,
        "ops": ops,
    }


def to_markdown(results: dict) -> str:
    """The run as Markdown: machine, then one table per section."""
    m = results["machine"]
    mkn = " x ".join(str(v) for v in results["plan"]["mkn"])
    ops_columns = [("op", "op type")] + [
        (lambda row, name=name: f"{row[name]:.2f}", name) for name in FILES
    ]
    lines = [
        "# int8 matmul schemes on ONNX Runtime",
        "",
        f"- Machine: {m['cpu']}, integer features: {results['cpu_features']}, "
        f"{m['cores']} cores (load average {m['load_average_1_5_15min']}), "
        f"onnxruntime {m['onnxruntime']}",
        f"- Date: {m['date_utc']}, commit {m['git_commit']}; mode: "
        f"{results['mode']}; {results['plan']['rounds']} rounds; total "
        f"{results['seconds']:.0f} s",
        "",
        f"## One matmul, M x K x N = {mkn} (Keras's integers)",
        "",
        *report.table(MATMUL_COLUMNS, results["matmul"]),
        "",
        f"## The layer (D = {results['plan']['d_model']}, 8 heads)",
        "",
        *report.table(LAYER_COLUMNS, results["layer"]),
        "",
        "## Where the time goes: ms per call by op type (one thread, "
        f"{results['layer'][-1]['shape']})",
        "",
        *report.table(ops_columns, results["ops"]),
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    report.main(__doc__, run, to_markdown, "int8_matmul", _HELPS)
