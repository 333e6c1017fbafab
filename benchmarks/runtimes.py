"""Export runtimes: every format's runtime against SavedModel and Keras.

Usage:
    python -m benchmarks.runtimes [--quick] [--out DIR] [--rounds N]

A token classifier, `Embedding(mask_zero=True)` -> `SelfAttention(num_heads=4,
output_dim=32, use_bias=True)` -> mean pooling -> `Dense`, with dynamic batch
and time, is exported once with `keras_selfattn.export` (SavedModel, ONNX
plain and fused, LiteRT, OpenVINO IR), then at each (batch, time) every
runtime is timed in one process, interleaved with the SavedModel's
`serving_default` signature (`tf.saved_model.load`), Keras `model.predict`
and a direct eager model call. Ratios are medians of per-round ratios
(> 1: the runtime is faster); the error is the max abs difference from
`model.predict`. OpenVINO runs at f32 (`INFERENCE_PRECISION_HINT`) and,
as its own row, at its device default (bf16 on CPUs with AVX512-BF16).
Needs the TensorFlow backend (SavedModel and the fused ONNX export).
Writes DIR/runtimes.json and DIR/runtimes.md (default DIR: benchmarks/results).
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
import time
from collections.abc import Callable

import numpy as np

from benchmarks import machine, report
from benchmarks.timing import Plan, interleave

VOCABULARY = 1000
# runtime -> (module it needs, extra that installs it)
NEEDS = {
    "onnx": ("onnxruntime", "onnx"),
    "onnx_fused": ("onnxruntime", "onnx"),
    "litert": ("ai_edge_litert", "litert"),
    "openvino_f32": ("openvino", "openvino"),
    "openvino_default": ("openvino", "openvino"),
}
BASELINES = ("saved_model", "keras_predict", "keras_call")
COLUMNS = [
    ("shape", "(batch, time)"),
    ("runtime", "runtime"),
    ("ms", "ms / call"),
    ("vs_saved_model", "vs SavedModel"),
    ("vs_predict", "vs predict"),
    ("vs_call", "vs model call"),
    ("max_abs_error", "max abs error vs Keras"),
    ("status", "note"),
]


FULL = Plan(shapes=[(1, 16), (8, 128), (2, 512)], rounds=15, min_round_s=0.1)
QUICK = Plan(shapes=[(1, 8), (2, 16)], rounds=2, min_round_s=0.0)
# The help of `--quick` and `--rounds`.
_HELPS = {"quick": "tiny sizes, 2 rounds", "rounds": "rounds per shape"}


def classifier():
    """The issue-17 classifier: tokens (batch, time) int32 -> 3 logits."""
    import keras

    from keras_selfattn import SelfAttention

    keras.utils.set_random_seed(0)
    tokens = keras.Input((None,), dtype="int32", name="tokens")
    hidden = keras.layers.Embedding(VOCABULARY, 64, mask_zero=True)(tokens)
    hidden = SelfAttention(num_heads=4, output_dim=32, use_bias=True)(hidden)
    pooled = keras.layers.GlobalAveragePooling1D()(hidden)
    logits = keras.layers.Dense(3, name="logits")(pooled)
    return keras.Model(tokens, logits, name="classifier")


def tokens(batch: int, time_steps: int) -> np.ndarray:
    """Random token ids, right-padded with 0 to lengths time/2 .. time."""
    rng = np.random.default_rng(batch * 10007 + time_steps)
    ids = rng.integers(1, VOCABULARY, size=(batch, time_steps), dtype=np.int32)
    lengths = np.linspace(max(1, time_steps // 2), time_steps, batch).astype(int)
    for row, length in enumerate(lengths):
        ids[row, length:] = 0
    return ids


def _missing(runtime: str) -> str | None:
    module, extra = NEEDS.get(runtime, (None, None))
    if module is None or importlib.util.find_spec(module) is not None:
        return None
    return f"not installed: pip install keras-selfattn[{extra}]"


def one_input_call(
    module: str, path: str, **options: object
) -> tuple[Callable, object]:
    """The artifact at `path` loaded by `keras_selfattn_runtimes`'
    `module` with its `options` (the check's own loaders, on the
    `serving_default` signature): a call on its one input returning its
    first output, numpy -> numpy, and the loaded artifact (its
    `description`)."""
    import keras_selfattn_runtimes as runtimes

    loaded = runtimes.load(module, path, **options)
    name, output = loaded.input_names[0], loaded.output_names[0]
    return (lambda x: loaded({name: x})[output]), loaded


def saved_model_call(
    directory: str, input_name: str
) -> Callable[[np.ndarray], np.ndarray]:
    """The SavedModel's `serving_default` on one input, as numpy -> numpy
    (TensorFlow's XLA left as it is, not disabled as TF Serving does)."""
    import keras_selfattn_runtimes as runtimes

    loaded = runtimes.load("saved_model", directory, tf_serving=False)
    (output,) = loaded.output_names
    return lambda x: loaded({input_name: x})[output]


def onnx_call(path: str) -> Callable[[np.ndarray], np.ndarray]:
    """An onnxruntime CPU session (default options) on one input."""
    return one_input_call("onnx", path)[0]


def export_all(model, directory: str) -> tuple[dict, dict]:
    """Exports `model` once per format into `directory`.

    Returns:
        (runtime name -> callable on a token array, runtime name -> note for
        runtimes that are not installed).
    """
    from keras_selfattn import export

    calls: dict[str, Callable] = {}
    notes: dict[str, str] = {}
    builders = {
        "saved_model": lambda: saved_model_call(
            export.export_saved_model(
                model, directory, "bench", 1, models_config=False, check=False
            ),
            "tokens",
        ),
        "onnx": lambda: onnx_call(
            export.export_onnx(
                model, os.path.join(directory, "plain.onnx"), check=False
            )
        ),
        "onnx_fused": lambda: onnx_call(
            export.export_onnx(
                model,
                os.path.join(directory, "fused.onnx"),
                check=False,
                fuse_attention=True,
            )
        ),
        "litert": lambda: one_input_call(
            "litert",
            export.export_litert(
                model, os.path.join(directory, "model.tflite"), check=False
            ),
        )[0],
    }
    for name, build in builders.items():
        notes_or_none = _missing(name)
        if notes_or_none:
            notes[name] = notes_or_none
            continue
        calls[name] = build()
    if _missing("openvino_f32"):
        notes["openvino_f32"] = notes["openvino_default"] = _missing("openvino_f32")
    else:
        xml = export.export_openvino(
            model, os.path.join(directory, "model.xml"), check=False
        )
        calls["openvino_f32"] = one_input_call("openvino", xml, precision="f32")[0]
        calls["openvino_default"] = one_input_call("openvino", xml, precision="")[0]
    return calls, notes


def _rows_for_shape(model, calls, notes, shape, plan: Plan) -> list[dict]:
    x = tokens(*shape)
    candidates = {
        "keras_predict": lambda: model.predict(x, verbose=0),
        "keras_call": lambda: np.asarray(model(x, training=False)),
        **{name: (lambda c=call: c(x)) for name, call in calls.items()},
    }
    reference = model.predict(x, verbose=0)
    errors = {
        name: float(np.max(np.abs(np.asarray(fn()) - reference)))
        for name, fn in candidates.items()
    }
    result = interleave(candidates, rounds=plan.rounds, min_round_s=plan.min_round_s)
    label = f"({shape[0]}, {shape[1]})"
    rows = []
    for name in candidates:
        row = {
            "shape": label,
            "runtime": name,
            "ms": 1e3 * result.median(name),
            "max_abs_error": errors[name],
            "rounds": plan.rounds,
        }
        for baseline, key in zip(
            BASELINES, ("vs_saved_model", "vs_predict", "vs_call"), strict=True
        ):
            if baseline in candidates:
                row[key] = result.speedup(baseline, name)
        rows.append(row)
    rows += [
        {"shape": label, "runtime": name, "status": note}
        for name, note in notes.items()
    ]
    return rows


def run(quick: bool = False, rounds: int | None = None) -> dict:
    """Exports the classifier once and times every runtime at every shape
    of the plan (`quick`: QUICK's, else FULL's; `rounds`: `report.plan`).

    Returns:
        {"machine", "mode", "seconds", "rows"}.
    """
    report.require_tensorflow("runtimes", "SavedModel and fused ONNX export")
    plan = report.plan(QUICK, FULL, quick, rounds)
    start = time.perf_counter()
    model = classifier()
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as directory:
        calls, notes = export_all(model, directory)
        export_s = time.perf_counter() - start
        for shape in plan.shapes:
            rows += _rows_for_shape(model, calls, notes, shape, plan)
    return {
        "machine": machine.describe(),
        "mode": "quick" if quick else "full",
        "rounds": plan.rounds,
        "export_seconds": export_s,
        "seconds": time.perf_counter() - start,
        "rows": rows,
    }


def to_markdown(results: dict) -> str:
    """The run as Markdown: machine, method and one table."""
    m = results["machine"]
    lines = [
        "# Export runtimes",
        "",
        f"- Machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB (load "
        f"average {m['load_average_1_5_15min']}), {m['os']}",
        f"- Software: Python {m['python']}, TensorFlow {m['tensorflow']}, Keras "
        f"{m['keras']}, onnxruntime {m['onnxruntime']}, ai-edge-litert "
        f"{m['ai_edge_litert']}, OpenVINO {m['openvino']}",
        f"- Date: {m['date_utc']}, commit {m['git_commit']}; mode: "
        f"{results['mode']}; {results['rounds']} "
        f"rounds; exports {results['export_seconds']:.0f} s, total "
        f"{results['seconds']:.0f} s",
        "- Model: Embedding(1000, 64, mask_zero=True) -> SelfAttention(num_heads=4,"
        " output_dim=32, use_bias=True) -> GlobalAveragePooling1D -> Dense(3), "
        "right-padded tokens. Ratios: medians of per-round time ratios "
        "(> 1: faster than the baseline); error: max abs vs `model.predict`. "
        "`keras_call` is an eager `model(x)` call.",
        "",
    ]
    lines += report.table(COLUMNS, results["rows"])
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    report.main(__doc__, run, to_markdown, "runtimes", _HELPS)
