"""Models users train export in every format their backend allows.

One interpreter per backend (its KERAS_BACKEND fixed, so the module means
the same in every suite and runs in one) builds the models, exports each to
every format the backend writes, each through its exporter's own check, then
`verify` runs every artifact in a fresh process of its runtime on shapes the
exporters did not check (with another seed). The fast suite's model (on
TensorFlow; on JAX and PyTorch in the slow suite) holds one of each kind:
a `mixed_bfloat16` policy, a chunked layer, a layer with unequal key and
value sizes, one key/value head, rotary, a gate, causal and a sliding
window returning its scores, and dict outputs. The slow suite
adds `mixed_float16` with half precision kept, the torch causal classifier,
three list outputs, `attention_outputs`, and int8 models (on JAX the int8
model only).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT = 900
CELLS = {
    "tensorflow": ("saved_model", "onnx", "litert", "openvino"),
    "jax": ("saved_model", "onnx"),
    "torch": ("onnx", "litert", "openvino", "torch"),
}
# Shapes the exporters do not check (theirs: 1x1, 2x33, 3x128, 2x512).
UNSEEN = ((2, 9), (1, 40))
# litert-torch fixes the file's shape: exported and checked at this one.
TORCH_LITERT_SHAPE = (2, 9)

pytestmark = pytest.mark.one_suite("starts one interpreter per Keras backend")

_SCRIPT = """
import json, os, sys
import keras
import keras_selfattn
from keras_selfattn import SelfAttention
from keras_selfattn import export

root, names, cells, unseen, litert_shape = json.loads(sys.argv[1])
backend = keras.backend.backend()


def tokens():
    return keras.Input((None,), dtype="int32", name="tokens")


def zoo(policy="mixed_bfloat16"):
    keras.config.set_dtype_policy(policy)
    keras.utils.set_random_seed(0)
    t = tokens()
    h = keras.layers.Embedding(50, 16, mask_zero=True)(t)
    h = SelfAttention(num_heads=2, chunk_size=4, name="chunked")(h)
    out, scores = SelfAttention(
        num_heads=2, key_dim=6, value_dim=10, num_key_value_heads=1,
        use_gate=True, rope_max_wavelength=10000, causal=True,
        sliding_window=5, name="decoder")(h, return_attention_scores=True)
    pooled = keras.layers.GlobalAveragePooling1D()(out)
    model = keras.Model(
        t, {"probs": keras.layers.Dense(3, activation="softmax")(pooled),
            "scores": scores})
    keras.config.set_dtype_policy("float32")
    return model


def causal_classifier():
    keras.utils.set_random_seed(1)
    t = tokens()
    h = keras.layers.Embedding(50, 16, mask_zero=True)(t)
    h = SelfAttention(num_heads=2, causal=True)(h)
    h = keras.layers.GlobalAveragePooling1D()(h)
    return keras.Model(t, keras.layers.Dense(3, name="probs")(h))


def three_outputs():
    keras.utils.set_random_seed(2)
    t = tokens()
    h = SelfAttention(num_heads=2, name="att")(
        keras.layers.Embedding(50, 16, mask_zero=True)(t))
    return keras.Model(
        t, [keras.layers.Dense(n, name=f"head{n}")(h) for n in (3, 2, 1)])


def int8():
    keras.utils.set_random_seed(3)
    x = keras.Input((None, 64), name="x")
    model = keras.Model(x, SelfAttention(num_heads=4, output_dim=64)(x))
    model.quantize("int8", filters=lambda l: isinstance(l, keras.layers.Dense))
    return model


