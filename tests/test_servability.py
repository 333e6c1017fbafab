"""Servability of SavedModel exports, proven with TensorFlow's and TF Serving's tools.

No TF Serving binary can run here, so each thing the server does with an
export is done with the real component it relies on:

(a) `saved_model_cli show` / `run` read and execute the export;
(b) a fresh Python process in which keras_selfattn and keras cannot be
    imported loads it with TensorFlow's SavedModel loader;
(c) the warmup file's PredictionLog records replay against the signature;
(d) `models.config` parses as TF Serving's ModelServerConfig and points at
    the export;
(e) REST bodies (row and columnar) become tensors the way TF Serving's
    json_tensor.cc maps them (signature dtypes and names; row format stacks
    examples on a new axis 0), and outputs go back as the server's JSON;
and the SignatureDef has the expected names, dtypes and dynamic dims.
Every output is compared with the Keras model's own prediction.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf
from google.protobuf import text_format
from tensorflow.core.protobuf import saved_model_pb2
from tensorflow_serving.config import model_server_config_pb2

from keras_selfattn import SelfAttention
from keras_selfattn.export import export_saved_model
from keras_selfattn.serving import (
    build_rest_request,
    parse_rest_response,
    read_warmup_file,
)
from tests import model_zoo

pytestmark = [
    pytest.mark.skipif(
        keras.backend.backend() == "torch",
        reason="SavedModel export does not run on torch (see test_export_backends)",
    ),
    # JAX's export goes through jax2tf at several times the cost; its cell of
    # the backend x format matrix is in test_export_formats / test_keras_export.
    pytest.mark.slow_on("jax", "SavedModel export and its serving checks"),
]

ATOL = 1e-5
RTOL = 1e-5
REPO = Path(__file__).resolve().parents[1]
SAVED_MODEL_CLI = str(Path(sys.executable).with_name("saved_model_cli"))
# (batch, time): batch 1 / time 1, an odd time, and a padded batch.
SHAPES = [(1, 1), (2, 33), (3, 7)]


def _classifier_attention(model: keras.Model, inputs) -> np.ndarray:
    """Keras's own attention weights of the classifier's SelfAttention."""
    embed = model.get_layer("embed")
    tokens = inputs["tokens"]
    _, weights = model.get_layer("attention")(
        embed(tokens), mask=embed.compute_mask(tokens), return_attention_scores=True
    )
    return keras.ops.convert_to_numpy(weights)


@dataclass(frozen=True)
class Spec:
    build: object
    output: str  # the model's output, named after its last layer
    attention_layer: str | None = None  # exported as "attention_weights"


# Integer tokens with padding (plus an attention-weights output), and two
# stacked SelfAttention blocks with residuals and LayerNormalization.
MODELS = {
    "classifier": Spec(model_zoo.masked_classifier, "probabilities", "attention"),
    "encoder": Spec(model_zoo.transformer_encoder, "norm_1b"),
}


def _digits_model(seed: int) -> keras.Model:
    """The quick start's input and output: 8 rows of 8 pixels -> 10 classes."""
    keras.utils.set_random_seed(seed)
    rows = keras.Input((8, 8), name="rows")
    x = keras.layers.Dense(16, name="embed")(rows)
    x = SelfAttention(num_heads=2, name="attention")(x)
    x = keras.layers.GlobalAveragePooling1D(name="pool")(x)
    digit = keras.layers.Dense(10, activation="softmax", name="digit")(x)
    return keras.Model(rows, digit, name="digits")


# Exported beside MODELS; export/serving/README.md's request bodies target it.
README_MODEL = Spec(_digits_model, "digit")


