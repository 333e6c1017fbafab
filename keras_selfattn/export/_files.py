"""Atomic creation of an export: written beside its target, then moved in.

Everything is first written beside its target (same directory, so the final
`os.rename` stays on one file system and is atomic), then moved into place.
The temporary is removed on any exception, `KeyboardInterrupt` included, and
an existing target is never replaced. Temporaries get the modes the umask
gives ordinary files (`serving._files.umask_mode`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import shutil
import tempfile
from collections.abc import Iterator

from keras_selfattn.serving._files import umask_mode


@dataclasses.dataclass(frozen=True)
class Staged:
    """An export written but not yet in place.

    Attributes:
        path: The hidden temporary holding it, beside `target`.
        target: Where it appears when its `with` block ends without error.
    """

    path: str
    target: str


def check_path(argument: str, value: object) -> str:
    """Returns `value` as a string path if it is a non-empty path.

    Raises:
        ValueError: if it is not a str or os.PathLike, or is empty.
    """
    if not isinstance(value, str | os.PathLike) or not os.fspath(value):
        raise ValueError(
            f"`{argument}` must be a non-empty path. Received: {argument}={value!r}"
        )
    return os.fspath(value)


def _make_dirs(path: str) -> list[str]:
    """Creates `path` and its missing parents; returns those it made."""
    missing = []
    while not os.path.isdir(path) and os.path.dirname(path) != path:
        if os.path.lexists(path):
            raise NotADirectoryError(errno.ENOTDIR, "Not a directory", path)
        missing.append(path)
        path = os.path.dirname(path)
    made: list[str] = []
    try:
        for directory in reversed(missing):
            os.mkdir(directory)
            made.append(directory)
    except BaseException:
        _remove_empty(made)
        raise
    return made


def _remove_empty(directories: list[str]) -> None:
    """Removes directories made by `_make_dirs` again, if still empty."""
    for directory in reversed(directories):
        with contextlib.suppress(OSError):
            os.rmdir(directory)


def refuse_existing(path: str, what: str) -> None:
    """Raises FileExistsError if `path` exists (as anything)."""
    if os.path.lexists(path):
        raise FileExistsError(
            errno.EEXIST,
            f"{what} already exists and is never overwritten; choose another "
            "target or remove it first",
            path,
        )


@contextlib.contextmanager
def atomic_directory(target: str) -> Iterator[str]:
    """Yields a temporary directory that becomes `target` on success.

    Example:

    >>> with atomic_directory("models/clf/3") as tmp:  # doctest: +SKIP
    ...     write_everything_into(tmp)

    Raises:
        FileExistsError: if `target` exists (checked before and at the rename).
    """
    parent = os.path.dirname(os.path.abspath(target))
    refuse_existing(target, "Export directory")
    created = _make_dirs(parent)
    try:
        tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(target)}.tmp-", dir=parent)
        os.chmod(tmp, umask_mode(0o777))
    except BaseException:
        _remove_empty(created)
        raise
    try:
        yield tmp
        refuse_existing(target, "Export directory")
        try:
            os.rename(tmp, target)
        except OSError as error:
            if error.errno in (errno.EEXIST, errno.ENOTEMPTY):
                refuse_existing(target, "Export directory")
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        _remove_empty(created)
        raise


@contextlib.contextmanager
def atomic_file(target: str) -> Iterator[str]:
    """Yields a temporary file path that becomes `target` on success.

    The file is linked into place with `os.link`, which fails instead of
    replacing a file created meanwhile.

    Raises:
        FileExistsError: if `target` exists.
    """
    parent = os.path.dirname(os.path.abspath(target))
    refuse_existing(target, "Output file")
    created = _make_dirs(parent)
    tmp = None
    try:
        handle, tmp = tempfile.mkstemp(
            prefix=f".{os.path.basename(target)}.tmp-", dir=parent
        )
        os.close(handle)
        os.chmod(tmp, umask_mode(0o666))
        yield tmp
        try:
            os.link(tmp, target)
        except FileExistsError:
            refuse_existing(target, "Output file")
            raise
    except BaseException:
        if tmp is not None:
            with contextlib.suppress(FileNotFoundError):
                os.remove(tmp)
        _remove_empty(created)
        raise
    os.remove(tmp)
