"""TF Serving's PredictRequest and PredictResponse protos, without gRPC.

Warmup records and the gRPC client both carry a `PredictRequest`; building
one needs only TF Serving's protos and `tf.make_tensor_proto` (TensorFlow is
imported with the protos, which are defined on its `TensorProto`).
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf
from tensorflow_serving.apis import predict_pb2

from keras_selfattn.serving._tensors import check_inputs, check_signature_name
from keras_selfattn.serving.layout import check_model_name, check_version


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
