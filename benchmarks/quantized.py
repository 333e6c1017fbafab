"""Quantized exports: float vs int8 vs int4 file size and latency per runtime.

Usage:
    python -m benchmarks.quantized [--quick] [--out DIR] [--rounds N]

`keras.Input((None, D), name="x")` -> `SelfAttention(num_heads=8,
output_dim=D)` (D = 512; seed 0) and two copies with the same weights
quantized by `model.quantize("int8")` and `model.quantize("int4")` are each
exported with `keras_selfattn.export` (SavedModel, ONNX, LiteRT, OpenVINO
IR; every export runs its own check against Keras). ONNX Runtime's
`quantize_dynamic` of the float ONNX file (int8 weights) is the anchor row.
An export that fails says so in its row; the others still run. Then, at
each (batch, time), every artifact is loaded in this one process and timed
interleaved (A B C ... C B A ...). Ratios are medians of per-round time
ratios: within each runtime the float artifact's time over the quantized
one's (> 1: the quantized file is faster), and the int8 ONNX artifact's
time over the anchor's, from a second interleaved run of ONNX Runtime's
sessions alone (ONNX Runtime against itself, without the other runtimes'
spinning thread pools). Each row names the CPU's integer features (AVX2,
VNNI, AMX), on which the integer kernels' speed depends. OpenVINO runs at
f32 (`INFERENCE_PRECISION_HINT`; its CPU default is bf16 on CPUs with
AVX512-BF16). Nothing here asserts a target: the run reports each with its
measured value, against the issue's thresholds for this CPU's features.
Needs the TensorFlow backend. Writes DIR/quantized.json and DIR/quantized.md
(default DIR: benchmarks/results).
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from benchmarks import machine, report, timing
from benchmarks.runtimes import one_input_call
from benchmarks.timing import Interleaved, interleave

NUM_HEADS = 8
RUNTIMES = ("saved_model", "onnx", "litert", "openvino")
PRECISIONS = ("float", "int8", "int4")
# The anchor row: ONNX Runtime's own quantizer on the float ONNX file.
ANCHOR = "quantize_dynamic"
ANCHOR_SCHEME = (
    "int8 weights per tensor, uint8 activations per tensor "
    "(quantize_dynamic defaults, weight_type QInt8)"
)
# The CPU features integer kernels depend on: name -> its /proc/cpuinfo flags
# (any of them).
FEATURES = {
    "AVX2": ("avx2",),
    "VNNI": ("avx512_vnni", "avx_vnni"),
    "AMX": ("amx_int8",),
}
# runtime -> (module it needs, extra that installs it)
NEEDS = {
    "onnx": ("onnxruntime", "onnx"),
    "litert": ("ai_edge_litert", "litert"),
    "openvino": ("openvino", "openvino"),
}
# Runtimes whose exports store Keras's int4 integers as 4-bit values; the
# LiteRT converter stores int8 weights at most (its dynamic range).
STORES_INT4 = ("saved_model", "onnx", "openvino")
# The targets: int8 speedup over the runtime's float artifact (the
# ONNX and LiteRT ones on CPUs with VNNI or AMX; `WITHOUT_VNNI` elsewhere).
INT8_SPEEDUP = {"onnx": 1.3, "litert": 1.3, "openvino": 0.95, "saved_model": 1.0}
WITHOUT_VNNI = {"onnx": 0.95}
ANCHOR_TIME = 1.25  # int8 ONNX time / quantize_dynamic time, at most (VNNI, AMX)
SIZE = {"int8": 0.3, "int4": 0.2}  # file / float file, at most
FILE_COLUMNS = [
    ("runtime", "runtime"),
    ("precision", "precision"),
    ("stored_as", "stored as"),
    (lambda row: f"{row['bytes']:,}" if "bytes" in row else "", "bytes"),
    (lambda row: _ratio(row.get("size_vs_float")), "size vs float"),
    ("status", "note"),
]
LATENCY_COLUMNS = [
    ("shape", "(batch, time)"),
    ("runtime", "runtime"),
    ("precision", "precision"),
    (lambda row: _ms(row.get("ms")), "ms / call"),
    (
        lambda row: _ratio(row.get("vs_float"), row.get("vs_float_quartiles")),
        "speedup vs float (quartiles)",
    ),
    (
        lambda row: _ratio(row.get("time_vs_anchor")),
        "time / quantize_dynamic time",
    ),
    (lambda row: _error(row.get("max_abs_diff")), "max abs diff vs float Keras"),
    ("cpu_features", "CPU"),
    ("status", "note"),
]


@dataclass(frozen=True)
class Plan(timing.Plan):
    """The models' width and the shapes the targets are judged at, with what
    `timing.Plan` times."""

    d_model: int
    target_shapes: list[tuple[int, int]]


FULL = Plan(
    d_model=512,
    shapes=[(1, 16), (8, 128), (2, 512)],
    target_shapes=[(8, 128), (2, 512)],
    rounds=25,
    min_round_s=0.1,
)
QUICK = Plan(
    d_model=128, shapes=[(2, 16)], target_shapes=[(2, 16)], rounds=2, min_round_s=0.0
)
# The help of `--quick` and `--rounds`.
_HELPS = {"quick": "tiny model, 2 rounds", "rounds": "rounds per shape"}


@dataclass
class Artifact:
    """One exported file (or folder) and, once loaded, its runtime call.

    Attributes:
        runtime: "saved_model", "onnx", "litert" or "openvino".
        precision: "float", "int8", "int4", or `ANCHOR`.
        paths: the files (a SavedModel: its version folder) whose bytes count.
        status: why there is no artifact (export failed, not installed).
        stated: what the artifact says it stores and computes.
        call: numpy input -> numpy output.
    """

    runtime: str
    precision: str
    paths: list[str]
    status: str | None = None
    stated: str | None = None
    call: Callable[[np.ndarray], np.ndarray] | None = None

    @property
    def name(self) -> str:
        """The candidate's name in the interleaved timing."""
        return f"{self.runtime} {self.precision}"


