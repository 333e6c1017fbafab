"""Atomic creation of an export: written beside its target, then moved in.

Everything is first written beside its target (same directory, so the final
`os.rename` stays on one file system and is atomic), then moved into place.
The temporary is removed on any exception, `KeyboardInterrupt` included, and
an existing target is never replaced. Temporaries get the modes the umask
gives ordinary files.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import re
import shutil
from collections.abc import Iterator, Sequence

from keras_selfattn.serving.atomic_files import create_exclusively


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


def _make_dirs(path: str, made: list[str]) -> None:
    """Creates `path` and its missing parents, appending each to `made`
    before making it (so an interrupt cannot hide one from the cleanup)."""
    missing = []
    while not os.path.isdir(path) and os.path.dirname(path) != path:
        if os.path.lexists(path):
            raise NotADirectoryError(errno.ENOTDIR, "Not a directory", path)
        missing.append(path)
        path = os.path.dirname(path)
    for directory in reversed(missing):
        made.append(directory)
        try:
            os.mkdir(directory)
        except FileExistsError:  # made meanwhile by someone else: not ours
            made.pop()
            if not os.path.isdir(directory):
                raise


def _remove_empty(directories: list[str]) -> None:
    """Removes directories made by `_make_dirs` again, if still empty."""
    for directory in reversed(directories):
        with contextlib.suppress(OSError):
            os.rmdir(directory)


def _temporary_prefix(name: str) -> str:
    return f".{name}.tmp-"


def _make_temporary(parent: str, name: str, made: list[str]) -> None:
    """Makes a hidden folder `.NAME.tmp-PID-XXXX` in `parent` and appends it
    to `made`, after removing those of exports of NAME whose process is gone
    (killed with SIGKILL, which no cleanup survives); others' names and live
    processes' folders stay.

    The path is in `made` before the folder exists (`create_exclusively`).
    Its mode is what the umask gives ordinary folders.
    """
    prefix = _temporary_prefix(name)
    pattern = re.compile(re.escape(prefix) + r"([0-9]+)-[^/]*$")
    for entry in os.listdir(parent):
        match = pattern.match(entry)
        if match and not _alive(int(match.group(1))):
            shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)
    create_exclusively(
        lambda token: os.path.join(parent, f"{prefix}{os.getpid()}-{token}"),
        lambda path: os.mkdir(path, 0o777),
        made,
    )


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
    created: list[str] = []
    temporary: list[str] = []
    try:
        _make_dirs(parent, created)
        _make_temporary(parent, os.path.basename(target), temporary)
        yield temporary[0]
        refuse_existing(target, "Export directory")
        try:
            os.rename(temporary[0], target)
        except OSError as error:
            if error.errno in (errno.EEXIST, errno.ENOTEMPTY):
                refuse_existing(target, "Export directory")
            raise
    except BaseException:
        _remove(temporary, created)
        raise


@contextlib.contextmanager
def atomic_files(targets: Sequence[str]) -> Iterator[str]:
    """Yields a hidden folder whose files named like `targets` are linked in.

    The caller writes each target's file into the folder under the target's
    base name (so files that refer to each other by name, such as OpenVINO's
    `.xml` and `.bin`, stay together); after the block each is linked into
    place with `os.link`, which fails instead of replacing a file created
    meanwhile, the first target last (the files it refers to are in place
    when it appears), and the folder is removed. A target after the first
    that was not written is skipped (an ONNX file's external data, written
    only past 2 GiB of weights). On any exception nothing is left:
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
    created: list[str] = []
    temporary: list[str] = []
    linked: list[str] = []
    try:
        _make_dirs(parent, created)
        _make_temporary(parent, os.path.basename(targets[0]), temporary)
        yield temporary[0]
        for target in [*targets[1:], targets[0]]:
            staged = os.path.join(temporary[0], os.path.basename(target))
            if target != targets[0] and not os.path.exists(staged):
                continue
            linked.append(target)
            try:
                os.link(staged, target)
            except FileExistsError:
                linked.pop()
                refuse_existing(target, "Output file")
                raise
    except BaseException:
        for target in linked:
            with contextlib.suppress(FileNotFoundError):
                os.remove(target)
        _remove(temporary, created)
        raise
    try:
        shutil.rmtree(temporary[0], ignore_errors=True)
    finally:  # again if a signal cut the first removal short (the targets
        # are complete and in place; their hidden folder must not stay)
        shutil.rmtree(temporary[0], ignore_errors=True)


def _remove(temporary: list[str], created: list[str]) -> None:
    """Removes the temporary folder (if made) and the parents made for it."""
    for path in temporary:
        shutil.rmtree(path, ignore_errors=True)
    _remove_empty(created)
