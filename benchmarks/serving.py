"""TF Serving's SavedModel: SelfAttention's against MultiHeadAttention's, onnxruntime.

Usage:
    python -m benchmarks.serving [--quick] [--out DIR] [--rounds N]

One SelfAttention(num_heads=4, key_dim=64, output_dim=256, use_bias=True)
and a MultiHeadAttention with the same weights (`cases.build_layers`), each
alone behind `keras.Input((None, 256), name="x")`, are exported: SelfAttention
with `keras_selfattn.export.export_saved_model` (as it is, and with
`jit_compile=True`) and `export_onnx` (tf2onnx), MultiHeadAttention with
Keras's own `model.export`. Each artifact runs in its runtime
(`keras_selfattn_runtimes`: the SavedModels' `serving_default`
signature, an onnxruntime CPU session with its default options), timed
interleaved at every (batch, time), in two settings of TF Serving:

- `--xla_cpu_compilation_enabled=true` first (XLA left on in this process),
  where the `jit_compile` SavedModel runs (also at (1, 16), where per-op
  overhead outweighs the matmuls);
- its default after (XLA disabled in this process, as TF Serving disables it
  on a CPU: `runtimes.load(..., tf_serving=True)`), where the issue's
  targets are judged at (8, 128) and (8, 512): SelfAttention's SavedModel
  in at most MultiHeadAttention's time and within 1.25x onnxruntime's.

A ratio is the median over rounds of SelfAttention's SavedModel's time over
the row's time in the same round (< 1: the SavedModel is faster), with its
quartiles over the rounds (the noise). The error
is the max abs difference from SelfAttention's eager Keras call. The graph
table counts the nodes of each SavedModel's signature (its graph and the
functions it calls, as the issue counted them) and those it runs (reachable
from its outputs), with the op types it runs. Needs the TensorFlow backend.
Writes DIR/serving.json and DIR/serving.md (default DIR: benchmarks/results).
"""

from __future__ import annotations

import collections
import dataclasses
import os
import tempfile
import time

import numpy as np

from benchmarks import cases, machine, report, timing
from benchmarks.timing import interleave

SAVED_MODEL = "saved_model"
SAVED_MODEL_XLA = "saved_model_jit_compile"
MHA = "mha_saved_model"
ONNX = "onnx"
# (setting, its candidates, whether XLA is disabled as TF Serving does)
SETTINGS = (
    ("--xla_cpu_compilation_enabled=true", (SAVED_MODEL, SAVED_MODEL_XLA, MHA, ONNX)),
    ("default (XLA off)", (SAVED_MODEL, MHA, ONNX)),
)
# What the SavedModel's time may be, at most, over each candidate's
# (issue 46), in TF Serving's default setting.
TARGETS = {MHA: 1.0, ONNX: 1.25}
COLUMNS = [
    ("setting", "TF Serving"),
    ("shape", "(batch, time)"),
    ("runtime", "runtime"),
    ("ms", "ms / call"),
    ("saved_model_time_ratio", "SavedModel time / its time"),
    ("ratio_q1", "q1"),
    ("ratio_q3", "q3"),
    ("max_abs_error", "max abs error vs Keras"),
]
GRAPH_COLUMNS = [
    ("artifact", "SavedModel"),
    ("nodes", "nodes"),
    ("live_nodes", "nodes run"),
    ("live_ops", "ops run (Const, Identity, NoOp left out)"),
]
_NOT_COUNTED = {"Const", "Identity", "NoOp", "Placeholder", "_Arg", "_Retval"}


@dataclasses.dataclass(frozen=True)
class Plan(timing.Plan):
    """The layers, their input's features and the shapes the targets are
    judged at, with what `timing.Plan` times."""

    config: cases.AttentionConfig
    features: int
    judged: list[tuple[int, int]]


FULL = Plan(
    cases.AttentionConfig(num_heads=4, key_dim=64, output_dim=256),
    256,
    [(8, 128), (8, 512)],
    shapes=[(1, 16), (8, 128), (8, 512)],
    rounds=25,
    min_round_s=0.1,
)
QUICK = Plan(
    cases.AttentionConfig(num_heads=2, key_dim=8, output_dim=16),
    16,
    [(2, 16)],
    shapes=[(2, 16)],
    rounds=2,
    min_round_s=0.0,
)
# The help of `--quick` and `--rounds`.
_HELPS = {"quick": "tiny sizes, 2 rounds", "rounds": "rounds per shape"}