def models(d_model: int) -> dict:
    """The float model and its int8 and int4 copies (same weights).

    Args:
        d_model: the input and output features.

    Returns:
        precision ("float", "int8", "int4") -> keras.Model.
    """
    import keras

    from keras_selfattn import SelfAttention

    keras.utils.set_random_seed(0)
    x = keras.Input((None, d_model), name="x")
    layer = SelfAttention(num_heads=NUM_HEADS, output_dim=d_model, name="attention")
    result = {"float": keras.Model(x, layer(x))}
    for mode in PRECISIONS[1:]:
        copy = keras.models.clone_model(result["float"])
        copy.set_weights(result["float"].get_weights())
        copy.quantize(mode)
        result[mode] = copy
    return result


def cpu_features() -> list[str] | None:
    """The `FEATURES` this CPU has, by its /proc/cpuinfo flags ([] for none);
    None when there is no x86 flags line."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            line = next(line for line in cpuinfo if line.startswith("flags"))
    except (OSError, StopIteration):
        return None
    flags = set(line.split(":", 1)[1].split())
    return [name for name, wanted in FEATURES.items() if flags.intersection(wanted)]


def _integer_dot(features: list[str] | None) -> bool:
    """Whether the CPU multiplies uint8 by int8 without saturating pairs."""
    return bool(features) and ("VNNI" in features or "AMX" in features)


def _missing(runtime: str) -> str | None:
    module, extra = NEEDS.get(runtime, (None, None))
    if module is None or importlib.util.find_spec(module) is not None:
        return None
    return f"not installed: pip install keras-selfattn[{extra}]"


def _size(paths: list[str]) -> int:
    """Total bytes of files and of the files under folders."""
    total = 0
    for path in paths:
        if os.path.isdir(path):
            for folder, _, names in os.walk(path):
                total += sum(os.path.getsize(os.path.join(folder, n)) for n in names)
        else:
            total += os.path.getsize(path)
    return total


def _export(runtime: str, model, directory: str, precision: str) -> list[str]:
    """Exports `model` (checked, as by default); returns the paths to count."""
    from keras_selfattn import export

    stem = os.path.join(directory, precision.replace(" ", "_"))
    if runtime == "saved_model":
        return [export.export_saved_model(model, directory, f"saved_model_{precision}")]
    if runtime == "onnx":
        return [export.export_onnx(model, stem + ".onnx")]
    if runtime == "litert":
        return [export.export_litert(model, stem + ".tflite")]
    xml = export.export_openvino(model, stem + ".xml")
    return [xml, xml[: -len(".xml")] + ".bin"]


def keras_rows(by_precision: dict) -> list[Artifact]:
    """The Keras models themselves (`predict_on_batch`, Keras's compiled
    call), timed with the artifacts: how Keras runs its own quantized
    layers on this CPU."""
    return [
        Artifact(
            "keras",
            precision,
            [],
            stated="Keras's own call"
            if precision == "float"
            else (f"Keras's own {precision} call"),
            call=model.predict_on_batch,
        )
        for precision, model in by_precision.items()
    ]


def export_all(by_precision: dict, directory: str) -> list[Artifact]:
    """Every runtime x precision, then the anchor; a failed export or a
    runtime that is not installed gets a status instead of paths."""
    from keras_selfattn.export import ExportError, ParityError

    artifacts = []
    for runtime in RUNTIMES:
        for precision, model in by_precision.items():
            artifact = Artifact(runtime, precision, [], status=_missing(runtime))
            if artifact.status is None:
                try:
                    artifact.paths = _export(runtime, model, directory, precision)
                except (ExportError, ParityError) as error:
                    reason = str(error).splitlines()[0]
                    artifact.status = f"not exported: {type(error).__name__}: {reason}"
            artifacts.append(artifact)
    anchor = Artifact("onnx", ANCHOR, [], status=_missing("onnx"))
    float_onnx = next(a for a in artifacts if a.name == "onnx float")
    if anchor.status is None and float_onnx.status is not None:
        anchor.status = "no float ONNX file to quantize"
    if anchor.status is None:
        from onnxruntime.quantization import QuantType, quantize_dynamic

        path = os.path.join(directory, f"{ANCHOR}.onnx")
        quantize_dynamic(float_onnx.paths[0], path, weight_type=QuantType.QInt8)
        anchor.paths = [path]
    return artifacts + [anchor]


def _load_saved_model(directory: str) -> tuple[Callable, str | None]:
    """The signature, TensorFlow's XLA as it is; stated: its description."""
    call, loaded = one_input_call("saved_model", directory, tf_serving=False)
    return call, loaded.description.get("scheme")


