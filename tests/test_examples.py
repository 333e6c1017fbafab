"""Every example runs in its fast mode, in a fresh interpreter, and is checked.

Each example runs as `sys.executable examples/NAME.py [--fast] --out TMP`
from a temporary working directory; the runs of the examples that train or
export (the slow suite's) start together, three at a time, on first use
(most of their time is TensorFlow's start-up). The checks
read what the example wrote and printed: files exist and load (the .keras
model in Keras, the ONNX file in onnxruntime, the PNGs as images with varying
pixels), and printed numbers are compared with independent values. For the
seeds walkthrough those are copied from the notebooks' printed output in
../shared/seeds/, or computed in numpy from those printed numbers, never from
the package.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

# The examples export SavedModel and ONNX, so their interpreters run
# TensorFlow whatever the suite's backend; the checks here read files and
# printed numbers, which any backend can.
pytestmark = pytest.mark.one_suite(
    "the examples run in their own KERAS_BACKEND=tensorflow interpreters",
    slow_suite="tensorflow",
)
# The examples that train or export: each takes one to two minutes of a
# shared core, in the slow suite (CI's TensorFlow one; `make demo` runs the
# quickstart). The seeds walkthrough, which checks the notebooks' printed
# numbers, stays in `make test`.
TRAINS = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
TIMEOUT = 600


def run_example(name: str, out: Path, *args: str) -> str:
    """Runs examples/NAME.py with `--out out`; returns stdout (fails on rc != 0)."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", KERAS_BACKEND="tensorflow")
    out.parent.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / f"{name}.py"), *args, "--out", str(out)],
        capture_output=True,
        text=True,
        cwd=out.parent,
        env=env,
        timeout=TIMEOUT,
    )
    assert result.returncode == 0, (
        f"{name} exited {result.returncode}\n{result.stdout[-3000:]}\n"
        f"{result.stderr[-3000:]}"
    )
    return result.stdout


def number(pattern: str, text: str) -> float:
    """The float captured by `pattern`'s first group in `text`."""
    match = re.search(pattern, text)
    assert match, f"{pattern!r} not found in output:\n{text[-3000:]}"
    return float(match.group(1))


def check_png(path: Path) -> None:
    """A real PNG image that is not blank."""
    import matplotlib.image

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and image.shape[0] > 200 and image.shape[1] > 200
    assert image[..., :3].std() > 0.05


# The examples that train or export, and their arguments.
RUNS = {
    "quickstart": ("quickstart", ("--fast",)),
    "masked_sequences": ("masked_sequences", ("--fast",)),
    "attention_heatmap": ("attention_heatmap", ()),
    "causal_transformer": ("causal_transformer", ("--fast",)),
}


def _run(name: str, out: Path, args: tuple[str, ...]) -> tuple[Path, str]:
    return out, run_example(name, out, *args)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Future]:
    """{example: Future of (out folder, stdout)}."""
    root = tmp_path_factory.mktemp("examples")
    with ThreadPoolExecutor(max_workers=3) as pool:
        yield {
            key: pool.submit(_run, name, root / key / "artifacts", args)
            for key, (name, args) in RUNS.items()
        }


@pytest.fixture(scope="module")
def quickstart(runs):
    """(out, stdout) of the fast quickstart run."""
    return runs["quickstart"].result()


