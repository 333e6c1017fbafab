"""One pipeline for every format: check the target, stage, (verify), move in.

`check_destination` runs before any work (the CLI runs it before loading the
model); `stage` writes an `ExportTarget` — the model's forward endpoint or
its decoding step — into a hidden temporary beside the destination and moves
it into place when its `with` block ends without error. Verification goes
in that block (`verify`, `verify_decode_step`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterator

from keras_selfattn.export import _files, artifacts
from keras_selfattn.export._endpoint import Endpoint
from keras_selfattn.export._runtimes import FORMATS, LITERT, ONNX, SAVED_MODEL
from keras_selfattn.export._target import ExportTarget


@dataclasses.dataclass(frozen=True)
class Destination:
    """A checked export destination.

    Attributes:
        format: One of `_runtimes.FORMATS`.
        path: The SavedModel base dir, or the file.
        version_dir: The SavedModel version folder it would write now.
        name, version: The SavedModel's name and requested version.
        opset: The ONNX opset (None: the converter's default).
        shape: LiteRT's fixed (batch, time), or None (dynamic).
    """

    format: str
    path: str
    version_dir: str | None = None
    name: str | None = None
    version: int | None = None
    opset: int | None = None
    shape: tuple[int, int] | None = None


def check_destination(
    export_format: str,
    path: str | os.PathLike,
    *,
    name: str | None = None,
    version: int | None = None,
    opset: int | None = None,
    shape: tuple[int, int] | None = None,
    argument: str | None = None,
) -> Destination:
    """Checks a destination before any work (backend, path, options).

    Args:
        export_format: One of `_runtimes.FORMATS`.
        path: SavedModel base dir, or the file to create.
        name, version: The SavedModel's (`name` required there).
        opset: The ONNX opset, or None.
        shape: LiteRT's fixed (batch, time), or None.
        argument: How the caller names `path` in errors (default
            "base_dir" for a SavedModel, else "path").

    Raises:
        ValueError: for a format the backend cannot export (one line naming
            the backend that can), or an invalid argument.
        FileExistsError, layout.VersionExistsError: if the target exists.
        ImportError: if the format's runtime is missing (with the extra).
    """
    if export_format not in FORMATS:
        raise ValueError(
            f"`export_format` must be one of {FORMATS}. "
            f"Received: export_format={export_format!r}"
        )
    if export_format == SAVED_MODEL:
        from keras_selfattn.export import saved_model

        if name is None:
            raise ValueError("A SavedModel export needs `name`. Received: name=None")
        version_dir = saved_model.check_target(
            path, name, version, argument=argument or "base_dir"
        )
        return Destination(SAVED_MODEL, os.fspath(path), version_dir, name, version)
    checked = artifacts.check_file_target(
        path, export_format, argument=argument or "path"
    )
    if export_format == ONNX:
        from keras_selfattn.export import onnx_export_module

        opset = onnx_export_module().check_opset(opset)
    shape = artifacts.check_shape(shape)
    if export_format == LITERT and shape is None:
        artifacts.require_dynamic_litert()
    artifacts.require_runtime(export_format)
    return Destination(export_format, checked, opset=opset, shape=shape)


@contextlib.contextmanager
def stage(
    target: ExportTarget,
    destination: Destination,
    *,
    models_config: bool = True,
    warmup: Callable[[str], None] | None = None,
    fuse: Endpoint | None = None,
) -> Iterator[_files.Staged]:
    """Writes `target` beside its destination; moves it in after the block.

    Args:
        target: What to export (`Endpoint.target()`, `DecodeStep.target()`).
        destination: From `check_destination`.
        models_config: SavedModel: whether to rewrite `models.config`.
        warmup: SavedModel: writes extra files into the version folder
            (the warmup requests), or None.
        fuse: ONNX: the endpoint whose SelfAttention calls become ONNX
            Attention nodes, or None.

    Yields:
        The `_files.Staged` export (verify `staged.path` in the block).
    """
    fmt = destination.format
    if fmt == SAVED_MODEL:
        from keras_selfattn.export import saved_model

        def write(directory: str) -> None:
            saved_model.write_saved_model(target, directory)
            if warmup is not None:
                warmup(directory)

        staging = saved_model.stage_version(
            destination.path,
            destination.version_dir,
            write,
            models_config=models_config,
        )
    elif fmt == ONNX:
        from keras_selfattn.export import onnx_export_module

        staging = onnx_export_module().stage_target(
            target, destination.path, destination.opset, fuse=fuse
        )
    else:
        staging = artifacts.stage_file(
            destination.path,
            fmt,
            lambda staged: artifacts.write(
                target, staged, fmt, shape=destination.shape
            ),
        )
    with staging as staged:
        yield staged
