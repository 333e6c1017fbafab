"""Atomic replacement: a reader sees the old file or the new one.

Temporaries are created with the modes the umask gives ordinary files (as
are `keras_selfattn.export`'s), never `tempfile`'s private 0600 / 0700, which
renamed into place would stay unreadable to a server running as another user.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable


def create_exclusively(
    path_for: Callable[[str], str], create: Callable[[str], None], made: list[str]
) -> None:
    """Runs `create(path)` on `path_for(token)` for a random token, again with
    another token while the name is taken, and appends the path to `made`
    before `create` runs: a KeyboardInterrupt landing right after it still
    leaves the caller the name to remove.

    Raises:
        What `create` raises, but FileExistsError.
    """
    while True:
        path = path_for(secrets.token_hex(6))
        made.append(path)
        try:
            create(path)
        except FileExistsError:
            made.pop()
            continue
        return


def _create_file(path: str) -> None:
    # 0o666 under the umask: readable like any file written.
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))


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
    base = os.path.basename(path)
    made: list[str] = []
    try:
        create_exclusively(
            lambda token: os.path.join(folder, f".{base}.{token}.tmp"),
            _create_file,
            made,
        )
        write(made[0])
        with open(made[0], "rb") as f:
            os.fsync(f.fileno())
        os.replace(made[0], path)
    except BaseException:
        for tmp in made:
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
