"""File-system helpers shared by the export tests."""

import contextlib
import hashlib
import os
from collections.abc import Iterator

from keras_selfattn.export._files import atomic_files


def tree_digest(root: str | os.PathLike) -> str:
    """Hash of every path and file content under `root`."""
    digest = hashlib.sha256()
    for directory, dirs, files in sorted(os.walk(root)):
        dirs.sort()
        digest.update(os.path.relpath(directory, root).encode())
        for name in sorted(files):
            digest.update(name.encode())
            with open(os.path.join(directory, name), "rb") as handle:
                digest.update(handle.read())
    return digest.hexdigest()


@contextlib.contextmanager
def atomic_file(target: str) -> Iterator[str]:
    """A temporary file path that becomes `target` when the block ends:
    `atomic_files` for one file (its base name, in the hidden folder)."""
    with atomic_files([target]) as folder:
        yield os.path.join(folder, os.path.basename(target))
