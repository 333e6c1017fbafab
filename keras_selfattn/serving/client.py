"""Clients for a running TF Serving: REST (port 8501) and gRPC (port 8500)."""

from keras_selfattn.serving._tensors import ServingError
from keras_selfattn.serving.grpc_client import GrpcClient
from keras_selfattn.serving.predict import build_predict_request, parse_predict_response
from keras_selfattn.serving.rest_client import (
    RestClient,
    build_rest_request,
    parse_rest_response,
)

__all__ = [
    "GrpcClient",
    "RestClient",
    "ServingError",
    "build_predict_request",
    "build_rest_request",
    "parse_predict_response",
    "parse_rest_response",
]