def test_out_must_be_a_folder(tmp_path, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    import _common

    not_a_folder = tmp_path / "file.txt"
    not_a_folder.write_text("keep me")
    with pytest.raises(SystemExit) as exit_info:
        _common.parse_args("demo", argv=["--out", str(not_a_folder)])
    assert exit_info.value.code == 2
    assert f"--out must be a folder. Received: --out={not_a_folder}" in (
        capsys.readouterr().err
    )
    assert not_a_folder.read_text() == "keep me"
    created = _common.parse_args("demo", "fast", ["--out", str(tmp_path / "a" / "b")])
    assert created.out.is_dir() and created.fast is False


# --------------------------------------------------------------- quickstart
@TRAINS
def test_quickstart_prints_both_accuracies(quickstart):
    _, first = quickstart
    attention = number(r"with SelfAttention\s*: ([0-9.]+)", first)
    baseline = number(r"baseline, no attention\s*: ([0-9.]+)", first)
    difference = number(r"difference\s*: ([+-][0-9.]+)", first)
    assert 0.0 < attention <= 1.0 and 0.0 < baseline <= 1.0
    assert difference == pytest.approx(attention - baseline, abs=2e-4)
    assert "450 test images" in first


@TRAINS
def test_quickstart_parity_table_all_within_tolerance(quickstart):
    _, first = quickstart
    rows = re.findall(
        r"^(saved_model|onnx)\s+(\d+x8)\s+\S+\s+\S+\s+(\S+)$", first, re.M
    )
    assert sorted(rows) == sorted(
        (runtime, shape, "yes")
        for runtime in ("saved_model", "onnx")
        for shape in ("1x8", "33x8", "512x8")
    )


@TRAINS
def test_quickstart_serving_configs_point_at_the_model(quickstart):
    out, _ = quickstart
    from google.protobuf import text_format
    from tensorflow_serving.config import model_server_config_pb2

    for file_name, base_path in (
        ("models.config", "/models/digits"),
        ("models.local.config", str(out / "serving" / "digits")),
    ):
        config = text_format.Parse(
            (out / "serving" / file_name).read_text(),
            model_server_config_pb2.ModelServerConfig(),
        )
        (model,) = config.model_config_list.config
        assert (model.name, model.base_path) == ("digits", base_path)


@TRAINS
def test_quickstart_files_load_and_agree(quickstart):
    """The .keras model, the ONNX file and the request files are consistent."""
    import keras
    import onnxruntime

    import keras_selfattn  # noqa: F401  (registers SelfAttention)

    out, first = quickstart
    rows = np.asarray(json.loads((out / "query_inputs.json").read_text())["rows"])
    body = json.loads((out / "request.json").read_text())
    assert rows.shape == (2, 8, 8) and rows.min() >= 0.0 and rows.max() <= 1.0
    assert body["signature_name"] == "serving_default"
    np.testing.assert_array_equal([i["rows"] for i in body["instances"]], rows)

    model = keras.models.load_model(out / "digits.keras")
    expected = model.predict(rows.astype("float32"), verbose=0)
    session = onnxruntime.InferenceSession(str(out / "digits.onnx"))
    (got,) = session.run(None, {"rows": rows.astype("float32")})
    np.testing.assert_allclose(got, expected, atol=1e-5, rtol=1e-4)
    predicted = re.search(r"Keras predicts \[(\d+), (\d+)\]", first).groups()
    assert [int(p) for p in predicted] == expected.argmax(-1).tolist()


@TRAINS
def test_quickstart_writes_heatmap_and_next_commands(quickstart):
    out, first = quickstart
    check_png(out / "attention_digits.png")
    assert f"-v {out / 'serving'}:/models" in first
    assert "--model_config_file=/models/models.config" in first
    assert "tensorflow_model_server --port=8500 --rest_api_port=8501" in first
    assert f"-d @{out / 'request.json'}" in first
    assert f"query.py {out / 'query_inputs.json'} --model digits" in first


# ------------------------------------------------------- seeds walkthrough
def parse_matrices(text: str) -> dict[str, np.ndarray]:
    """{key: flat array} from the walkthrough's `[key] label:` blocks."""
    result: dict[str, np.ndarray] = {}
    key = None
    for line in text.splitlines():
        match = re.match(r"^\[(\d{3}\.\w+)\] .*:$", line)
        if match:
            key = match.group(1)
            result[key] = np.array([])
        elif key is not None and re.match(r"^\s*[\[\d-]", line):
            values = [
                float(v) for v in line.replace("[", " ").replace("]", " ").split()
            ]
            result[key] = np.concatenate([result[key], values])
        else:
            key = None
    return result


# The notebooks' printed numbers (../shared/seeds/NNN_*.txt).
QUERIES = [[1, 0, 2], [2, 2, 2], [2, 1, 3]]  # 000 In [8], 001 In [38], 004 In [5]
KEYS = [[0, 1, 1], [4, 4, 0], [2, 3, 1]]
VALUES = [[1, 2, 3], [2, 8, 0], [2, 6, 3]]
SCORES = [[2, 4, 4], [4, 16, 12], [4, 12, 10]]  # 001 In [39], 004 In [6]
WEIGHTS = [  # 001 In [40]
    [6.33789383e-02, 4.68310531e-01, 4.68310531e-01],
    [6.03366485e-06, 9.82007865e-01, 1.79861014e-02],
    [2.95387223e-04, 8.80536902e-01, 1.19167711e-01],
]
NOTEBOOK = {
    "000.query": QUERIES,
    "000.key": KEYS,
    "000.value": VALUES,
    "000.sqrt_dk": [1.7320508],
    "000.output": [  # In [9]
        [1.8638741, 6.3193707, 1.7041886],
        [1.9991105, 7.8141265, 0.27347228],
        [1.9925548, 7.479635, 0.73587704],
    ],
    "001.query": QUERIES,
    "001.key": KEYS,
    "001.value": VALUES,
    "001.scores": SCORES,
    "001.weights": WEIGHTS,
    "001.contributions": [  # In [46], "Attention is"
        [0.06337894, 0.12675788, 0.19013681],
        [0.93662106, 3.74648425, 0.0],
        [0.93662106, 2.80986319, 1.40493159],
    ],
    "002.inputs": [  # In [5]
        [1.78862847, 0.43650985, 0.09649747, -1.8634927],
        [-0.2773882, -0.35475898, -0.08274148, -0.62700068],
        [-0.04381817, -0.47721803, -1.31386475, 0.88462238],
    ],
    "002.attention_0": [1.24326146e-13, 9.98281489e-01, 1.71851130e-03],  # In [11]
    "002.attention_1": [2.79525306e-12, 5.85506360e-03, 9.94144936e-01],
    "002.attention_2": [0.00505708, 0.00654776, 0.98839516],
    "002.x_prime_0": [0.94744244, -0.24348429, -0.91310441, -0.44522983],  # In [12]
    "002.x_prime_1": [1.64201168, -0.08470004, 4.02764044, 2.18690791],
    "002.x_prime_2": [1.61949281, -0.06641533, 3.96863308, 2.15858316],
    "003.queries": [[0.105, -0.138], [-0.267, -0.135], [0.39, 0.374]],  # In [37]
    "003.keys": [[0.061, 0.708], [-0.128, -0.684], [0.297, 0.567]],
    "003.scores": [  # In [31]
        [-0.091299, 0.080952, -0.047061],
        [-0.111867, 0.126516, -0.155844],
        [0.288582, -0.305736, 0.327888],
    ],
    "004.keys": KEYS,
    "004.querys": QUERIES,
    "004.values": VALUES,
    "004.scores": SCORES,
    "004.weights": [  # In [17] (TensorFlow, float32)
        [6.3378938e-02, 4.6831051e-01, 4.6831051e-01],
        [6.0336647e-06, 9.8200780e-01, 1.7986100e-02],
        [2.9538720e-04, 8.8053685e-01, 1.1916770e-01],
    ],
    "004.rounded_outputs": [[2.0, 7.0, 1.5], [2.0, 8.0, 0.0], [2.0, 7.8, 0.3]],  # [9]
}


def _softmax(scores: np.ndarray) -> np.ndarray:
    e = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def derived_from_notebooks() -> dict[str, np.ndarray]:
    """Values the notebooks imply but do not print, from their printed numbers."""
    weights, values = np.array(WEIGHTS), np.array(VALUES, dtype=float)
    # 003's TODO: the notebook's printed scores, scaled by 1/sqrt(2), and its
    # Wv applied to its three printed embeddings.
    combined = np.array([[0.3, 0.8, -0.3], [-0.9, -0.1, 0.0], [1.0, -0.2, 0.3]])
    wv = np.array([[0.81, 0.8], [0.67, 0.98], [0.04, 0.3]])
    weights_003 = _softmax(np.array(NOTEBOOK["003.scores"]) / np.sqrt(2.0))
    return {
        # 001: the rows of "Attention is" added up (not within each row).
        "001.output_row_0": np.array(NOTEBOOK["001.contributions"]).sum(axis=0),
        "001.output": weights @ values,
        "004.outputs": weights @ values,
        "003.weights": weights_003,
        "003.output": weights_003 @ (combined @ wv),
    }


@pytest.fixture(scope="module")
def walkthrough(tmp_path_factory):
    out = tmp_path_factory.mktemp("walkthrough") / "artifacts"
    stdout = run_example("seeds_walkthrough", out)
    return out, stdout, parse_matrices(stdout)


@pytest.mark.parametrize("key", sorted(NOTEBOOK))
def test_walkthrough_prints_the_notebook_matrices(walkthrough, key):
    _, _, printed = walkthrough
    expected = np.ravel(np.array(NOTEBOOK[key], dtype=float))
    assert printed[key].shape == expected.shape, key
    np.testing.assert_allclose(printed[key], expected, rtol=2e-5, atol=1e-6)


def test_walkthrough_outputs_the_notebooks_imply(walkthrough):
    _, _, printed = walkthrough
    derived = derived_from_notebooks()
    np.testing.assert_allclose(
        printed["001.output"][:3], derived["001.output_row_0"], rtol=1e-6
    )
    for key in ("001.output", "004.outputs", "003.weights", "003.output"):
        np.testing.assert_allclose(
            printed[key], np.ravel(derived[key]), rtol=1e-5, atol=1e-6
        )


def test_walkthrough_names_the_layer_arguments_and_writes_json(walkthrough):
    out, stdout, printed = walkthrough
    for arguments in (
        "SelfAttention(key_dim=3)  # default scale = 1/sqrt(key_dim)",
        "SelfAttention(key_dim=3, scale=1.0)",
        "SelfAttention(key_dim=4, use_bias=True, scale=1.0)  # kernels = omega.T",
        "SelfAttention(key_dim=2)  # default scale = 1/sqrt(2)",
    ):
        assert arguments in stdout
    saved = json.loads((out / "seeds_walkthrough.json").read_text())
    assert set(saved) == set(printed)
    np.testing.assert_allclose(
        np.ravel(saved["000.output"]), np.ravel(NOTEBOOK["000.output"]), rtol=2e-5
    )


# ------------------------------------------------------- other examples
@TRAINS
def test_attention_heatmap(runs):
    out, stdout = runs["attention_heatmap"].result()
    check_png(out / "attention_heatmap.png")
    blocks = re.findall(r"weights:\n((?:\s*\[.*\n){3})", stdout)
    assert len(blocks) == 2
    printed = [
        np.array([float(v) for v in b.replace("[", " ").replace("]", " ").split()])
        for b in blocks
    ]
    scores = np.array(SCORES, dtype=float)
    # 000's scale (1/sqrt(3)) on the notebooks' printed raw scores; 001's weights.
    np.testing.assert_allclose(
        printed[0], np.ravel(_softmax(scores / np.sqrt(3.0))), atol=1e-6
    )
    np.testing.assert_allclose(printed[1], np.ravel(WEIGHTS), atol=1e-6)


@TRAINS
def test_masked_sequences(runs):
    out, stdout = runs["masked_sequences"].result()
    check_png(out / "masked_sequences.png")
    accuracy = number(r"held-out accuracy: ([0-9.]+)", stdout)
    assert 0.0 < accuracy <= 1.0
    padded = re.findall(
        r"length\s+(\d+)\): max weight on padded keys = (\S+), "
        r"max \|output\| at padded positions = (\S+),",
        stdout,
    )
    assert [p[0] for p in padded] == ["3", "7"]
    for _, weight, output in padded:
        assert float(weight) == 0.0 and float(output) == 0.0
    diffs = re.findall(r"max \|padded - alone\| on real positions = (\S+)", stdout)
    assert len(diffs) == 3
    assert max(float(d) for d in diffs) < 1e-5


@TRAINS
def test_causal_transformer(runs):
    out, stdout = runs["causal_transformer"].result()
    check_png(out / "causal_transformer.png")
    accuracy = number(r"determines it: ([0-9.]+)", stdout)
    assert 0.0 <= accuracy <= 1.0
    assert number(r"above the diagonal\): (\S+)", stdout) == 0.0
    assert number(r"row sums of the weights: min ([0-9.]+)", stdout) == pytest.approx(
        1.0, abs=1e-5
    )
    assert number(r"max ([0-9.]+)\n", stdout) == pytest.approx(1.0, abs=1e-5)
    assert number(r"by at most (\S+)", stdout) == 0.0


# Last in the file: it adds a version to the folder the tests above read.
@pytest.mark.slow
@pytest.mark.one_suite("a third quickstart interpreter", slow_suite="torch")
def test_quickstart_second_run_exports_a_new_version(quickstart):
    out, first = quickstart
    second = run_example("quickstart", out, "--fast")
    versions = sorted(p.name for p in (out / "serving" / "digits").iterdir())
    assert versions == ["1", "2"]
    assert str(out / "serving" / "digits" / "1") in first
    assert str(out / "serving" / "digits" / "2") in second
    for version in versions:
        folder = out / "serving" / "digits" / version
        assert (folder / "saved_model.pb").is_file()
        assert (folder / "assets.extra" / "tf_serving_warmup_requests").is_file()
    # Nothing hidden (temporary export folders or files) is left behind.
    assert not [p for p in out.rglob(".*")]


@pytest.mark.slow
@pytest.mark.one_suite("trains and exports three generators", slow_suite="torch")
def test_mini_gpt(tmp_path):
    """keras.io's miniature GPT with SelfAttention in subclassed blocks and
    learned absolute positions: `generate` equals the uncached loop, the
    continuations follow the sequences it learned (an independent truth,
    computed here), and the three exported generators (each checked by its
    exporter in a fresh runtime process) return `generate`'s tokens."""
    out = tmp_path / "artifacts"
    stdout = run_example("mini_gpt", out, "--fast")
    results = json.loads((out / "mini_gpt.json").read_text())
    assert results["generate"] == results["uncached"]
    for prompt, row in zip(results["prompts"], results["generate"], strict=True):
        step = (prompt[1] - prompt[0]) % 20
        expected = [(prompt[-1] + step * (i + 1)) % 20 for i in range(len(row))]
        assert sum(a == b for a, b in zip(row, expected, strict=True)) >= len(row) // 2
    assert set(results["exports"]) == {"saved_model", "onnx", "litert"}
    for tokens in results["exports"].values():
        assert tokens == results["generate"]
    assert (out / "mini_gpt.onnx").is_file() and (out / "mini_gpt.tflite").is_file()
    assert "generate == uncached loop: True" in stdout
