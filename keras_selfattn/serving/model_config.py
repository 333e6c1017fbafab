"""`models.config`: the ModelServerConfig TF Serving reads at start-up.

`tensorflow_model_server --model_config_file=models.config` serves every
model listed; each `base_path` holds numbered version folders (`1/`, `2/`,
...) and, with the default policy, the highest version is served (see
`layout` for which folders count and `layout.served_model_names` for the
models worth listing).

A `base_path` must be the path the server sees. By default it is
`/models/NAME`, for the `tensorflow/serving` Docker image with the base dir
mounted at `/models`; `container_base=None` writes absolute local paths for
a `tensorflow_model_server` running on this machine.
"""

from __future__ import annotations

import os
import posixpath

from google.protobuf import text_format
from tensorflow_serving.config import model_server_config_pb2

from keras_selfattn.serving.atomic_files import atomic_write_text
from keras_selfattn.serving.layout import check_model_name

CONFIG_FILE_NAME = "models.config"
LOCAL_CONFIG_FILE_NAME = "models.local.config"
DOCKER_MODELS_DIR = "/models"


def _check_names(model_names) -> list[str]:
    if isinstance(model_names, str) or not isinstance(model_names, (list, tuple)):
        raise ValueError(
            "`model_names` must be a list of model names. "
            f"Received: model_names={model_names!r}"
        )
    if not model_names:
        raise ValueError("`model_names` must not be empty. Received: model_names=[]")
    names = [check_model_name(name) for name in model_names]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ValueError(
            f"`model_names` has duplicates {duplicates}. Received: "
            f"model_names={model_names!r}"
        )
    return names


def _base_path(base_dir: str, name: str, container_base: str | None) -> str:
    if container_base is None:
        return os.path.join(os.path.abspath(base_dir), name)
    return posixpath.join(container_base, name)


def build_models_config(
    base_dir: str,
    model_names: list[str],
    container_base: str | None = DOCKER_MODELS_DIR,
) -> model_server_config_pb2.ModelServerConfig:
    """Builds the ModelServerConfig proto serving `model_names`.

    Args:
        base_dir: The export base dir holding one folder per model.
        model_names: Names of the model folders to serve.
        container_base: Where the server sees `base_dir`: `"/models"`
            (default) writes `/models/NAME`, for Docker with `base_dir`
            mounted at `/models`; None writes absolute local paths, for a
            `tensorflow_model_server` on this machine.

    Returns:
        A `ModelServerConfig` with one `tensorflow` model per name.
    """
    if not isinstance(base_dir, (str, os.PathLike)) or not os.fspath(base_dir):
        raise ValueError(
            f"`base_dir` must be a non-empty path. Received: base_dir={base_dir!r}"
        )
    if container_base is not None and (
        not isinstance(container_base, str) or not container_base.startswith("/")
    ):
        raise ValueError(
            "`container_base` must be None or an absolute POSIX path such as "
            f"'/models'. Received: container_base={container_base!r}"
        )
    config = model_server_config_pb2.ModelServerConfig()
    for name in _check_names(model_names):
        model = config.model_config_list.config.add()
        model.name = name
        model.base_path = _base_path(os.fspath(base_dir), name, container_base)
        model.model_platform = "tensorflow"
    return config


def models_config_text(
    base_dir: str,
    model_names: list[str],
    container_base: str | None = DOCKER_MODELS_DIR,
) -> str:
    """Returns the `models.config` text (protobuf text format) for the models.

    Args:
        base_dir: The export base dir holding one folder per model.
        model_names: Names of the model folders to serve.
        container_base: See `build_models_config`: `"/models"` (default)
            for Docker, None for absolute local paths.

    Returns:
        The ModelServerConfig in text format.

    Example:

    >>> print(models_config_text("artifacts/serving", ["clf"]))
    model_config_list {
      config {
        name: "clf"
        base_path: "/models/clf"
        model_platform: "tensorflow"
      }
    }
    <BLANKLINE>
    """
    config = build_models_config(base_dir, model_names, container_base)
    return text_format.MessageToString(config)


def write_models_config(
    base_dir: str,
    model_names: list[str],
    container_base: str | None = DOCKER_MODELS_DIR,
    file_name: str = CONFIG_FILE_NAME,
) -> str:
    """Writes `base_dir/models.config` atomically, replacing an older one.

    Args:
        base_dir: The export base dir (must exist) holding one folder per
            model.
        model_names: Names of the model folders to serve.
        container_base: See `build_models_config`: `"/models"` (default)
            for Docker, None for absolute local paths.
        file_name: Name of the file in `base_dir`; e.g.
            `"models.local.config"` beside the Docker one.

    Returns:
        The path of the written file.

    Example:

    >>> import os, tempfile
    >>> base = tempfile.mkdtemp()
    >>> os.path.basename(write_models_config(base, ["clf"]))
    'models.config'
    >>> path = write_models_config(base, ["clf"], None, "models.local.config")
    >>> os.path.join(base, "clf") in open(path).read()
    True
    """
    text = models_config_text(base_dir, model_names, container_base)
    base_dir = os.fspath(base_dir)
    if not os.path.isdir(base_dir):
        raise FileNotFoundError(
            f"`base_dir` is not an existing folder. Received: base_dir={base_dir!r}"
        )
    if (
        not isinstance(file_name, str)
        or not file_name
        or os.path.basename(file_name) != file_name
        or file_name in (".", "..")
    ):
        raise ValueError(
            "`file_name` must be a plain file name without path separators. "
            f"Received: file_name={file_name!r}"
        )
    return atomic_write_text(os.path.join(base_dir, file_name), text)
