"""TF Serving support: warmup files, `models.config` and REST/gRPC clients."""

from keras_selfattn.serving.client import (
    GrpcClient,
    RestClient,
    ServingError,
    build_predict_request,
    build_rest_request,
    parse_predict_response,
    parse_rest_response,
)
from keras_selfattn.serving.model_config import (
    build_models_config,
    models_config_text,
    served_model_names,
    write_models_config,
)
from keras_selfattn.serving.warmup import read_warmup_file, write_warmup_file

__all__ = [
    "GrpcClient",
    "RestClient",
    "ServingError",
    "build_models_config",
    "build_predict_request",
    "build_rest_request",
    "models_config_text",
    "parse_predict_response",
    "parse_rest_response",
    "read_warmup_file",
    "served_model_names",
    "write_models_config",
    "write_warmup_file",
]
