"""TF Serving client: request building and response parsing, through real protos.

No TF Serving runs here. Requests go through TF Serving's own protos
(SerializeToString / ParseFromString) and JSON (json.dumps / json.loads);
responses are built the way the server builds them (tf.make_tensor_proto,
or JSON text in the documented REST response shapes). Network code is only
exercised against a closed port on 127.0.0.1.
"""

from __future__ import annotations

import importlib.util
import io
import json
import socket
import urllib.error
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
from tensorflow_serving.apis import predict_pb2

from keras_selfattn.serving import (
    GrpcClient,
    RestClient,
    ServingError,
    build_predict_request,
    build_rest_request,
    parse_predict_response,
    parse_rest_response,
    rest_client,
)

pytestmark = pytest.mark.tensorflow_only("TF Serving's protos and tf.make_tensor_proto")


def _mixed_inputs(batch: int = 3) -> dict[str, np.ndarray]:
    """Int tokens, a bool mask and float32 features with the same batch."""
    rng = np.random.default_rng(7)
    return {
        "tokens": rng.integers(0, 50, size=(batch, 5)).astype("int32"),
        "mask": rng.random((batch, 5)) > 0.3,
        "features": rng.standard_normal((batch, 5, 4)).astype("float32"),
    }


def _closed_port() -> int:
    """A port on 127.0.0.1 that nothing listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# --- REST request bodies ---------------------------------------------------


def test_row_format_is_one_object_per_example():
    inputs = _mixed_inputs()
    body = json.loads(json.dumps(build_rest_request(inputs, format="instances")))
    assert set(body) == {"signature_name", "instances"}
    assert body["signature_name"] == "serving_default"
    assert len(body["instances"]) == 3
    for i, instance in enumerate(body["instances"]):
        assert set(instance) == set(inputs)
        for name, array in inputs.items():
            np.testing.assert_array_equal(np.asarray(instance[name]), array[i])
    # Stacking the rows along a new axis 0 (what the server does) gives back
    # the batch, with JSON types matching each dtype.
    for name, array in inputs.items():
        stacked = np.stack(
            [np.asarray(inst[name], dtype=array.dtype) for inst in body["instances"]]
        )
        np.testing.assert_array_equal(stacked, array)
    first = body["instances"][0]
    assert all(type(v) is int for v in first["tokens"])
    assert all(type(v) is bool for v in first["mask"])
    assert all(type(v) is float for v in np.ravel(first["features"]).tolist())


def test_columnar_format_is_one_batched_list_per_input():
    inputs = _mixed_inputs(batch=2)
    body = json.loads(
        json.dumps(build_rest_request(inputs, format="inputs", signature_name="sig"))
    )
    assert set(body) == {"signature_name", "inputs"}
    assert body["signature_name"] == "sig"
    assert set(body["inputs"]) == set(inputs)
    for name, array in inputs.items():
        decoded = np.asarray(body["inputs"][name], dtype=array.dtype)
        assert decoded.shape == array.shape
        np.testing.assert_array_equal(decoded, array)


def test_float32_values_survive_json_exactly():
    values = np.array([[1e-8, 1.0 / 3.0, -123456.789, 3.4e38]], "float32")
    for fmt in ("instances", "inputs"):
        body = json.loads(json.dumps(build_rest_request({"x": values}, format=fmt)))
        raw = body["inputs"]["x"] if fmt == "inputs" else [body["instances"][0]["x"]]
        np.testing.assert_array_equal(np.asarray(raw, "float32"), values)


def test_columnar_format_allows_different_batch_sizes():
    body = build_rest_request(
        {"a": np.zeros((2, 3), "float32"), "b": np.ones((1,), "int32")},
        format="inputs",
    )
    assert np.asarray(body["inputs"]["a"]).shape == (2, 3)
    assert body["inputs"]["b"] == [1]


@pytest.mark.parametrize(
    "inputs, message",
    [
        ({"a": np.zeros((2, 3)), "b": np.zeros((3, 3))}, "same batch size"),
        ({"a": np.float32(1.0)}, "same batch size"),
        ({"a": np.zeros((0, 3))}, "same batch size"),
    ],
)
def test_row_format_rejects_unbatchable_inputs(inputs, message):
    with pytest.raises(ValueError, match=message):
        build_rest_request(inputs, format="instances")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"inputs": {}}, "`inputs` must be a non-empty dict"),
        ({"inputs": [np.zeros(2)]}, "`inputs` must be a non-empty dict"),
        ({"inputs": {"": np.zeros(2)}}, "non-empty string"),
        ({"inputs": {"s": np.array(["a", "b"])}}, r"inputs\['s'\].*dtype=<U1"),
        ({"inputs": {"x": np.zeros(2)}, "format": "rows"}, "format='rows'"),
        ({"inputs": {"x": np.zeros(2)}, "signature_name": ""}, "signature_name=''"),
    ],
)
def test_build_rest_request_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        build_rest_request(**kwargs)


# --- REST responses --------------------------------------------------------


def test_parse_row_response_single_output_is_unnamed():
    body = json.loads('{"predictions": [[0.25, 0.75], [1.5, -2.0]]}')
    outputs = parse_rest_response(body, output_name="probabilities")
    assert list(outputs) == ["probabilities"]
    assert outputs["probabilities"].dtype == np.float32
    np.testing.assert_array_equal(
        outputs["probabilities"], np.array([[0.25, 0.75], [1.5, -2.0]], "float32")
    )
    assert list(parse_rest_response(body)) == ["output"]


def test_parse_row_response_multi_output_stacks_per_name():
    body = json.loads(
        '{"predictions": [{"scores": [0.5, 0.5], "label": 1, "ok": true},'
        ' {"scores": [0.0, 1.0], "label": 0, "ok": false}]}'
    )
    outputs = parse_rest_response(body)
    assert set(outputs) == {"scores", "label", "ok"}
    np.testing.assert_array_equal(outputs["scores"], [[0.5, 0.5], [0.0, 1.0]])
    assert outputs["scores"].dtype == np.float32
    np.testing.assert_array_equal(outputs["label"], [1, 0])
    assert outputs["label"].dtype.kind == "i"
    np.testing.assert_array_equal(outputs["ok"], [True, False])
    assert outputs["ok"].dtype == np.bool_


def test_parse_columnar_response_single_and_multi_output():
    single = parse_rest_response(json.loads('{"outputs": [[1.0], [2.0]]}'), "y")
    np.testing.assert_array_equal(single["y"], np.array([[1.0], [2.0]], "float32"))
    multi = parse_rest_response(
        json.loads('{"outputs": {"y": [[1.0, 2.0]], "attention": [[[[1.0]]]]}}')
    )
    assert multi["y"].shape == (1, 2)
    assert multi["attention"].shape == (1, 1, 1, 1)


def test_parse_rest_response_nan_infinity_and_dtype_override():
    # TF Serving writes NaN / Infinity tokens; Python's json reads them.
    body = json.loads('{"outputs": {"x": [NaN, Infinity, -Infinity], "n": [1, 2]}}')
    outputs = parse_rest_response(body, dtypes={"n": "int32", "x": "float64"})
    assert np.isnan(outputs["x"][0]) and np.isposinf(outputs["x"][1])
    assert np.isneginf(outputs["x"][2])
    assert outputs["x"].dtype == np.float64
    assert outputs["n"].dtype == np.int32


def test_parse_rest_response_round_trips_the_client_body_shape():
    # A columnar response has the same shape as a columnar request body.
    inputs = _mixed_inputs(batch=2)
    body = build_rest_request(inputs, format="inputs")
    answer = json.loads(json.dumps({"outputs": body["inputs"]}))
    outputs = parse_rest_response(answer, dtypes={"tokens": "int32"})
    for name, array in inputs.items():
        np.testing.assert_array_equal(outputs[name], array)
        assert outputs[name].dtype == array.dtype


@pytest.mark.parametrize(
    "body, error, message",
    [
        ({"error": "Servable not found for request: Latest(x)"}, ServingError,
         "Servable not found for request: Latest"),
        ([1, 2], ValueError, "decoded JSON object"),
        ({"result": 1}, ValueError, "neither 'predictions' nor 'outputs'"),
        ({"predictions": {"a": 1}}, ValueError, "'predictions' must be a list"),
        ({"predictions": [[1.0, 2.0], [3.0]]}, ValueError, "not a rectangular"),
        ({"predictions": [{"a": 1}, {"b": 2}]}, ValueError, "same output names"),
        ({"outputs": {"a": ["x", 1]}}, ValueError, "not a rectangular numeric"),
    ],
)  # fmt: skip
def test_parse_rest_response_error_paths(body, error, message):
    with pytest.raises(error, match=message):
        parse_rest_response(body)


# --- gRPC PredictRequest / PredictResponse ---------------------------------


def test_predict_request_round_trips_through_the_proto():
    inputs = _mixed_inputs()
    inputs["ids64"] = np.array([[2**40, -1]], "int64").repeat(3, axis=0)
    request = build_predict_request("clf", inputs, signature_name="sig", version=7)
    parsed = predict_pb2.PredictRequest()
    parsed.ParseFromString(request.SerializeToString())
    assert parsed.model_spec.name == "clf"
    assert parsed.model_spec.signature_name == "sig"
    assert parsed.model_spec.version.value == 7
    assert set(parsed.inputs) == set(inputs)
    expected_dtypes = {
        "tokens": tf.int32,
        "mask": tf.bool,
        "features": tf.float32,
        "ids64": tf.int64,
    }
    for name, array in inputs.items():
        assert parsed.inputs[name].dtype == expected_dtypes[name].as_datatype_enum
        decoded = tf.make_ndarray(parsed.inputs[name])
        assert decoded.dtype == array.dtype
        np.testing.assert_array_equal(decoded, array)


def test_predict_request_without_version_leaves_it_unset():
    request = build_predict_request("clf", {"x": np.zeros((1, 2), "float32")})
    parsed = predict_pb2.PredictRequest.FromString(request.SerializeToString())
    assert not parsed.model_spec.HasField("version")
    assert parsed.model_spec.signature_name == "serving_default"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"model_name": "a/b"}, "model_name='a/b'"),
        ({"model_name": ".."}, "model_name='..'"),
        ({"model_name": ""}, "model_name=''"),
        ({"version": 0}, "version=0"),
        ({"version": True}, "version=True"),
        ({"version": "3"}, "version='3'"),
        ({"signature_name": None}, "signature_name=None"),
        ({"inputs": {}}, "`inputs` must be a non-empty dict"),
        ({"inputs": {"x": np.array([b"a"])}}, r"inputs\['x'\]"),
    ],
)
def test_build_predict_request_rejects_bad_arguments(kwargs, message):
    arguments = {"model_name": "clf", "inputs": {"x": np.zeros((1, 2), "float32")}}
    arguments.update(kwargs)
    with pytest.raises(ValueError, match=message):
        build_predict_request(**arguments)


def test_parse_predict_response_from_server_built_tensors():
    rng = np.random.default_rng(0)
    expected = {
        "probabilities": rng.random((4, 3)).astype("float32"),
        "attention_scores": rng.random((4, 2, 5, 5)).astype("float32"),
        "label": np.array([0, 2, 1, 1], "int64"),
        "padded": np.array([[True, False]] * 4),
    }
    response = predict_pb2.PredictResponse()
    for name, array in expected.items():
        response.outputs[name].CopyFrom(tf.make_tensor_proto(array))
    response.model_spec.name = "clf"
    wire = predict_pb2.PredictResponse.FromString(response.SerializeToString())
    outputs = parse_predict_response(wire)
    assert set(outputs) == set(expected)
    for name, array in expected.items():
        assert outputs[name].dtype == array.dtype
        np.testing.assert_array_equal(outputs[name], array)


def test_parse_predict_response_rejects_other_messages():
    with pytest.raises(ValueError, match="PredictResponse. Received: PredictRequest"):
        parse_predict_response(predict_pb2.PredictRequest())


# --- Clients: argument checks and unreachable servers ----------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"base_url": "localhost:8501"}, "base_url='localhost:8501'"),
        ({"base_url": "ftp://h:1"}, "base_url='ftp://h:1'"),
        ({"base_url": None}, "base_url=None"),
        ({"model_name": "../x"}, "model_name='../x'"),
        ({"version": -1}, "version=-1"),
        ({"signature_name": ""}, "signature_name=''"),
    ],
)
def test_rest_client_rejects_bad_arguments(kwargs, message):
    arguments = {"base_url": "http://localhost:8501", "model_name": "clf"}
    arguments.update(kwargs)
    with pytest.raises(ValueError, match=message):
        RestClient(**arguments)


def test_rest_client_urls():
    latest = RestClient("http://localhost:8501/", "clf")
    assert latest.model_url == "http://localhost:8501/v1/models/clf"
    pinned = RestClient("http://localhost:8501", "clf", version=3)
    assert pinned.model_url == "http://localhost:8501/v1/models/clf/versions/3"


def test_rest_client_connection_refused_is_a_clear_error():
    port = _closed_port()
    client = RestClient(f"http://127.0.0.1:{port}", "clf", version=2, timeout=5)
    url = f"http://127.0.0.1:{port}/v1/models/clf/versions/2:predict"
    with pytest.raises(ServingError, match="Cannot reach TF Serving at " + url):
        client.predict({"x": np.zeros((1, 2), "float32")})
    with pytest.raises(ServingError, match="refused"):
        client.metadata()


def test_rest_client_checks_inputs_before_any_network_call():
    client = RestClient(f"http://127.0.0.1:{_closed_port()}", "clf")
    with pytest.raises(ValueError, match="same batch size"):
        client.predict({"a": np.zeros((1, 2)), "b": np.zeros((2, 2))})


def test_rest_client_reports_the_servers_error_text(monkeypatch):
    # An HTTPError carrying TF Serving's documented error body, raised by
    # urllib itself, must surface the "error" text and the status code.
    def refuse(request, timeout):
        raise urllib.error.HTTPError(
            request.full_url,
            404,
            "Not Found",
            {},
            io.BytesIO(b'{ "error": "Servable not found for request: Latest(clf)" }'),
        )

    monkeypatch.setattr(rest_client.urllib.request, "urlopen", refuse)
    client = RestClient("http://localhost:8501", "clf")
    with pytest.raises(
        ServingError, match=r"HTTP 404: Servable not found for request: Latest\(clf\)"
    ):
        client.predict({"x": np.zeros((1, 2), "float32")})


def test_grpc_client_connection_refused_is_a_clear_error():
    port = _closed_port()
    with GrpcClient(f"127.0.0.1:{port}", "clf", timeout=5) as client:
        with pytest.raises(ServingError, match=f"127.0.0.1:{port} failed: UNAVAILABLE"):
            client.predict({"x": np.zeros((1, 2), "float32")})


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"target": "http://localhost:8500"}, "target='http://localhost:8500'"),
        ({"target": "localhost"}, "target='localhost'"),
        ({"model_name": "a\\b"}, "model_name="),
        ({"version": 1.5}, "version=1.5"),
    ],
)
def test_grpc_client_rejects_bad_arguments(kwargs, message):
    arguments = {"target": "localhost:8500", "model_name": "clf"}
    arguments.update(kwargs)
    with pytest.raises(ValueError, match=message):
        GrpcClient(**arguments)


# --- export/serving/query.py (the command-line client) ---------------------


@pytest.fixture(scope="module")
def query():
    path = Path(__file__).resolve().parents[1] / "export" / "serving" / "query.py"
    spec = importlib.util.spec_from_file_location("query", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_query_loads_inputs_with_default_and_given_dtypes(query, tmp_path):
    path = tmp_path / "in.json"
    path.write_text(
        json.dumps({"tokens": [[5, 3, 0]], "x": [[0.5, 1]], "mask": [[True, False]]})
    )
    inputs = query.load_inputs(str(path), {})
    assert inputs["tokens"].dtype == np.int32
    np.testing.assert_array_equal(inputs["tokens"], [[5, 3, 0]])
    assert inputs["x"].dtype == np.float32
    assert inputs["mask"].dtype == np.bool_
    assert query.load_inputs(str(path), {"tokens": "int64"})["tokens"].dtype == np.int64


@pytest.mark.parametrize(
    "content, dtypes, message",
    [
        ("[1, 2]", {}, "JSON object mapping input names"),
        ('{"x": [[1, 2], [3]]}', {}, "not a rectangular list"),
        ('{"x": ["a"]}', {}, "not a rectangular list"),
        ('{"x": [1]}', {"y": "int32"}, r"--dtype names inputs not in .*\['y'\]"),
        ("{not json", {}, "in.json is not valid JSON"),
    ],
)
def test_query_rejects_bad_input_files(query, tmp_path, content, dtypes, message):
    path = tmp_path / "in.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        query.load_inputs(str(path), dtypes)


@pytest.mark.parametrize("server", ["--rest", "--grpc"])
def test_query_exits_1_with_one_line_error_when_unreachable(
    query, tmp_path, capsys, server
):
    path = tmp_path / "in.json"
    path.write_text('{"x": [[0.5, 1.5]]}')
    port = _closed_port()
    target = f"http://127.0.0.1:{port}" if server == "--rest" else f"127.0.0.1:{port}"
    argv = [str(path), "--model", "clf", server, target, "--timeout", "5"]
    assert query.main(argv) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.strip().splitlines()
    expected = "Cannot reach TF Serving" if server == "--rest" else "UNAVAILABLE"
    assert line.startswith("error: ") and expected in line


def test_query_missing_file_and_bad_dtype_option(query, tmp_path, capsys):
    missing = str(tmp_path / "missing.json")
    assert query.main([missing, "--model", "clf"]) == 1
    assert "missing.json" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        query.main([missing, "--model", "clf", "--dtype", "x=notadtype"])
    assert exit_info.value.code == 2
    assert "expected NAME=DTYPE" in capsys.readouterr().err
