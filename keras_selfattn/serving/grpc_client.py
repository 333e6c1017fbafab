"""A client of TF Serving's gRPC API (requests and responses: `predict`)."""

from __future__ import annotations

import grpc
import numpy as np
from tensorflow_serving.apis import prediction_service_pb2_grpc

from keras_selfattn.serving._tensors import ServingError, check_signature_name
from keras_selfattn.serving.layout import check_model_name, check_version
from keras_selfattn.serving.predict import (
    build_predict_request,
    parse_predict_response,
)


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