def models(plan: Plan) -> dict:
    """{"ours": SelfAttention's model, "mha": MultiHeadAttention's}, same
    weights, each `keras.Input((None, features), name="x")` -> the layer."""
    import keras

    ours, mha = cases.build_layers(cases.Shape(1, 1, plan.features), plan.config)
    built = {}
    for name, apply in (("ours", ours), ("mha", lambda x: mha(x, x))):
        inputs = keras.Input((None, plan.features), name="x")
        built[name] = keras.Model(inputs, apply(inputs), name=name)
    return built


def export_all(built: dict, directory: str) -> dict[str, str]:
    """Each candidate's artifact written into `directory`: its path."""
    from keras_selfattn.export import export_onnx, export_saved_model

    ours = built["ours"]
    paths = {
        SAVED_MODEL: export_saved_model(
            ours, directory, "ours", 1, models_config=False, check=False
        ),
        SAVED_MODEL_XLA: export_saved_model(
            ours,
            directory,
            "ours_xla",
            1,
            models_config=False,
            check=False,
            jit_compile=True,
        ),
        MHA: os.path.join(directory, "mha", "1"),
        ONNX: export_onnx(ours, os.path.join(directory, "ours.onnx"), check=False),
    }
    built["mha"].export(paths[MHA], verbose=False)
    return paths


def graph_nodes(path: str) -> dict:
    """The nodes of a SavedModel's `serving_default`: every node of its graph
    and of the functions it calls (`nodes`), those reachable from its
    outputs (`live_nodes`), and their op types (`live_ops`, without
    Const, Identity, NoOp and arguments)."""
    import tensorflow as tf

    function = tf.saved_model.load(path).signatures["serving_default"]
    graph = function.graph.as_graph_def()
    library = {f.signature.name: f for f in graph.library.function}
    every = collections.Counter()
    live = collections.Counter()
    walked = set()

    def walk(nodes, outputs) -> None:
        every.update(node.op for node in nodes)
        by_name = {node.name: node for node in nodes}
        stack, seen = list(outputs), set()
        while stack:
            name = stack.pop().lstrip("^").split(":")[0]
            if name in seen or name not in by_name:
                continue
            seen.add(name)
            node = by_name[name]
            live[node.op] += 1
            stack.extend(node.input)
            for value in node.attr.values():
                called = value.func.name
                if called in library and called not in walked:
                    walked.add(called)
                    body = library[called]
                    walk(
                        body.node_def,
                        [*body.ret.values(), *body.control_ret.values()],
                    )

    walk(graph.node, [tensor.name for tensor in function.outputs])
    ops = sorted(
        ((op, n) for op, n in live.items() if op not in _NOT_COUNTED),
        key=lambda item: (-item[1], item[0]),
    )
    return {
        "nodes": sum(every.values()),
        "live_nodes": sum(live.values()),
        "live_ops": ", ".join(f"{op} {n}" for op, n in ops),
    }


def _calls(paths: dict[str, str], names, tf_serving: bool) -> dict:
    """numpy -> numpy callables of the candidates `names` (`tf_serving`: XLA
    disabled in this process as TF Serving does)."""
    import keras_selfattn_runtimes as runtimes

    calls = {}
    for name in names:
        if name == ONNX:
            loaded = runtimes.load("onnx", paths[name])
        else:
            loaded = runtimes.load("saved_model", paths[name], tf_serving=tf_serving)
        (output,) = loaded.output_names
        calls[name] = lambda x, loaded=loaded, output=output: loaded({"x": x})[output]
    return calls


def _rows(setting: str, calls: dict, model, plan: Plan) -> list[dict]:
    rows = []
    for batch, time_steps in plan.shapes:
        rng = np.random.default_rng(batch * 1009 + time_steps)
        x = rng.normal(size=(batch, time_steps, plan.features)).astype(np.float32)
        reference = np.asarray(model(x))
        errors = {
            name: float(np.max(np.abs(call(x) - reference)))
            for name, call in calls.items()
        }
        result = interleave(
            {name: (lambda call=call, x=x: call(x)) for name, call in calls.items()},
            rounds=plan.rounds,
            min_round_s=plan.min_round_s,
        )
        for name in calls:
            q1, q3 = result.quartiles(SAVED_MODEL, name)
            rows.append(
                {
                    "setting": setting,
                    "shape": f"({batch}, {time_steps})",
                    "runtime": name,
                    "ms": 1e3 * result.median(name),
                    "saved_model_time_ratio": result.speedup(SAVED_MODEL, name),
                    "ratio_q1": q1,
                    "ratio_q3": q3,
                    "max_abs_error": errors[name],
                    "rounds": plan.rounds,
                }
            )
    return rows