def _load_onnx(path: str) -> tuple[Callable, str | None]:
    """A CPU session that does not spin between calls."""
    # Its threads would spin after each call (its default), taking the two
    # cores from whichever artifact the interleaved rounds time next.
    call, loaded = one_input_call("onnx", path, spinning=False)
    return call, loaded.description.get("scheme")


def _load_litert(path: str) -> tuple[Callable, str | None]:
    """The signature runner; stated: its int8 weight matrices (LiteRT files
    carry no statement of their own)."""
    call, loaded = one_input_call("litert", path)
    matrices = loaded.int8_matrices
    stated = f"{matrices} int8 weight matrices (dynamic range)" if matrices else None
    return call, stated


def _load_openvino(path: str) -> tuple[Callable, str | None]:
    """Compiled for the CPU at f32."""
    call, loaded = one_input_call("openvino", path, precision="f32")
    return call, loaded.description.get("scheme")


LOADERS = {
    "saved_model": _load_saved_model,
    "onnx": _load_onnx,
    "litert": _load_litert,
    "openvino": _load_openvino,
}


def load(artifact: Artifact) -> None:
    """Sets the artifact's call and statement (float: "float32")."""
    artifact.call, stated = LOADERS[artifact.runtime](artifact.paths[0])
    if artifact.precision == ANCHOR:
        stated = ANCHOR_SCHEME
    artifact.stated = stated or "float32"


