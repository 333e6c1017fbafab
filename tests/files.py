"""File-system helpers shared by the export tests."""

import hashlib
import os


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