BUILD = {
    "zoo": (zoo, {}),
    "fp16_kept": (lambda: zoo("mixed_float16"), {"precision": "model"}),
    "causal_classifier": (causal_classifier, {}),
    "three_outputs": (three_outputs, {}),
    "attention_outputs": (three_outputs, {"attention_outputs": "att"}),
    "int8": (int8, {}),
}
SUFFIX = {"onnx": ".onnx", "litert": ".tflite", "openvino": ".xml", "torch": ".pt2"}
result = {"rows": [], "failed": {}, "skipped": {}}
for name in names:
    build, options = BUILD[name]
    model = build()
    paths = {}
    for fmt in cells:
        path = os.path.join(root, f"{name}_{fmt}")
        kwargs = dict(options)
        kept = export.formats.table.BY_NAME[fmt].half
        if kwargs.get("precision") == "model" and "float16" not in kept:
            try:  # refused in one line, before anything is written
                getattr(export, "export_" + fmt)(model, path + SUFFIX[fmt], **kwargs)
                result["failed"][f"{name}/{fmt}"] = [0, "not refused"]
            except ValueError as error:
                result["skipped"][f"{name}/{fmt}"] = str(error)
            continue
        try:
            if fmt == "saved_model":
                paths[fmt] = export.export_saved_model(model, path, "m", **kwargs)
            elif fmt == "litert":
                if backend == "torch":
                    kwargs["shape"] = tuple(litert_shape)
                paths[fmt] = export.export_litert(model, path + ".tflite", **kwargs)
            else:
                exporter = getattr(export, "export_" + fmt)
                paths[fmt] = exporter(model, path + SUFFIX[fmt], **kwargs)
        except Exception as error:
            message = str(error)
            result["failed"][f"{name}/{fmt}"] = [
                len(message.splitlines()), " ".join(message.split())[:400]]
    verify_options = {
        k: v for k, v in options.items() if k in ("attention_outputs", "precision")}
    groups = [{f: p for f, p in paths.items()
               if not (f == "litert" and backend == "torch")}]
    shapes = [unseen]
    if "litert" in paths and backend == "torch":
        groups.append({"litert": paths["litert"]})
        shapes.append([litert_shape])
    for group, group_shapes in zip(groups, shapes):
        if not group:
            continue
        report = export.verify(
            model, shapes=group_shapes, seed=9, **verify_options,
            **{export.formats.table.BY_NAME[f].path_argument: p
               for f, p in group.items()})
        result["rows"] += [
            [name, r.runtime, r.shape, r.max_abs_err, r.ok] for r in report.rows]
print("RESULT " + json.dumps(result))
"""


def _run(backend: str, names, root: str) -> dict:
    argument = json.dumps(
        [root, list(names), CELLS[backend], UNSEEN, TORCH_LITERT_SHAPE]
    )
    env = dict(
        os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=REPO
    )
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_SCRIPT), argument],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        cwd=REPO,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    (line,) = [x for x in result.stdout.splitlines() if x.startswith("RESULT ")]
    return json.loads(line[len("RESULT ") :])


def _check(result: dict, backend: str, names) -> None:
    assert result["failed"] == {}, result["failed"]
    for name in names:
        rows = [row for row in result["rows"] if row[0] == name]
        checked = {row[1] for row in rows}
        expected = {
            fmt for fmt in CELLS[backend] if f"{name}/{fmt}" not in result["skipped"]
        }
        assert checked == expected, (name, rows)
        refused = [v for k, v in result["skipped"].items() if k.startswith(name)]
        assert all(len(line.splitlines()) == 1 for line in refused), refused
        for _, runtime, shape, error, ok in rows:
            assert ok, (name, runtime, shape, error)


# The zoo model on every backend: the slow suite (about 77 s on TensorFlow
# under make test's load, 5 minutes on JAX and PyTorch together). Each
# backend x format cell is also exported in `make test` by
# tests/test_export_formats.py.
ZOO_BACKENDS = [
    pytest.param(backend, marks=pytest.mark.slow) for backend in sorted(CELLS)
]


@pytest.mark.parametrize("backend", ZOO_BACKENDS)
def test_the_zoo_model_exports_everywhere(backend, tmp_path):
    names = ("zoo",)
    result = _run(backend, names, str(tmp_path))
    _check(result, backend, names)
    labels = {row[2].split()[0] for row in result["rows"]}
    seen = {f"{b}x{t}" for b, t in UNSEEN} | {"x".join(map(str, TORCH_LITERT_SHAPE))}
    assert labels <= seen, labels


# On JAX (jax2tf and jax2onnx: about 4 minutes for two models) only int8,
# whose export depends on the backend's own arithmetic; the zoo model covers
# half precision and output structure there.
MORE_MODELS = (
    "fp16_kept",
    "causal_classifier",
    "three_outputs",
    "attention_outputs",
    "int8",
)


@pytest.mark.slow
@pytest.mark.parametrize("backend", sorted(CELLS))
def test_more_models_export_everywhere(backend, tmp_path):
    names = ("int8",) if backend == "jax" else MORE_MODELS
    result = _run(backend, names, str(tmp_path))
    _check(result, backend, names)