def file_rows(artifacts: list[Artifact]) -> list[dict]:
    """Bytes and size vs the runtime's float artifact, one row per artifact."""
    sizes = {a.name: _size(a.paths) for a in artifacts if a.status is None}
    rows = []
    for artifact in artifacts:
        row = {"runtime": artifact.runtime, "precision": artifact.precision}
        if artifact.status is not None:
            rows.append({**row, "status": artifact.status})
            continue
        row.update(bytes=sizes[artifact.name], stored_as=artifact.stated)
        float_size = sizes.get(f"{artifact.runtime} float")
        if artifact.precision != "float" and float_size:
            row["size_vs_float"] = sizes[artifact.name] / float_size
        rows.append(row)
    return rows


def _latency_row(
    artifact: Artifact,
    result: Interleaved,
    names: set[str],
    onnx_only: Interleaved | None,
) -> dict:
    """Median, speedup vs its runtime's float artifact (from `result`, all
    runtimes interleaved) and, for the int8 ONNX file, its time over the
    anchor's (from `onnx_only`, ONNX Runtime's sessions alone)."""
    row: dict = {"ms": 1e3 * result.median(artifact.name)}
    baseline = f"{artifact.runtime} float"
    if artifact.precision != "float" and baseline in names:
        row["vs_float"] = result.speedup(baseline, artifact.name)
        row["vs_float_quartiles"] = list(result.quartiles(baseline, artifact.name))
    anchor = f"onnx {ANCHOR}"
    if artifact.name == "onnx int8" and onnx_only is not None:
        row["time_vs_anchor"] = onnx_only.speedup(artifact.name, anchor)
    return row


def latency_rows(
    artifacts: list[Artifact], reference, shape: tuple[int, int], plan: Plan
) -> list[dict]:
    """Every loaded artifact timed interleaved at `shape`; the error is the
    max abs difference from the float Keras model."""
    rng = np.random.default_rng(shape[0] * 10007 + shape[1])
    x = rng.standard_normal((*shape, plan.d_model)).astype(np.float32)
    expected = np.asarray(reference(x))
    loaded = [a for a in artifacts if a.call is not None]
    features = _features_text(cpu_features())
    candidates = {a.name: (lambda c=a.call: c(x)) for a in loaded}
    errors = {
        name: float(np.max(np.abs(np.asarray(fn()) - expected)))
        for name, fn in candidates.items()
    }
    result = interleave(candidates, rounds=plan.rounds, min_round_s=plan.min_round_s)
    # The anchor comparison is ONNX Runtime against itself: timed again with
    # only its sessions, so other runtimes' thread pools, which keep spinning
    # for a while after their calls on these two cores, weigh on neither.
    onnx = {name: fn for name, fn in candidates.items() if name.startswith("onnx ")}
    onnx_only = None
    if f"onnx {ANCHOR}" in onnx and "onnx int8" in onnx:
        onnx_only = interleave(onnx, rounds=plan.rounds, min_round_s=plan.min_round_s)
    rows = []
    for artifact in artifacts:
        row = {
            "shape": f"({shape[0]}, {shape[1]})",
            "runtime": artifact.runtime,
            "precision": artifact.precision,
            "cpu_features": features,
        }
        if artifact.call is None:
            row["status"] = artifact.status
        else:
            row.update(_latency_row(artifact, result, set(candidates), onnx_only))
            row.update(max_abs_diff=errors[artifact.name], rounds=plan.rounds)
        rows.append(row)
    return rows


