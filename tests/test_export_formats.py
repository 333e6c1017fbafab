"""Backend x format matrix: every export Keras can make, checked in fresh runtimes.

One interpreter per backend (KERAS_BACKEND fixed there, so the module means
the same under every suite and runs in one) exports the masked classifier
to every format its backend can write (`export(model, path, format)`, the
formats and their backends read from `formats.table.ROWS`, so a new format
is tested by its row), without the exporters' own check, then `verify` runs
each artifact in a fresh process of its runtime against Keras at T=7 and
T=33 with padded rows. The table's five known formats are pinned to the
cells measured with Keras 3.15.
The formats Keras has no route for are refused in one line, nothing
written. The slow variant adds the grouped-query rotary block, longer shapes,
and checks each artifact against a model with other weights (must fail).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from keras_selfattn_runtimes import table

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONSOLE = os.path.join(os.path.dirname(sys.executable), "keras-selfattn")
TIMEOUT = 600
# What each backend exports, measured with Keras 3.15; the rest is refused.
MEASURED_CELLS = {
    "tensorflow": ("saved_model", "onnx", "litert", "openvino"),
    "jax": ("saved_model", "onnx"),
    "torch": ("onnx", "litert", "openvino", "torch"),
}
# Why Keras 3.15 refuses the others, as measured.
MEASURED_REFUSED = {
    ("tensorflow", "torch"): "torch.export needs the torch backend",
    ("jax", "litert"): "Keras converts to LiteRT only from TensorFlow and torch",
    ("jax", "openvino"): "XlaCallModule",
    ("jax", "torch"): "torch.export needs the torch backend",
    ("torch", "saved_model"): "torch_xla",
}
MEASURED_FORMATS = {fmt for cells in MEASURED_CELLS.values() for fmt in cells}
# The matrix: the table's cells; refusals say the measured reason, or (a
# format not measured here) the row's own.
CELLS = {
    backend: tuple(row.name for row in table.ROWS if backend in row.backends)
    for backend in table.BACKENDS
}
REFUSED = {
    (backend, row.name): MEASURED_REFUSED.get((backend, row.name), reason)
    for row in table.ROWS
    for backend, reason in row.refused.items()
}
FILES = {row.name: "m" + row.suffix for row in table.FILE_ROWS}
# litert-torch writes fixed shapes: the torch LiteRT file is made and checked
# at this one (batch, time).
TORCH_LITERT_SHAPE = (3, 33)
FAST_SHAPES = ((2, 7), (3, 33))
# The matrix's interpreter per backend costs 40 to 60 s, so its cells are
# slow: TensorFlow's (the exports TF Serving gets) in the TensorFlow slow
# suite, which CI runs, JAX's and PyTorch's in the JAX slow suite.
CI_BACKENDS = ("tensorflow",)
IN_CI = pytest.mark.one_suite(
    "starts one interpreter per Keras backend", slow_suite="tensorflow"
)


def _cases(pairs) -> list:
    """(backend, ...) tuples as slow parameters, in CI's suite for
    `CI_BACKENDS`."""
    return [
        pytest.param(
            *pair,
            marks=[pytest.mark.slow, *([IN_CI] if pair[0] in CI_BACKENDS else [])],
        )
        for pair in pairs
    ]


SLOW_SHAPES = ((1, 1), (2, 7), (3, 33), (2, 128))
MAX_ERROR = 1e-4

# Its slow cases run in the JAX slow suite (balance: see tests/conftest.py).
pytestmark = pytest.mark.one_suite(
    "starts one interpreter per Keras backend", slow_suite="jax"
)

_SCRIPT = """
import json, os, sys
import keras
import keras_selfattn
from keras_selfattn import export
from keras_selfattn.export import ParityError, verify
from keras_selfattn_runtimes import table

root, model_file, cells, refused, shapes, files, fixed_shape, wrong = json.loads(
    sys.argv[1]
)
backend = keras.backend.backend()
model = keras.models.load_model(model_file)
other = keras.models.clone_model(model)
other.set_weights([w * 1.5 for w in model.get_weights()])
litert_shape = fixed_shape if backend == "torch" else None
paths, result = {}, {"rows": [], "wrong": {}, "refused": {}, "failed": {}}


def options(fmt):  # a SavedModel's name, LiteRT's fixed shape (torch)
    given = {"name": "m"} if "name" in table.BY_NAME[fmt].options else {}
    return {**given, **({"shape": litert_shape} if fmt == "litert" else {})}


for fmt in cells:
    try:
        paths[fmt] = export.export(
            model, os.path.join(root, files.get(fmt, "sm")), fmt, check=False,
            **options(fmt))
    except Exception as error:  # this cell fails, the others still run
        result["failed"][fmt] = " ".join(str(error).split())[-500:]
groups = [{k: v for k, v in paths.items() if k != "litert" or not litert_shape}]
if litert_shape and "litert" in paths:
    groups.append({"litert": paths["litert"], "fixed": True})
