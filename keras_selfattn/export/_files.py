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
import re
import shutil
import tempfile
from collections.abc import Iterator, Sequence

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


def _temporary_prefix(name: str) -> str:
    return f".{name}.tmp-"


def _make_temporary(parent: str, name: str) -> str:
    """A hidden folder `.NAME.tmp-PID-XXXX` in `parent`, after removing those
    of exports of NAME whose process is gone (killed with SIGKILL, which no
    cleanup survives); others' names and live processes' folders stay."""
    prefix = _temporary_prefix(name)
    pattern = re.compile(re.escape(prefix) + r"([0-9]+)-[^/]*$")
    for entry in os.listdir(parent):
        match = pattern.match(entry)
        if match and not _alive(int(match.group(1))):
            shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=parent)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


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
        tmp = _make_temporary(parent, os.path.basename(target))
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
def atomic_files(targets: Sequence[str]) -> Iterator[str]:
    """Yields a hidden folder whose files named like `targets` are linked in.

    The caller writes each target's file into the folder under the target's
    base name (so files that refer to each other by name, such as OpenVINO's
    `.xml` and `.bin`, stay together); after the block each is linked into
    place with `os.link`, which fails instead of replacing a file created
    meanwhile, and the folder is removed. On any exception nothing is left:
    neither the folder nor the targets linked so far.

    Args:
        targets: The files to create, all in one folder.

    Raises:
        FileExistsError: if a target exists.
    """
    targets = [os.path.abspath(target) for target in targets]
    for target in targets:
        refuse_existing(target, "Output file")
    parent = os.path.dirname(targets[0])
    created = _make_dirs(parent)
    tmp, linked = None, []
    try:
        tmp = _make_temporary(parent, os.path.basename(targets[0]))
        os.chmod(tmp, umask_mode(0o777))
        yield tmp
        for target in targets:
            try:
                os.link(os.path.join(tmp, os.path.basename(target)), target)
            except FileExistsError:
                refuse_existing(target, "Output file")
                raise
            linked.append(target)
    except BaseException:
        for target in linked:
            with contextlib.suppress(FileNotFoundError):
                os.remove(target)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        _remove_empty(created)
        raise
    shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def atomic_file(target: str) -> Iterator[str]:
    """Yields a temporary file path that becomes `target` on success.

    The file has `target`'s base name, in a hidden folder beside it (see
    `atomic_files`).

    Raises:
        FileExistsError: if `target` exists.
    """
    with atomic_files([target]) as folder:
        yield os.path.join(folder, os.path.basename(target))
