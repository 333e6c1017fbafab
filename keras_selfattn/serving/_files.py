"""File modes and atomic replacement: a reader sees the old file or the new one.

`umask_mode` is the one rule for the modes of everything this package and
`keras_selfattn.export` write through temporaries.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable


def umask_mode(mode: int) -> int:
    """`mode` under the process umask: what `os.mkdir` or `open` would give.

    `tempfile` makes private (0700 / 0600) entries; renamed into place they
    would stay unreadable to a server running as another user.
    """
    umask = os.umask(0o022)
    os.umask(umask)
    return mode & ~umask


def atomic_write(path: str, write: Callable[[str], None]) -> str:
    """Runs `write(tmp_path)` on a temporary file, then renames it to `path`.

    The temporary file sits beside `path` (same filesystem, so the rename is
    atomic) and is removed if `write` fails.

    Args:
        path: Destination file. Its folder must exist.
        write: Callable writing the complete content to the path it gets.

    Returns:
        `path`.
    """
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise FileNotFoundError(
            f"The folder of `path` does not exist. Received: path={path!r}"
        )
    fd, tmp = tempfile.mkstemp(
        prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=folder
    )
    os.close(fd)
    os.chmod(tmp, umask_mode(0o666))  # mkstemp's 0600 would stay private
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return path


def atomic_write_text(path: str, text: str) -> str:
    """Writes `text` (UTF-8) to `path` atomically; returns `path`."""

    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)

    return atomic_write(path, write)