def _target(name: str, threshold: str, row: dict, key: str, met) -> dict:
    value = row.get(key, row.get("status"))
    if not isinstance(value, float):
        return {"target": name, "threshold": threshold, "value": value, "met": None}
    return {"target": name, "threshold": threshold, "value": value, "met": met(value)}


def targets(
    files: list[dict], latency: list[dict], plan: Plan, features: list[str] | None
) -> list[dict]:
    """The issue's targets for a CPU with `features`, with their measured
    values (None: not measured). Without VNNI or AMX the ONNX file's speedup
    target is `WITHOUT_VNNI`'s, and the time over quantize_dynamic's has
    none."""

    def find(rows, **match):
        return next(r for r in rows if all(r.get(k) == v for k, v in match.items()))

    dot = _integer_dot(features)
    speedup = INT8_SPEEDUP if dot else {**INT8_SPEEDUP, **WITHOUT_VNNI}
    result = []
    for b, t in plan.target_shapes:
        shape = f"({b}, {t})"
        rows = [(runtime, "int8", least) for runtime, least in speedup.items()]
        for runtime, precision, least in rows:
            row = find(latency, shape=shape, runtime=runtime, precision=precision)
            result.append(
                _target(
                    f"{shape} {runtime} {precision}: speedup vs its float artifact",
                    f">= {least}x",
                    row,
                    "vs_float",
                    lambda v, least=least: v >= least,
                )
            )
        if dot:
            row = find(latency, shape=shape, runtime="onnx", precision="int8")
            result.append(
                _target(
                    f"{shape} onnx int8: time / quantize_dynamic time",
                    f"<= {ANCHOR_TIME}x",
                    row,
                    "time_vs_anchor",
                    lambda v: v <= ANCHOR_TIME,
                )
            )
    for runtime in RUNTIMES:
        for precision in ("int8", "int4"):
            most = SIZE["int8"]
            if precision == "int4" and runtime in STORES_INT4:
                most = SIZE["int4"]
            row = find(files, runtime=runtime, precision=precision)
            result.append(
                _target(
                    f"{runtime} {precision}: file size vs float",
                    f"<= {most}x",
                    row,
                    "size_vs_float",
                    lambda v, most=most: v <= most,
                )
            )
    return result


def run(quick: bool = False, rounds: int | None = None) -> dict:
    """Exports the three models in every format and times every artifact.

    Args:
        quick: a tiny model, one shape, two rounds (for the smoke test).
        rounds: interleaved rounds per shape (default: the plan's).

    Returns:
        {"machine", "mode", "model", "rounds", "export_seconds", "seconds",
        "files", "rows", "targets"}.
    """
    report.require_tensorflow("quantized", "SavedModel and LiteRT export")
    plan = report.plan(QUICK, FULL, quick, rounds)
    start = time.perf_counter()
    by_precision = models(plan.d_model)
    with tempfile.TemporaryDirectory() as directory:
        artifacts = export_all(by_precision, directory)
        export_s = time.perf_counter() - start
        for artifact in artifacts:
            if artifact.status is None:
                load(artifact)
        files = file_rows(artifacts)
        artifacts += keras_rows(by_precision)
        rows = []
        for shape in plan.shapes:
            rows += latency_rows(artifacts, by_precision["float"], shape, plan)
    return {
        "machine": machine.describe(),
        "mode": "quick" if quick else "full",
        "model": {"d_model": plan.d_model, "num_heads": NUM_HEADS},
        "rounds": plan.rounds,
        "export_seconds": export_s,
        "seconds": time.perf_counter() - start,
        "files": files,
        "rows": rows,
        "targets": targets(files, rows, plan, cpu_features()),
    }


def _ratio(value: float | None, quartiles: list[float] | None = None) -> str:
    if value is None:
        return ""
    text = f"{value:.2f}x"
    return text + (f" ({quartiles[0]:.2f}-{quartiles[1]:.2f})" if quartiles else "")