for group in groups:
    fixed = group.pop("fixed", False)
    run_shapes = [litert_shape] if fixed else shapes
    report = verify(model, shapes=run_shapes, paths=group)
    result["rows"] += [[r.runtime, r.shape, r.max_abs_err, r.ok] for r in report.rows]
    for name, path in group.items() if wrong else ():
        try:
            verify(other, shapes=run_shapes[:1], paths={name: path})
            result["wrong"][name] = "passed"
        except ParityError as error:
            result["wrong"][name] = str(error)
before = sorted(os.listdir(root))
for fmt in refused:
    target = os.path.join(root, "refused", files.get(fmt, "sm"))
    try:
        export.export(model, target, fmt, **options(fmt))
        result["refused"][fmt] = "exported"
    except ValueError as error:
        result["refused"][fmt] = str(error)
result["untouched"] = sorted(os.listdir(root)) == before
described = os.path.join(
    paths.get("saved_model", root), "assets.extra", "keras_selfattn.json")
result["tf_serving_flags"] = (
    json.load(open(described)).get("tf_serving_flags", [])
    if os.path.isfile(described) else [])
print("RESULT " + json.dumps(result))
"""


def _env(backend: str) -> dict[str, str]:
    return dict(
        os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=REPO
    )


def _run_backend(
    backend: str, root: str, model_file: str, shapes, wrong: bool = False
) -> dict:
    refused = [fmt for (b, fmt) in REFUSED if b == backend]
    argument = json.dumps(
        [
            root,
            model_file,
            CELLS[backend],
            refused,
            shapes,
            FILES,
            TORCH_LITERT_SHAPE,
            wrong,
        ]
    )
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_SCRIPT), argument],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        cwd=REPO,
        env=_env(backend),
    )
    assert result.returncode == 0, result.stderr[-4000:]
    (line,) = [x for x in result.stdout.splitlines() if x.startswith("RESULT ")]
    return json.loads(line[len("RESULT ") :])


@pytest.fixture(scope="module")
def model_files(tmp_path_factory):
    """The classifier and the grouped-query rotary block, saved under TF."""
    root = tmp_path_factory.mktemp("formats")
    code = f"""
        import keras
        import keras_selfattn
        from keras_selfattn import SelfAttention
        from tests import model_zoo
        model_zoo.masked_classifier(seed=0).save({str(root / "clf.keras")!r})
        inputs = keras.Input((None, 8), name="sequence")
        outputs = SelfAttention(
            num_heads=2, num_key_value_heads=1, rope_max_wavelength=10000,
            output_dim=16, causal=True, name="gqa")(inputs)
        keras.Model(inputs, outputs).save({str(root / "gqa.keras")!r})
    """
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        cwd=REPO,
        env=_env("tensorflow"),
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return root


@pytest.fixture(scope="module")
def matrix(model_files, tmp_path_factory):
    """{backend: result of `_SCRIPT`} for the classifier, run once per backend."""
    cache = {}

    def get(backend: str) -> dict:
        if backend not in cache:
            root = str(tmp_path_factory.mktemp(backend))
            cache[backend] = _run_backend(
                backend, root, str(model_files / "clf.keras"), FAST_SHAPES
            )
        return cache[backend]

    return get


def _check_cell(result: dict, backend: str, fmt: str, shapes, wrong=False) -> None:
    assert fmt not in result["failed"], result["failed"][fmt]
    runtime = fmt
    rows = [row for row in result["rows"] if row[0] == runtime]
    expected = [TORCH_LITERT_SHAPE] if (backend, fmt) == ("torch", "litert") else shapes
    labels = [f"{b}x{t}" for b, t in expected]
    assert [row[1].split()[0] for row in rows] == labels, result["rows"]
    for _, label, error, ok in rows:
        assert ok and error <= MAX_ERROR, (label, error)
    if wrong:  # the same artifact against other weights must fail
        assert "differ from Keras" in result["wrong"][fmt], result["wrong"][fmt]


@pytest.mark.parametrize(
    "backend, fmt", _cases([(b, f) for b, formats in CELLS.items() for f in formats])
)
def test_every_exportable_cell_matches_keras(matrix, backend, fmt):
    """Works within 1e-4 at T=7 and T=33 (padded rows)."""
    _check_cell(matrix(backend), backend, fmt, FAST_SHAPES)


def test_the_table_has_the_cells_measured_with_keras_3_15():
    """The formats measured here keep their cells and refusals in the table
    (a new format is not pinned: its row is the matrix's)."""
    for backend, measured in MEASURED_CELLS.items():
        known = tuple(fmt for fmt in CELLS[backend] if fmt in MEASURED_FORMATS)
        assert known == measured, (backend, CELLS[backend])
    for (backend, fmt), reason in MEASURED_REFUSED.items():
        assert reason in table.BY_NAME[fmt].refused[backend], (backend, fmt)


@pytest.mark.parametrize("backend", _cases([("tensorflow",), ("jax",)]))
def test_saved_models_say_whether_tf_serving_needs_xla(matrix, backend):
    """jax2tf's SavedModel is one XlaCallModule, which TF Serving runs only
    with --xla_cpu_compilation_enabled=true (its check ran with XLA off
    otherwise); TensorFlow's needs nothing."""
    flags = matrix(backend)["tf_serving_flags"]
    assert flags == (["--xla_cpu_compilation_enabled=true"] if backend == "jax" else [])


@pytest.mark.parametrize("backend, fmt", _cases(sorted(REFUSED)))
def test_formats_keras_cannot_export_are_refused_in_one_line(matrix, backend, fmt):
    result = matrix(backend)
    message = result["refused"][fmt]
    assert "\n" not in message and REFUSED[(backend, fmt)] in message, message
    assert f"does not run on the {backend} backend" in message
    assert "export there" in message  # the way that works
    assert result["untouched"]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["jax", "tensorflow", "torch"])