@dataclass
class Export:
    name: str
    spec: Spec
    model: keras.Model
    version_dir: Path

    def signature_def(self):
        """The serving_default SignatureDef as TF Serving reads it."""
        saved_model = saved_model_pb2.SavedModel()
        saved_model.ParseFromString((self.version_dir / "saved_model.pb").read_bytes())
        (meta_graph,) = [
            m for m in saved_model.meta_graphs if "serve" in m.meta_info_def.tags
        ]
        return meta_graph.signature_def["serving_default"]

    def inputs(self, batch: int, time: int, seed: int = 0) -> dict[str, np.ndarray]:
        return model_zoo.sample_inputs(self.model, batch, time, seed=seed)

    def keras_outputs(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """What the signature must return, computed by Keras."""
        ordered = [inputs[tensor.name] for tensor in self.model.inputs]
        feed = ordered[0] if len(ordered) == 1 else ordered
        outputs = {
            self.spec.output: keras.ops.convert_to_numpy(
                self.model(feed, training=False)
            )
        }
        if self.spec.attention_layer:
            outputs["attention_weights"] = _classifier_attention(self.model, inputs)
        return outputs

    def assert_matches_keras(self, outputs: dict[str, np.ndarray], inputs) -> None:
        expected = self.keras_outputs(inputs)
        assert set(outputs) == set(expected)
        for key, value in expected.items():
            np.testing.assert_allclose(
                outputs[key], value, atol=ATOL, rtol=RTOL, err_msg=key
            )


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> tuple[Path, dict[str, Export]]:
    """Every model exported once, with warmup, into one base dir."""
    base_dir = tmp_path_factory.mktemp("serving")
    exports = {}
    for name, spec in {**MODELS, "digits": README_MODEL}.items():
        model = spec.build(seed=3)
        version_dir = export_saved_model(
            model,
            base_dir,
            name,
            attention_outputs=spec.attention_layer,
            warmup=name in MODELS,
            check=False,  # these tests do their own comparisons with Keras
        )
        exports[name] = Export(name, spec, model, Path(version_dir))
    return base_dir, exports


@pytest.fixture(scope="module")
def signatures(served):
    """The loaded serving_default function of every export."""
    _, exports = served
    return {
        name: tf.saved_model.load(str(e.version_dir)).signatures["serving_default"]
        for name, e in exports.items()
    }


def _run_signature(fn, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {
        k: v.numpy()
        for k, v in fn(**{k: tf.constant(v) for k, v in inputs.items()}).items()
    }


def _quiet_env() -> dict[str, str]:
    return {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}


# --- SignatureDef ----------------------------------------------------------


def _dims(tensor_info) -> list[int]:
    return [d.size for d in tensor_info.tensor_shape.dim]


def test_signature_names_dtypes_and_dynamic_dims(served):
    _, exports = served
    classifier = exports["classifier"].signature_def()
    assert classifier.method_name == "tensorflow/serving/predict"
    assert list(classifier.inputs) == ["tokens"]
    assert classifier.inputs["tokens"].dtype == tf.int32.as_datatype_enum
    assert _dims(classifier.inputs["tokens"]) == [-1, -1]
    assert set(classifier.outputs) == {"probabilities", "attention_weights"}
    for info in classifier.outputs.values():
        assert info.dtype == tf.float32.as_datatype_enum
    assert _dims(classifier.outputs["probabilities"]) == [-1, 3]
    assert _dims(classifier.outputs["attention_weights"]) == [-1, 2, -1, -1]

    encoder = exports["encoder"].signature_def()
    assert list(encoder.inputs) == ["embeddings"]
    assert encoder.inputs["embeddings"].dtype == tf.float32.as_datatype_enum
    assert _dims(encoder.inputs["embeddings"]) == [-1, -1, model_zoo.FEATURES]
    assert list(encoder.outputs) == ["norm_1b"]
    assert _dims(encoder.outputs["norm_1b"]) == [-1, -1, model_zoo.FEATURES]


# --- (a) saved_model_cli ---------------------------------------------------


@pytest.mark.slow  # saved_model_cli in its own interpreter
def test_saved_model_cli_show_all(served):
    _, exports = served
    result = subprocess.run(
        [SAVED_MODEL_CLI, "show", "--all", "--dir",
         str(exports["classifier"].version_dir)],
        capture_output=True, text=True, env=_quiet_env(), timeout=120, check=True,
    )  # fmt: skip
    out = result.stdout
    section = out[out.index("signature_def['serving_default']") :]
    section = section[: section.index("Method name is: tensorflow/serving/predict")]
    inputs, outputs = section.split("contains the following output(s):")
    assert "inputs['tokens'] tensor_info:" in inputs
    assert "dtype: DT_INT32" in inputs
    assert "shape: (-1, -1)" in inputs
    probabilities = outputs[outputs.index("outputs['probabilities']") :]
    assert "shape: (-1, 3)" in probabilities.split("outputs[")[1]
    attention = outputs[outputs.index("outputs['attention_weights']") :]
    assert "shape: (-1, 2, -1, -1)" in attention.split("outputs[")[1]


# saved_model_cli starts a TensorFlow interpreter per run: `make test` runs
# the classifier (integer tokens, padding, two outputs), the slow suite the
# encoder too.
@pytest.mark.parametrize(
    "name",
    [
        pytest.param(name, marks=pytest.mark.slow) if name == "encoder" else name
        for name in MODELS
    ],
)
@pytest.mark.slow  # saved_model_cli in its own interpreters: 9 s
def test_saved_model_cli_run_matches_keras(served, tmp_path, name):
    _, exports = served
    export = exports[name]
    inputs = export.inputs(3, 33, seed=5)
    feeds = []
    for key, value in inputs.items():
        np.save(tmp_path / f"{key}.npy", value)
        feeds.append(f"{key}={tmp_path / key}.npy")
    outdir = tmp_path / "out"
    subprocess.run(
        [
            SAVED_MODEL_CLI, "run", "--dir", str(export.version_dir),
            "--tag_set", "serve", "--signature_def", "serving_default",
            "--inputs", ";".join(feeds), "--outdir", str(outdir), "--overwrite",
        ],
        capture_output=True, text=True, env=_quiet_env(), timeout=120, check=True,
    )  # fmt: skip
    outputs = {p.stem: np.load(p) for p in outdir.glob("*.npy")}
    export.assert_matches_keras(outputs, inputs)


# --- (b) a fresh process without keras_selfattn ----------------------------

_FRESH_LOADER = textwrap.dedent(
    """
    import importlib.abc, importlib.machinery, json, sys

    # keras_selfattn and keras can be located (TensorFlow looks keras up at
    # import time) but not imported: executing either module raises.
    class Refuse(importlib.abc.Loader):
        def create_module(self, spec):
            return None

        def exec_module(self, module):
            raise ImportError(f"{module.__name__} may not be imported here")

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] not in ("keras_selfattn", "keras"):
                return None
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            if spec is not None:
                spec.loader = Refuse()
            return spec

    sys.meta_path.insert(0, Block())
    import numpy as np
    import tensorflow as tf

    for job in json.loads(sys.argv[1]):
        fn = tf.saved_model.load(job["dir"]).signatures["serving_default"]
        with np.load(job["inputs"]) as feeds:
            outputs = fn(**{k: tf.constant(feeds[k]) for k in feeds.files})
        np.savez(job["outputs"], **{k: v.numpy() for k, v in outputs.items()})
    print(json.dumps(sorted({m.split(".")[0] for m in sys.modules})))
    """
)


def test_fresh_process_without_keras_selfattn_matches_keras(served, tmp_path):
    _, exports = served
    jobs, expected = [], []
    for name in MODELS:
        export = exports[name]
        for batch, time in SHAPES:
            inputs = export.inputs(batch, time, seed=batch * 100 + time)
            stem = tmp_path / f"{name}_{batch}x{time}"
            np.savez(f"{stem}_in.npz", **inputs)
            jobs.append(
                {
                    "dir": str(export.version_dir),
                    "inputs": f"{stem}_in.npz",
                    "outputs": f"{stem}_out.npz",
                }
            )
            expected.append((export, inputs))
    script = tmp_path / "load_fresh.py"
    script.write_text(_FRESH_LOADER)
    result = subprocess.run(
        [sys.executable, "-I", str(script), json.dumps(jobs)],
        capture_output=True, text=True, env=_quiet_env(), timeout=180,
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    top_level_modules = json.loads(result.stdout.strip().splitlines()[-1])
    assert "tensorflow" in top_level_modules
    assert "keras_selfattn" not in top_level_modules
    assert "keras" not in top_level_modules
    for job, (export, inputs) in zip(jobs, expected, strict=True):
        with np.load(job["outputs"]) as outputs:
            export.assert_matches_keras(dict(outputs), inputs)


# --- (c) warmup replay -----------------------------------------------------


@pytest.mark.parametrize("name", list(MODELS))
def test_warmup_records_replay_against_the_signature(served, signatures, name):
    _, exports = served
    export = exports[name]
    path = export.version_dir / "assets.extra" / "tf_serving_warmup_requests"
    assert path.is_file()
    requests = read_warmup_file(str(path))
    assert len(requests) == 3  # batch 1, times 1, 8 and 32
    signature = export.signature_def()
    for request in requests:
        assert request.model_spec.name == name
        assert request.model_spec.signature_name == "serving_default"
        assert set(request.inputs) == set(signature.inputs)
        for key, proto in request.inputs.items():
            assert proto.dtype == signature.inputs[key].dtype
        inputs = {key: tf.make_ndarray(proto) for key, proto in request.inputs.items()}
        export.assert_matches_keras(_run_signature(signatures[name], inputs), inputs)


# --- (d) models.config -----------------------------------------------------


def _parse_models_config(text: str) -> model_server_config_pb2.ModelServerConfig:
    return text_format.Parse(text, model_server_config_pb2.ModelServerConfig())


def _assert_servable_base_path(base_path: Path) -> None:
    """TF Serving serves numbered version folders holding saved_model.pb."""
    versions = [p for p in base_path.iterdir() if p.name.isdigit()]
    assert versions, f"no version folder in {base_path}"
    for version in versions:
        assert (version / "saved_model.pb").is_file()
        assert (version / "variables").is_dir()


def test_models_config_for_docker_maps_to_the_mount(served):
    base_dir, exports = served
    # docker run --mount type=bind,source=BASE_DIR,target=/models ...
    #   --model_config_file=/models/models.config
    config = _parse_models_config((base_dir / "models.config").read_text())
    models = config.model_config_list.config
    assert [m.name for m in models] == sorted(exports)
    for model in models:
        assert model.model_platform == "tensorflow"
        assert model.base_path == f"/models/{model.name}"
        host_path = base_dir / Path(model.base_path).relative_to("/models")
        assert host_path == exports[model.name].version_dir.parent
        _assert_servable_base_path(host_path)


def _load_script(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_local_models_config_points_at_the_exports(served, capsys):
    base_dir, exports = served
    script = _load_script(REPO / "export" / "serving" / "models_config.py")
    assert script.main([str(base_dir), "--local"]) == 0
    assert "models.local.config serving classifier, digits, encoder" in (
        capsys.readouterr().out
    )
    config = _parse_models_config((base_dir / "models.local.config").read_text())
    models = config.model_config_list.config
    assert [m.name for m in models] == sorted(exports)
    for model in models:
        assert model.model_platform == "tensorflow"
        assert Path(model.base_path).is_absolute()
        assert Path(model.base_path) == exports[model.name].version_dir.parent
        _assert_servable_base_path(Path(model.base_path))


def test_sample_models_config_in_export_serving_parses():
    sample = REPO / "export" / "serving" / "models.config"
    config = _parse_models_config(sample.read_text())
    assert config.model_config_list.config
    for model in config.model_config_list.config:
        assert model.model_platform == "tensorflow"
        assert model.base_path == f"/models/{model.name}"


# --- (e) REST bodies mapped the way TF Serving maps them -------------------


def _check_json_leaves(value, dtype: tf.DType, where: str) -> None:
    """TF Serving's JSON type rules: bools for DT_BOOL, ints for int types."""
    if isinstance(value, list):
        for item in value:
            _check_json_leaves(item, dtype, where)
    elif dtype == tf.bool:
        assert isinstance(value, bool), f"{where}: {value!r} is not a JSON bool"
    elif dtype.is_integer:
        assert isinstance(value, int) and not isinstance(value, bool), (
            f"{where}: {value!r} is not a JSON integer"
        )
    else:
        assert isinstance(value, (int, float)) and not isinstance(value, bool), (
            f"{where}: {value!r} is not a JSON number"
        )


def _server_tensors(body_text: str, signature_def) -> dict[str, np.ndarray]:
    """JSON predict body -> input tensors, as TF Serving's json_tensor.cc does."""
    body = json.loads(body_text)
    assert body.get("signature_name", "serving_default") == "serving_default"
    dtypes = {
        name: tf.dtypes.as_dtype(info.dtype)
        for name, info in signature_def.inputs.items()
    }
    assert ("instances" in body) != ("inputs" in body)
    if "instances" in body:
        rows = body["instances"]
        assert isinstance(rows, list) and rows
        if not isinstance(rows[0], dict):
            assert len(dtypes) == 1
            rows = [{next(iter(dtypes)): row} for row in rows]
        columns = {}
        for i, row in enumerate(rows):
            assert set(row) == set(dtypes), f"instance {i} keys {sorted(row)}"
            for name, value in row.items():
                _check_json_leaves(value, dtypes[name], f"instances[{i}][{name}]")
                columns.setdefault(name, []).append(
                    np.asarray(value, dtypes[name].as_numpy_dtype)
                )
        for name, values in columns.items():
            assert len({v.shape for v in values}) == 1, f"ragged instances: {name}"
        return {name: np.stack(values) for name, values in columns.items()}
    columns = body["inputs"]
    if not isinstance(columns, dict):
        assert len(dtypes) == 1
        columns = {next(iter(dtypes)): columns}
    tensors = {}
    for name, dtype in dtypes.items():
        assert name in columns, f"missing named input {name}"
        _check_json_leaves(columns[name], dtype, f"inputs[{name}]")
        tensors[name] = np.asarray(columns[name], dtype.as_numpy_dtype)
    return tensors


def _server_response(outputs: dict[str, np.ndarray], row_format: bool) -> str:
    """Output tensors -> JSON answer, in TF Serving's documented shapes."""
    lists = {name: value.tolist() for name, value in outputs.items()}
    if row_format:
        batch = {value.shape[0] for value in outputs.values()}
        assert len(batch) == 1
        if len(lists) == 1:
            return json.dumps({"predictions": next(iter(lists.values()))})
        rows = [{n: v[i] for n, v in lists.items()} for i in range(batch.pop())]
        return json.dumps({"predictions": rows})
    if len(lists) == 1:
        return json.dumps({"outputs": next(iter(lists.values()))})
    return json.dumps({"outputs": lists})


@pytest.mark.parametrize("format", ["instances", "inputs"])
@pytest.mark.parametrize("name", list(MODELS))
def test_rest_bodies_through_the_signature_match_keras(
    served, signatures, name, format
):
    _, exports = served
    export = exports[name]
    signature_def = export.signature_def()
    inputs = export.inputs(3, 9, seed=21)
    body_text = json.dumps(build_rest_request(inputs, format=format))
    tensors = _server_tensors(body_text, signature_def)
    for key, value in inputs.items():
        assert tensors[key].dtype == value.dtype
        np.testing.assert_array_equal(tensors[key], value)
    outputs = _run_signature(signatures[name], tensors)
    answer = _server_response(outputs, row_format=format == "instances")
    # A single output comes back unnamed; the client keys it as asked.
    parsed = parse_rest_response(json.loads(answer), output_name=export.spec.output)
    export.assert_matches_keras(parsed, inputs)


def _readme() -> str:
    return (REPO / "export" / "serving" / "README.md").read_text()


def test_readme_curl_bodies_run_through_the_signature(served, signatures):
    _, exports = served
    export = exports["digits"]
    bodies = re.findall(r"curl -X POST \S+/digits:predict -d '(.*?)'", _readme(), re.S)
    assert len(bodies) == 2
    row_format = [("instances" in json.loads(body)) for body in bodies]
    assert sorted(row_format) == [False, True]
    fed = []
    for body, row in zip(bodies, row_format, strict=True):
        tensors = _server_tensors(body, export.signature_def())
        assert tensors["rows"].shape == (1, 8, 8)
        assert tensors["rows"].dtype == np.float32
        outputs = _run_signature(signatures["digits"], tensors)
        export.assert_matches_keras(outputs, tensors)
        answer = json.loads(_server_response(outputs, row_format=row))
        export.assert_matches_keras(
            parse_rest_response(answer, output_name="digit"), tensors
        )
        fed.append(tensors["rows"])
    np.testing.assert_array_equal(fed[0], fed[1])  # the same digit both ways


def test_readme_query_inputs_load_as_the_curl_digit(served, tmp_path):
    _, exports = served
    (echoed,) = re.findall(r"echo '(.*?)' > digit.json", _readme())
    path = tmp_path / "digit.json"
    path.write_text(echoed)
    query = _load_script(REPO / "export" / "serving" / "query.py")
    inputs = query.load_inputs(str(path), {})
    body = re.search(r"-d '(\{\n  \"inputs\".*?)'", _readme(), re.S).group(1)
    expected = _server_tensors(body, exports["digits"].signature_def())
    assert inputs["rows"].dtype == np.float32
    np.testing.assert_array_equal(inputs["rows"], expected["rows"])
