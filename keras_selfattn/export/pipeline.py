"""One pipeline for every format and target: check, stage, verify, move in.

`check_destination` runs before any work (the command line runs it before
loading the model): the backend, the packages, the path and the format's
options (`formats.Format.destination`). `stage` writes an `ExportTarget`
(the model's forward endpoint, or its decoding step) into a hidden
temporary beside the destination and moves it into place when its `with`
block ends without error; verification goes in that block. `export` is the
three steps for one format.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator

from keras_selfattn.export import _files, formats
from keras_selfattn.export.formats import Destination, Writer
from keras_selfattn.export.target import ExportTarget


def check_destination(
    export_format: str,
    path: str | os.PathLike,
    *,
    argument: str | None = None,
    backend: str | None = None,
    **options: object,
) -> Destination:
    """Checks a destination before any work (backend, path, options).

    Args:
        export_format: One of `formats.NAMES`.
        path: SavedModel base dir, or the file to create.
        argument: How the caller names `path` in errors (default
            "base_dir" for a SavedModel, else "path").
        backend: The backend that writes the artifact, when another
            process writes it (`export._generator_writer`); default this process's.
        **options: The format's options (`name`, `version`, `warmup`,
            `models_config` for a SavedModel; `opset`, `fuse_attention` for
            ONNX; `shape` for LiteRT).

    Raises:
        ValueError: for a format the backend cannot export (one line naming
            the backend that can), or an invalid argument.
        FileExistsError, layout.VersionExistsError: if the target exists.
        ImportError: if the format's packages are missing (with the extra).
    """
    export = formats.get(export_format)
    if argument is None:
        argument = "path" if export.row.suffix else "base_dir"
    return export.destination(path, argument, options, backend)


@contextlib.contextmanager
def stage(
    target: ExportTarget, destination: Destination, writer: Writer | None = None
) -> Iterator[_files.Staged]:
    """Writes `target` beside its destination; moves it in after the block.

    Args:
        target: What to export (`Endpoint.target()`, `DecodeStep.target()`).
        destination: From `check_destination`.
        writer: Writes the staged artifact instead of the format's own
            `write` (`export._generator_writer`).

    Yields:
        The `_files.Staged` export (verify `staged.path` in the block).
    """
    export_format = formats.get(destination.format)
    with export_format.stage(target, destination, writer) as staged:
        yield staged


def staged_check(
    verify: Callable[..., object],
    model: object,
    export_format: str,
    check: bool,
    **arguments: object,
) -> Callable[[str], object] | None:
    """The check `export` runs on a staged artifact: `verify(model,
    **arguments)` with the staged path as its `paths`, {format: path}; None
    when not `check`."""
    if not check:
        return None
    return lambda staged: verify(model, **arguments, paths={export_format: staged})


def export(
    target: ExportTarget,
    destination: Destination,
    check: Callable[[str], object] | None,
    writer: Writer | None = None,
) -> str:
    """Stages `target` (written by `writer`, default the format's), runs
    `check` on the staged artifact (if given), and moves it into place;
    returns where it is.

    Raises:
        Whatever `check` raises (ParityError): nothing is then left.
    """
    with stage(target, destination, writer) as staged:
        if check is not None:
            check(staged.path)
    return staged.target