def _ms(value: float | None) -> str:
    if value is None:
        return ""
    return f"{value:.1f}" if value >= 1 else f"{value:.3f}"


def _error(value: float | None) -> str:
    return "" if value is None else f"{value:.1e}"


def _features_text(features: list[str] | None) -> str:
    """ "AVX2, VNNI": the `FEATURES` present, "none", or "unknown" (not x86)."""
    if features is None:
        return "unknown"
    return ", ".join(features) or "none"


def _vnni(flags: list[str] | None) -> str:
    if flags is None:
        return "unknown"
    return f"yes ({', '.join(flags)})" if flags else "no"


def to_markdown(results: dict) -> str:
    """The run as Markdown: machine, method, files, latency and targets."""
    m = results["machine"]
    d_model = results["model"]["d_model"]
    lines = [
        "# Quantized exports: float vs int8 vs int4",
        "",
        f"- Machine: {m['cpu']}, VNNI: {_vnni(m['vnni'])}, integer features: "
        f"{_features_text(cpu_features())}, {m['cores']} cores, "
        f"{m['memory_gib']} GiB (load average {m['load_average_1_5_15min']}), "
        f"{m['os']}",
        f"- Software: Python {m['python']}, TensorFlow {m['tensorflow']}, Keras "
        f"{m['keras']}, onnxruntime {m['onnxruntime']}, ai-edge-litert "
        f"{m['ai_edge_litert']}, OpenVINO {m['openvino']}",
        f"- Date: {m['date_utc']}, commit {m['git_commit']}; mode: "
        f"{results['mode']}; {results['rounds']} rounds; exports (each checked) "
        f"{results['export_seconds']:.0f} s, total {results['seconds']:.0f} s",
        f'- Model: `keras.Input((None, {d_model}), name="x")` -> '
        f"`SelfAttention(num_heads={results['model']['num_heads']}, "
        f"output_dim={d_model})`, seed 0; int8 and int4: a clone with the same "
        "weights, `model.quantize(mode)`; the int8 ONNX file is the default "
        "(Keras's integers + 128 times W on uint8 x int8 where its probe finds "
        "this CPU's kernel exact, VNNI or AMX, times W + 128 on uint8 x uint8 "
        "elsewhere: exact on every CPU). Anchor: onnxruntime `quantize_dynamic` "
        "of the float ONNX file. Runtimes: SavedModel `serving_default`, "
        "onnxruntime CPUExecutionProvider (default options but no spin-waiting "
        "between calls, which would take the cores from the next artifact timed), "
        "LiteRT signature "
        "runner (default threads), OpenVINO CPU at `INFERENCE_PRECISION_HINT` "
        "f32. All artifacts interleaved in one process per shape; ratios are "
        "medians of per-round time ratios (quartiles in brackets); speedup > 1: "
        "faster than the runtime's float artifact; the time over "
        "quantize_dynamic's comes from a second interleaved run of the ONNX "
        "Runtime sessions alone. Stored as: what the file "
        "says of itself (ONNX metadata, OpenVINO rt_info, the SavedModel's "
        "description); LiteRT files say nothing, so their int8 weight matrices "
        "are counted.",
        "",
        "## Files",
        "",
        *report.table(FILE_COLUMNS, results["files"]),
        "",
        "## Latency",
        "",
        *report.table(LATENCY_COLUMNS, results["rows"]),
        "",
        "## Targets (reported, not asserted)",
        "",
        "| target | threshold | measured | met |",
        "|---|---|---|---|",
    ]
    for target in results["targets"]:
        value = target["value"]
        measured = _ratio(value) if isinstance(value, float) else value
        met = {True: "yes", False: "no", None: "-"}[target["met"]]
        lines.append(
            f"| {target['target']} | {target['threshold']} | {measured} | {met} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    report.main(__doc__, run, to_markdown, "quantized", _HELPS)
