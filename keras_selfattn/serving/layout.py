"""TF Serving's folder layout: model names, versions, where warmup goes.

An export base dir holds one folder per model, `BASE_DIR/NAME/`, and each
model folder holds numbered version folders, `NAME/VERSION/`. The exporters,
`models.config` and the clients all follow the rules here, so a name an
export writes is a name the config lists and a client may ask for.

What a version folder is (one definition, two questions):

- **Served**: a folder whose name is a decimal number and that holds
  `saved_model.pb`. TF Serving serves a numbered folder only if it holds a
  loadable SavedModel, so a model folder without one is left out of
  `models.config` (the server would wait for it forever).
- **Taken**: any folder whose name is a decimal number, SavedModel or not.
  A new export takes the highest taken number plus one and never writes an
  explicit version that is taken: a numbered folder without `saved_model.pb`
  may be a copy in progress or kept by hand, and is never overwritten.

Hidden entries (a name starting with "."), such as an interrupted export's
`.N.tmp-*` folder, are neither: they are not numbers.
"""

from __future__ import annotations

import os
import re

SAVED_MODEL_FILE = "saved_model.pb"
WARMUP_DIR_NAME = "assets.extra"
WARMUP_FILE_NAME = "tf_serving_warmup_requests"
# Where TF Serving (`--enable_model_warmup`) reads warmup records, relative to
# a version folder.
WARMUP_PATH = os.path.join(WARMUP_DIR_NAME, WARMUP_FILE_NAME)

_NUMBER = re.compile(r"^[0-9]+$")


class VersionExistsError(FileExistsError):
    """An explicit version that is taken (see the module docstring).

    Attributes:
        name: The model name.
        version: The version asked for.
        model_dir: The model folder holding it.
    """

    def __init__(self, name: str, version: int, model_dir: str):
        super().__init__(
            f"Version {version} of model {name!r} already exists in {model_dir} "
            "and is never overwritten; pass another `version` or None"
        )
        self.name = name
        self.version = version
        self.model_dir = model_dir


def check_model_name(value: object, argument: str = "model_name") -> str:
    """Returns `value` if it is a valid model name: a plain folder name.

    Args:
        value: The candidate name. It is a folder of the base dir, the name
            in `models.config` and the name clients ask for.
        argument: The argument's name in error messages.

    Returns:
        `value`, unchanged.

    Raises:
        ValueError: if the name is not a non-blank string, contains a path
            separator, NUL or another control character, or starts with "."
            (".", "..", and hidden entries, where exports write their
            temporaries).
    """
    received = f"Received: {argument}={value!r}"
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"`{argument}` must be a non-empty string. {received}")
    separators = {"/", "\\", os.sep} | ({os.altsep} if os.altsep else set())
    if any(sep in value for sep in separators) or "\0" in value:
        raise ValueError(
            f"`{argument}` must be a single directory name without path "
            f"separators. {received}"
        )
    if not value.isprintable():
        raise ValueError(
            f"`{argument}` must not contain control characters. {received}"
        )
    if value.startswith("."):
        raise ValueError(
            f"`{argument}` must not be '.', '..' or start with '.'. {received}"
        )
    return value


def check_version(value: object) -> int | None:
    """Returns `value` if it is a positive integer (TF Serving's versions) or None.

    Raises:
        ValueError: for anything else, booleans included.
    """
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, int) or value < 1
    ):
        raise ValueError(
            f"`version` must be a positive integer or None. Received: version={value!r}"
        )
    return value


def _numbered(model_dir: str) -> list[str]:
    if not os.path.isdir(model_dir):
        return []
    return [
        entry
        for entry in os.listdir(model_dir)
        if _NUMBER.match(entry) and os.path.isdir(os.path.join(model_dir, entry))
    ]


def taken_versions(model_dir: str) -> list[int]:
    """Numbers of every numbered folder of `model_dir`, sorted (empty if missing)."""
    return sorted({int(entry) for entry in _numbered(model_dir)})


def served_versions(model_dir: str) -> list[int]:
    """Numbers of the numbered folders of `model_dir` holding `saved_model.pb`."""
    return sorted(
        {
            int(entry)
            for entry in _numbered(model_dir)
            if os.path.isfile(os.path.join(model_dir, entry, SAVED_MODEL_FILE))
        }
    )


def new_version(model_dir: str, name: str, version: int | None = None) -> int:
    """The version a new export of model `name` in `model_dir` writes.

    Args:
        model_dir: The model folder (may be missing).
        name: The model name, for the error message.
        version: An explicit version, or None for the highest taken one plus
            one (1 for a new model).

    Returns:
        The version number.

    Raises:
        VersionExistsError: if the explicit `version` is taken.
    """
    taken = taken_versions(model_dir)
    if version is None:
        return taken[-1] + 1 if taken else 1
    if version in taken:
        raise VersionExistsError(name, version, model_dir)
    return version


def served_model_names(base_dir: str | os.PathLike) -> list[str]:
    """Names of the model folders of `base_dir` with at least one served version.

    Args:
        base_dir: The export base dir.

    Returns:
        The model names, sorted; hidden folders are skipped.

    Raises:
        FileNotFoundError: if `base_dir` is not a folder.
    """
    base_dir = os.fspath(base_dir)
    if not os.path.isdir(base_dir):
        raise FileNotFoundError(
            f"`base_dir` is not an existing folder. Received: base_dir={base_dir!r}"
        )
    return [
        entry
        for entry in sorted(os.listdir(base_dir))
        if not entry.startswith(".") and served_versions(os.path.join(base_dir, entry))
    ]
