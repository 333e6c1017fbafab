"""TF Serving gRPC API: PredictRequest building, response parsing, a client."""

from __future__ import annotations

import grpc
import numpy as np
import tensorflow as tf
from tensorflow_serving.apis import (
    predict_pb2,
    prediction_service_pb2_grpc,
)

from keras_selfattn.serving._tensors import (
    ServingError,
    check_inputs,
    check_signature_name,
    check_version,
)
from keras_selfattn.serving.model_config import check_model_name


def build_predict_request(
    model_name: str,
    inputs: dict[str, np.ndarray],
    signature_name: str = "serving_default",
    version: int | None = None,
) -> predict_pb2.PredictRequest:
    """Builds a TF Serving `PredictRequest`, tensors via `tf.make_tensor_proto`.

    Args:
        model_name: The model's name in TF Serving.
        inputs: Input name to array, batch axis first. The array dtypes are
            sent as they are (cast to the signature's dtypes first: e.g.
            int32 tokens, bool masks, float32 features).
        signature_name: The SignatureDef to run.
        version: A version number, or None for the served latest.

    Returns:
        The request proto.

    Example:

    >>> import numpy as np
    >>> request = build_predict_request("clf", {"x": np.zeros((1, 3), "float32")})
    >>> request.inputs["x"].tensor_shape.dim[1].size
    3
    """
    arrays = check_inputs(inputs)
    check_signature_name(signature_name)
    check_version(version)
    request = predict_pb2.PredictRequest()
    request.model_spec.name = check_model_name(model_name)
    request.model_spec.signature_name = signature_name
    if version is not None:
        request.model_spec.version.value = version
    for name, array in arrays.items():
        request.inputs[name].CopyFrom(tf.make_tensor_proto(array))
    return request


def parse_predict_response(
    response: predict_pb2.PredictResponse,
) -> dict[str, np.ndarray]:
    """Returns the outputs of a `PredictResponse` as numpy arrays.

    Args:
        response: The response proto from `PredictionService.Predict`.

    Returns:
        Output name to array, with the dtypes the server sent.
    """
    if not isinstance(response, predict_pb2.PredictResponse):
        raise ValueError(
            "`response` must be a tensorflow_serving PredictResponse. "
            f"Received: {type(response).__name__}"
        )
    return {name: tf.make_ndarray(proto) for name, proto in response.outputs.items()}


class GrpcClient:
    """Client of a running TF Serving's gRPC API (default port 8500).

    Args:
        target: `host:port` of the server, e.g. `"localhost:8500"`.
        model_name: The model's name in `models.config`.
        version: A version number, or None (default) for the served latest.
        signature_name: The SignatureDef to run.
        timeout: Seconds to wait for an answer.
        max_message_bytes: Largest request or response accepted (gRPC's
            default of 4 MiB is small for attention weights).

    Example:

    ```python
    with GrpcClient("localhost:8500", "classifier") as client:
        outputs = client.predict({"tokens": np.array([[5, 3, 9, 0]], "int32")})
    ```
    """

    def __init__(
        self,
        target: str,
        model_name: str,
        version: int | None = None,
        signature_name: str = "serving_default",
        timeout: float = 30.0,
        max_message_bytes: int = 256 * 1024 * 1024,
    ):
        if not isinstance(target, str) or ":" not in target or "/" in target:
            raise ValueError(
                "`target` must be 'host:port', e.g. 'localhost:8500'. "
                f"Received: target={target!r}"
            )
        self.target = target
        self.model_name = check_model_name(model_name)
        self.version = check_version(version)
        self.signature_name = check_signature_name(signature_name)
        self.timeout = timeout
        options = [
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
        ]
        self._channel = grpc.insecure_channel(target, options=options)
        self._stub = prediction_service_pb2_grpc.PredictionServiceStub(self._channel)

    def predict(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Sends a PredictRequest and returns the outputs.

        Args:
            inputs: Input name to array, batch axis first.

        Returns:
            Output name to array.
        """
        request = build_predict_request(
            self.model_name, inputs, self.signature_name, self.version
        )
        try:
            response = self._stub.Predict(request, timeout=self.timeout)
        except grpc.RpcError as e:
            raise ServingError(
                f"TF Serving gRPC call to {self.target} failed: "
                f"{e.code().name}: {e.details()}"
            ) from None
        return parse_predict_response(response)

    def close(self) -> None:
        """Closes the channel."""
        self._channel.close()

    def __enter__(self) -> GrpcClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