def targets(rows: list[dict], shapes: list[str]) -> list[dict]:
    """Issue 46's targets, judged in TF Serving's default setting."""
    found = []
    for shape in shapes:
        for name, threshold in TARGETS.items():
            row = next(
                (
                    r
                    for r in rows
                    if r["setting"] == SETTINGS[1][0]
                    and r["shape"] == shape
                    and r["runtime"] == name
                ),
                None,
            )
            value = None if row is None else row["saved_model_time_ratio"]
            found.append(
                {
                    "target": f"{shape}: SavedModel time / {name}'s",
                    "threshold": f"<= {threshold}",
                    "value": value,
                    "met": value is not None and value <= threshold,
                }
            )
    return found


def run(quick: bool = False, rounds: int | None = None) -> dict:
    """Exports the pair once and times the candidates in both settings at
    every shape of the plan (`quick`: QUICK's, else FULL's; `rounds`:
    `report.plan`).

    Returns:
        {"machine", "mode", "plan", "rounds", "seconds", "graphs", "rows",
        "targets"}.
    """
    report.require_tensorflow("serving", "SavedModel and TF Serving's XLA setting")
    plan = report.plan(QUICK, FULL, quick, rounds)
    start = time.perf_counter()
    built = models(plan)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as directory:
        paths = export_all(built, directory)
        export_s = time.perf_counter() - start
        graphs = [
            {"artifact": name, **graph_nodes(paths[name])}
            for name in (SAVED_MODEL, SAVED_MODEL_XLA, MHA)
        ]
        # XLA on first: once a SavedModel is loaded as TF Serving runs it by
        # default, XLA stays disabled in this process.
        for setting, names in SETTINGS:
            tf_serving = SAVED_MODEL_XLA not in names
            calls = _calls(paths, names, tf_serving)
            rows += _rows(setting, calls, built["ours"], plan)
    shapes = [f"({b}, {t})" for b, t in plan.judged]
    return {
        "machine": machine.describe(),
        "mode": "quick" if quick else "full",
        "plan": {"features": plan.features, **dataclasses.asdict(plan.config)},
        "rounds": plan.rounds,
        "export_seconds": export_s,
        "seconds": time.perf_counter() - start,
        "graphs": graphs,
        "rows": rows,
        "targets": targets(rows, shapes),
    }


def to_markdown(results: dict) -> str:
    """The run as Markdown: machine, method, the graphs, the times, targets."""
    m, p = results["machine"], results["plan"]
    lines = [
        "# TF Serving's SavedModel",
        "",
        f"- Machine: {m['cpu']} ({', '.join(m['vnni'] or ['no VNNI'])}), "
        f"{m['cores']} cores, {m['memory_gib']} GiB (load "
        f"average {m['load_average_1_5_15min']}), {m['os']}",
        f"- Software: Python {m['python']}, TensorFlow {m['tensorflow']}, Keras "
        f"{m['keras']}, onnxruntime {m['onnxruntime']}",
        f"- Date: {m['date_utc']}, commit {m['git_commit']}; mode: "
        f"{results['mode']}; {results['rounds']} rounds; exports "
        f"{results['export_seconds']:.0f} s, total {results['seconds']:.0f} s",
        f"- Model: `keras.Input((None, {p['features']}))` -> SelfAttention("
        f"num_heads={p['num_heads']}, key_dim={p['key_dim']}, output_dim="
        f"{p['output_dim']}, use_bias=True), and MultiHeadAttention("
        f"{p['num_heads']}, {p['key_dim']}) with the same weights (Keras's "
        "`model.export`). Ratio: median over rounds "
        "of SelfAttention's SavedModel's time / the row's, same round (< 1: the "
        "SavedModel is faster); error: max abs vs SelfAttention's Keras call.",
        "",
        "## Serving graphs",
        "",
        *report.table(GRAPH_COLUMNS, results["graphs"]),
        "",
        "## Times",
        "",
        *report.table(COLUMNS, results["rows"]),
        "",
        "## Targets (TF Serving's default setting)",
        "",
        *report.table(
            [
                ("target", "target"),
                ("threshold", "threshold"),
                ("value", "value"),
                (lambda t: "yes" if t["met"] else "no", "met"),
            ],
            results["targets"],
        ),
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    report.main(__doc__, run, to_markdown, "serving", _HELPS)
