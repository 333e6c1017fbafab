"""Safe file-system steps of an export: name checks and atomic writes.

Everything is first written beside its target (same directory, so the final
`os.rename` stays on one file system and is atomic), then moved into place.
The temporary is removed on any exception, `KeyboardInterrupt` included, and
an existing target is never replaced.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import tempfile
from collections.abc import Iterator

_VERSION_DIR = re.compile(r"^[0-9]+$")


def check_name(name: object) -> str:
    """Returns `name` if it is a safe single path component for a model.

    Args:
        name: The model name; it becomes a directory under the base dir and
            the model name in TF Serving's `models.config`.

    Returns:
        The name, unchanged.

    Raises:
        ValueError: if the name is not a non-empty string, contains a path
            separator or NUL, is `.` or `..`, or starts with `.` (hidden
            entries are where exports write their temporaries).
    """
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"`name` must be a non-empty string. Received: name={name!r}")
    separators = {"/", "\\", os.sep} | ({os.altsep} if os.altsep else set())
    if any(sep in name for sep in separators) or "\0" in name:
        raise ValueError(
            "`name` must be a single directory name without path separators. "
            f"Received: name={name!r}"
        )
    if not name.isprintable():
        raise ValueError(
            f"`name` must not contain control characters. Received: name={name!r}"
        )
    if name.startswith("."):
        raise ValueError(
            f"`name` must not be '.', '..' or start with '.'. Received: name={name!r}"
        )
    return name


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


def umask_mode(mode: int) -> int:
    """`mode` under the process umask: what `os.mkdir` or `open` would give.

    `tempfile` makes private (0700 / 0600) entries; renamed into place they
    would stay unreadable to a server running as another user.
    """
    umask = os.umask(0o022)
    os.umask(umask)
    return mode & ~umask


def check_version(version: object) -> int:
    """Returns `version` if it is a positive integer (TF Serving's versions).

    Raises:
        ValueError: for anything else, booleans included.
    """
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise ValueError(
            "`version` must be a positive integer or None (next free version). "
            f"Received: version={version!r}"
        )
    return version


def existing_versions(model_dir: str) -> list[int]:
    """The integer version directories in `model_dir` (empty if missing)."""
    if not os.path.isdir(model_dir):
        return []
    return sorted(
        int(entry)
        for entry in os.listdir(model_dir)
        if _VERSION_DIR.match(entry) and os.path.isdir(os.path.join(model_dir, entry))
    )


def next_version(model_dir: str) -> int:
    """The highest existing version in `model_dir` plus one, or 1."""
    versions = existing_versions(model_dir)
    return versions[-1] + 1 if versions else 1


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
