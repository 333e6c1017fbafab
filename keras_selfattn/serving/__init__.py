"""TF Serving support: folder layout, warmup files, `models.config`, clients.

Each name is imported from its module on first use, so importing this
package loads neither TensorFlow nor gRPC: `RestClient` and the layout rules
need neither, warmup files and `PredictRequest`s need TensorFlow (TF
Serving's protos are built on it) and `GrpcClient` also gRPC.
"""

import importlib

from keras_selfattn import _tensorflow_extra

_MODULES = {
    "GrpcClient": "grpc_client",
    "RestClient": "rest_client",
    "ServingError": "_tensors",
    "build_models_config": "model_config",
    "build_predict_request": "predict",
    "build_rest_request": "rest_client",
    "models_config_text": "model_config",
    "parse_predict_response": "predict",
    "parse_rest_response": "rest_client",
    "read_warmup_file": "warmup",
    "served_model_names": "layout",
    "write_models_config": "model_config",
    "write_warmup_file": "warmup",
}

__all__ = sorted(_MODULES)


def __getattr__(name: str):
    if name not in _MODULES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        module = importlib.import_module(f"{__name__}.{_MODULES[name]}")
    except ImportError as error:
        if not _tensorflow_extra.is_missing(error):
            raise
        what = f"keras_selfattn.serving.{name}"
        raise _tensorflow_extra.missing(what, error) from None
    return getattr(module, name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
