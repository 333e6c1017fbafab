"""TF Serving support: warmup files, `models.config` and a REST/gRPC client."""

from keras_selfattn.serving.model_config import (
    build_models_config,
    models_config_text,
    write_models_config,
)
from keras_selfattn.serving.warmup import read_warmup_file, write_warmup_file

__all__ = [
    "build_models_config",
    "models_config_text",
    "read_warmup_file",
    "write_models_config",
    "write_warmup_file",
]
