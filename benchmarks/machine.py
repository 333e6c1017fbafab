"""The one description of the machine and software a benchmark ran on.

Library versions come from the installed distributions' metadata, so
describing the machine imports neither TensorFlow nor any runtime (the
backends benchmark runs where only keras + jax or keras + torch exist).
"""

from __future__ import annotations

import datetime
import hashlib
import importlib.metadata
import os
import platform
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# result key -> distribution name
DISTRIBUTIONS = {
    "keras": "keras",
    "tensorflow": "tensorflow",
    "jax": "jax",
    "torch": "torch",
    "onnxruntime": "onnxruntime",
    "openvino": "openvino",
    "ai_edge_litert": "ai-edge-litert",
}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def vnni_flags() -> list[str] | None:
    """The CPU's VNNI flags (`avx512_vnni`, `avx_vnni`, ...): the int8
    dot-product instructions integer matmul kernels use; [] for none, None
    when /proc/cpuinfo has no x86 flags line."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    flags = line.split(":", 1)[1].split()
                    return sorted(flag for flag in flags if "vnni" in flag)
    except OSError:
        pass
    return None


def _load_average() -> list[float] | None:
    try:
        return [round(value, 2) for value in os.getloadavg()]
    except OSError:
        return None


def _memory_gib() -> float | None:
    try:
        with open("/proc/meminfo", encoding="utf-8") as meminfo:
            for line in meminfo:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / 1024**2, 1)
    except OSError:
        pass
    return None


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git(*args: str) -> str | None:
    try:
        completed = subprocess.run(
            ["git", "-C", REPO, *args],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return completed.stdout.strip()


def _layer_sources() -> tuple[str, list[str], list[str]]:
    """SHA-256 of the loaded keras_selfattn modules' sources, their paths, and
    those that differ from the commit."""
    paths = sorted(
        os.path.relpath(module.__file__, REPO)
        for name, module in list(sys.modules.items())
        if (name == "keras_selfattn" or name.startswith("keras_selfattn."))
        and getattr(module, "__file__", None)
    )
    digest = hashlib.sha256()
    for path in paths:
        digest.update(path.encode())
        with open(os.path.join(REPO, path), "rb") as source:
            digest.update(source.read())
    status = _git("status", "--porcelain", "--", *paths) if paths else ""
    modified = [line[3:] for line in (status or "").splitlines()]
    return digest.hexdigest()[:16], paths, modified


def describe(backend=None) -> dict:
    """CPU, VNNI flags, cores, memory, load, OS, library versions, commit,
    layer, UTC date.

    `layer_sha256` hashes the sources of the keras_selfattn modules this run
    loaded, and `layer_modified` lists those that differ from `git_commit`,
    so a "before" run can be told from an "after" run while the layer is
    being changed in the same checkout.

    Args:
        backend: a `benchmarks.runners` backend, whose name, version and
            device are added; None for none.
    """
    layer_sha256, layer_files, modified = _layer_sources()
    result = {
        "cpu": _cpu_model(),
        "vnni": vnni_flags(),
        "cores": os.cpu_count(),
        "memory_gib": _memory_gib(),
        "load_average_1_5_15min": _load_average(),
        "os": platform.platform(),
        "python": platform.python_version(),
        **{key: _version(name) for key, name in DISTRIBUTIONS.items()},
        "git_commit": _git("rev-parse", "--short", "HEAD"),
        "layer_sha256": layer_sha256,
        "layer_files": layer_files,
        "layer_modified": modified,
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime(
            "%Y-%m-%d %H:%M UTC"
        ),
    }
    if backend is not None:
        result.update(
            backend=backend.name,
            backend_version=backend.version(),
            device=backend.device(),
        )
    return result
