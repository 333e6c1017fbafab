"""TF Serving REST API: request bodies, responses and a small urllib client.

TF Serving maps a REST body to tensors with the signature's input dtypes: the
row format (`"instances"`, a list of per-example objects) stacks each input
along a new batch axis; the columnar format (`"inputs"`, a dict of batched
lists) takes each input as is. A signature with one output answers without
its name (`"predictions": [...]` / `"outputs": [...]`); with several, by
name.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request

import numpy as np

from keras_selfattn.serving._tensors import (
    ServingError,
    check_inputs,
    check_signature_name,
)
from keras_selfattn.serving.layout import check_model_name, check_version

REST_FORMATS = ("instances", "inputs")


def build_rest_request(
    inputs: dict[str, np.ndarray],
    format: str = "instances",
    signature_name: str = "serving_default",
) -> dict:
    """Builds the JSON body of a TF Serving REST predict request.

    Args:
        inputs: Input name to array; every array includes the batch axis.
        format: `"instances"` (row format: one object per example, so every
            input must have the same batch size) or `"inputs"` (columnar: one
            batched list per input).
        signature_name: The SignatureDef to run.

    Returns:
        A dict ready for `json.dumps`.

    Example:

    >>> import numpy as np
    >>> build_rest_request({"tokens": np.array([[3, 1], [2, 0]])})
    {'signature_name': 'serving_default', 'instances': [{'tokens': [3, 1]}, {'tokens': [2, 0]}]}
    >>> build_rest_request({"tokens": np.array([[3, 1]])}, format="inputs")
    {'signature_name': 'serving_default', 'inputs': {'tokens': [[3, 1]]}}
    """  # noqa: E501
    arrays = check_inputs(inputs)
    if format not in REST_FORMATS:
        raise ValueError(
            f"`format` must be one of {REST_FORMATS}. Received: format={format!r}"
        )
    check_signature_name(signature_name)
    body: dict = {"signature_name": signature_name}
    if format == "inputs":
        body["inputs"] = {name: a.tolist() for name, a in arrays.items()}
        return body
    sizes = {name: (a.shape[0] if a.ndim else None) for name, a in arrays.items()}
    if None in sizes.values() or len(set(sizes.values())) != 1 or 0 in sizes.values():
        raise ValueError(
            'The row format (format="instances") needs every input to have the '
            'same batch size >= 1 on axis 0; use format="inputs" otherwise. '
            f"Received batch sizes: {sizes}"
        )
    batch = next(iter(sizes.values()))
    lists = {name: a.tolist() for name, a in arrays.items()}
    body["instances"] = [
        {name: values[i] for name, values in lists.items()} for i in range(batch)
    ]
    return body


def _to_array(name: str, value, dtype) -> np.ndarray:
    try:
        array = np.asarray(value)
    except ValueError as e:
        raise ValueError(f"Output {name!r} is not a rectangular array: {e}") from None
    if array.dtype.kind not in "biuf":
        raise ValueError(
            f"Output {name!r} is not a rectangular numeric or bool array "
            f"(numpy dtype {array.dtype})."
        )
    if dtype is not None:
        return array.astype(dtype)
    if array.dtype.kind == "f":
        return array.astype("float32")
    return array


def parse_rest_response(
    body: dict,
    output_name: str = "output",
    dtypes: dict[str, np.dtype] | None = None,
) -> dict[str, np.ndarray]:
    """Turns a TF Serving REST predict response into numpy arrays.

    Args:
        body: The decoded JSON response (`json.loads` of the body).
        output_name: Key for a single output, which TF Serving sends without
            its name.
        dtypes: Optional output name to dtype. By default JSON numbers with a
            fraction become float32 (TF Serving's float outputs), integers
            int64 and booleans bool. String outputs are not supported.

    Returns:
        Output name to array, batch axis first.

    Example:

    >>> parse_rest_response({"predictions": [[0.5], [1.5]]})["output"].shape
    (2, 1)
    >>> sorted(parse_rest_response({"outputs": {"a": [1], "b": [2.5]}}))
    ['a', 'b']
    """
    dtypes = dtypes or {}
    if not isinstance(body, dict):
        raise ValueError(
            f"`body` must be the decoded JSON object. Received: body={body!r}"
        )
    if "error" in body:
        raise ServingError(f"TF Serving answered with an error: {body['error']}")
    if "predictions" in body:
        rows = body["predictions"]
        if not isinstance(rows, list):
            raise ValueError(
                f"'predictions' must be a list. Received: {type(rows).__name__}"
            )
        if rows and all(isinstance(row, dict) for row in rows):
            names = list(rows[0])
            if any(list(row) != names for row in rows):
                raise ValueError(
                    "Every object in 'predictions' must have the same output "
                    f"names; the first has {names}."
                )
            return {
                name: _to_array(name, [row[name] for row in rows], dtypes.get(name))
                for name in names
            }
        return {output_name: _to_array(output_name, rows, dtypes.get(output_name))}
    if "outputs" in body:
        outputs = body["outputs"]
        if isinstance(outputs, dict):
            return {
                name: _to_array(name, value, dtypes.get(name))
                for name, value in outputs.items()
            }
        return {output_name: _to_array(output_name, outputs, dtypes.get(output_name))}
    raise ValueError(
        "`body` has neither 'predictions' nor 'outputs' nor 'error'. "
        f"Received keys: {sorted(body)}"
    )


class RestClient:
    """Client of a running TF Serving's REST API (default port 8501).

    Args:
        base_url: Server root, e.g. `"http://localhost:8501"`.
        model_name: The model's name in `models.config`.
        version: A version number, or None (default) for the served latest.
        signature_name: The SignatureDef to run.
        timeout: Seconds to wait for an answer.

    Example:

    ```python
    client = RestClient("http://localhost:8501", "classifier")
    outputs = client.predict({"tokens": np.array([[5, 3, 9, 0]], "int32")})
    ```
    """

    def __init__(
        self,
        base_url: str,
        model_name: str,
        version: int | None = None,
        signature_name: str = "serving_default",
        timeout: float = 30.0,
    ):
        parsed = urllib.parse.urlparse(base_url) if isinstance(base_url, str) else None
        if (
            parsed is None
            or parsed.scheme not in ("http", "https")
            or not parsed.netloc
        ):
            raise ValueError(
                "`base_url` must be an http(s) URL such as 'http://localhost:8501'. "
                f"Received: base_url={base_url!r}"
            )
        self.model_name = check_model_name(model_name)
        self.version = check_version(version)
        self.signature_name = check_signature_name(signature_name)
        self.timeout = timeout
        path = f"/v1/models/{urllib.parse.quote(model_name)}"
        if version is not None:
            path += f"/versions/{version}"
        self.model_url = base_url.rstrip("/") + path

    def predict(
        self,
        inputs: dict[str, np.ndarray],
        format: str = "instances",
        output_name: str = "output",
    ) -> dict[str, np.ndarray]:
        """POSTs a predict request and returns the outputs.

        Args:
            inputs: Input name to array, batch axis first.
            format: `"instances"` (row) or `"inputs"` (columnar) body.
            output_name: Key for a single (unnamed in the answer) output.

        Returns:
            Output name to array.
        """
        body = build_rest_request(inputs, format, self.signature_name)
        answer = self._call(self.model_url + ":predict", json.dumps(body).encode())
        return parse_rest_response(answer, output_name)

    def metadata(self) -> dict:
        """Returns the model's metadata (SignatureDefs) as decoded JSON."""
        return self._call(self.model_url + "/metadata", None)

    def _call(self, url: str, data: bytes | None) -> dict:
        request = urllib.request.Request(
            url,
            data=data,
            headers={"Content-Type": "application/json"},
            method="POST" if data is not None else "GET",
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                raw = response.read()
        except urllib.error.HTTPError as e:
            raise ServingError(
                f"TF Serving at {url} answered HTTP {e.code}: {_error_text(e)}"
            ) from None
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise ServingError(f"Cannot reach TF Serving at {url}: {reason}") from None
        try:
            return json.loads(raw)
        except ValueError:
            raise ServingError(
                f"TF Serving at {url} answered with a body that is not JSON: "
                f"{raw[:200]!r}"
            ) from None


def _error_text(error: urllib.error.HTTPError) -> str:
    raw = error.read()
    try:
        return str(json.loads(raw)["error"])
    except (ValueError, KeyError, TypeError):
        return raw.decode("utf-8", "replace")[:500] or error.reason