def test_grouped_query_rotary_block_on_longer_shapes(model_files, tmp_path, backend):
    """More shapes, and each artifact fails against other weights."""
    result = _run_backend(
        backend, str(tmp_path), str(model_files / "gqa.keras"), SLOW_SHAPES, True
    )
    for fmt in CELLS[backend]:
        _check_cell(result, backend, fmt, SLOW_SHAPES, wrong=True)


def test_the_runtime_process_imports_neither_keras_nor_the_package(
    model_files, tmp_path
):
    """The worker on a real ONNX file: only onnxruntime and numpy."""
    from keras_selfattn.export.parity import runner as _artifact_runner
    from keras_selfattn.export.signature import NamedInput, Signature

    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "x"], ["output_0"])],
        "double",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, None])],
        [helper.make_tensor_value_info("output_0", TensorProto.FLOAT, [None, None])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    path = str(tmp_path / "double.onnx")
    onnx.save(model, path)
    target = Signature(None, (NamedInput("x", (None, None), "float32"),), ("y",), None)
    runs = [_artifact_runner.Run(({"x": np.arange(6, dtype="float32").reshape(2, 3)},))]
    (outcome,) = _artifact_runner.run_artifacts(
        target, {"onnx": _artifact_runner.Artifact("onnx", path)}, runs
    ).values()
    assert outcome.error == "" and outcome.imported == ()
    # "output_0" says only its position: matched to the target's "y".
    np.testing.assert_array_equal(
        outcome.outputs[0][0]["y"], 2 * np.arange(6, dtype="float32").reshape(2, 3)
    )


def test_a_saved_model_runs_where_keras_and_jax_cannot_be_imported(tmp_path):
    """TensorFlow imports Keras and JAX when they are installed; the
    SavedModel's runtime process runs it without them, as a serving host
    without Keras does, from its signature's tensors as TF Serving runs it."""
    from keras_selfattn.export.parity import runner as _artifact_runner
    from keras_selfattn.export.signature import NamedInput, Signature

    tf = pytest.importorskip("tensorflow")
    module = tf.Module()
    module.scale = tf.Variable(3.0)
    spec = tf.TensorSpec((None, None), tf.float32, name="x")
    module.serve = tf.function(
        lambda x: {"y": x * module.scale}, input_signature=[spec]
    )
    path = str(tmp_path / "scaled" / "1")
    tf.saved_model.save(module, path, signatures={"serving_default": module.serve})
    target = Signature(None, (NamedInput("x", (None, None), "float32"),), ("y",), None)
    x = np.arange(6, dtype="float32").reshape(2, 3)
    (outcome,) = _artifact_runner.run_artifacts(
        target,
        {"saved_model": _artifact_runner.Artifact("saved_model", path)},
        [_artifact_runner.Run(({"x": x},))],
    ).values()
    assert outcome.error == "" and outcome.imported == ()
    np.testing.assert_array_equal(outcome.outputs[0][0]["y"], 3 * x)


@pytest.mark.slow  # a CLI export on torch in its own interpreter
def test_cli_exports_pt2_on_torch_and_refuses_a_saved_model(model_files, tmp_path):
    """torch backend: a .pt2 written, verified, moved in; the SavedModel
    refused in one line before the model is loaded."""
    model = model_files / "clf.keras"
    env = _env("torch")
    result = subprocess.run(
        [
            CONSOLE,
            "export",
            str(model),
            "--torch",
            str(tmp_path / "out" / "m.pt2"),
        ],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        cwd=REPO,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [
        line.split() for line in result.stdout.splitlines() if line.startswith("torch ")
    ]
    assert len(rows) == 4 and all(row[-1] == "yes" for row in rows), result.stdout
    assert sorted(os.listdir(tmp_path)) == ["out"]
    assert os.listdir(tmp_path / "out") == ["m.pt2"]
    result = subprocess.run(
        [CONSOLE, "export", str(model), "--saved-model", str(tmp_path / "sm")],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        cwd=REPO,
        env=env,
    )
    assert result.returncode == 1 and result.stdout == ""
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("keras-selfattn: error: SavedModel export does not run")
    assert "torch_xla" in last and not (tmp_path / "sm").exists()
