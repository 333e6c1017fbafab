"""The environment of the TensorFlow processes that write exports.

oneDNN's ops (TensorFlow's default on x86 Linux) come with oneDNN's CPU
allocator, which keeps every block it once held for reuse and never hands
it back: building a Keras model of 2.41 GiB of random weights left its
process at 4.81 GiB resident, 3.24 GiB with `TF_ENABLE_ONEDNN_OPTS=0`
(docs/export.md, "Large models"). A process that builds a model to export
it computes little, so the ones this package runs (its command line, the
TensorFlow process writing a JAX or PyTorch model's generator) run with
oneDNN's ops off unless the environment sets `TF_ENABLE_ONEDNN_OPTS`. The
runtimes' checks run as the environment says. The LiteRT converter's
process builds no model and ends after converting: it runs with oneDNN's
ops off too, and with one malloc arena (`converter_env`). Its passes run
on several threads, each of which took an arena of its own that kept what
it freed: a 0.59 B Llama's generator (its markers unfolded,
`litert_unfolded`) peaked at 4.49 GiB with oneDNN's ops on, 4.20 off, 3.67
on with one arena and 3.38 off with one arena, in the same time (Intel
Xeon, 2026-12-01). Before the markers, oneDNN's ops on had peaked lower
(16.10 GiB against 18.25 off at 0.59 B; 7.41 and 7.45 GiB, one way and the
other, at 0.81 GiB of weights).

The caller's own process is the caller's: `export_generator` warns there
(`onednn_memory_warning`) when it exports a large model on TensorFlow
with oneDNN's ops on, and says how to turn them off.
"""

from __future__ import annotations

import os
import platform

ONEDNN = "TF_ENABLE_ONEDNN_OPTS"
# The converter folds constants by running TensorFlow's kernels on them
# expanded, a marker's matrix (`litert_weights`) at a time. glibc's malloc
# keeps such blocks in its heap once freed (its mapping threshold grows to
# 32 MiB), and a 0.59 B Llama's converter peaked at 9.23 GiB; each block
# from 1 MiB mapped on its own and handed back when freed, at 4.33 GiB.
MMAP_THRESHOLD = "MALLOC_MMAP_THRESHOLD_"
MMAP_BYTES = 2**20
# glibc's malloc arenas: one, shared by the converter's threads.
ARENA_MAX = "MALLOC_ARENA_MAX"
# Weights from which a generator export in a process with oneDNN's ops on
# warns of their allocator: at 0.59 B parameters (2.21 GiB) the SavedModel
# generator's export took 3.3x the weights (the default conversion) to 4.2x
# (a copy, the original dropped) with them on, 2.9x off (Intel Xeon,
# 2026-12-03; docs/export.md).
LARGE_WEIGHT_BYTES = 2**30


def writer_env(**variables: str) -> dict[str, str]:
    """This process's environment for a TensorFlow process that writes an
    export: oneDNN's ops off unless set here, then `variables`."""
    return {**os.environ, ONEDNN: os.environ.get(ONEDNN, "0"), **variables}


def converter_env(**variables: str) -> dict[str, str]:
    """This process's environment for the LiteRT converter's process:
    oneDNN's ops off, glibc's malloc mapping each block from `MMAP_BYTES`
    (`MALLOC_MMAP_THRESHOLD_`) in one arena (`MALLOC_ARENA_MAX`), then
    `variables`."""
    return {
        **os.environ,
        ONEDNN: "0",
        MMAP_THRESHOLD: str(MMAP_BYTES),
        ARENA_MAX: "1",
        **variables,
    }


def onednn_memory_warning(weight_bytes: int, backend: str) -> str | None:
    """What exporting `weight_bytes` of weights from a `backend` process
    costs with TensorFlow's oneDNN ops on (its default on x86 Linux, where
    `TF_ENABLE_ONEDNN_OPTS` is not "0"), or None where they are off or the
    model is under `LARGE_WEIGHT_BYTES`. On JAX and PyTorch the TensorFlow
    process that writes the generator sets them off itself (`writer_env`)."""
    setting = os.environ.get(ONEDNN)
    if (
        weight_bytes < LARGE_WEIGHT_BYTES
        or backend != "tensorflow"
        or setting == "0"
        or platform.system() != "Linux"
        or platform.machine().lower() not in ("x86_64", "amd64")
    ):
        return None
    return (
        f"TensorFlow's oneDNN ops are on in this process ({ONEDNN}="
        f"{setting if setting is not None else 'unset'}): their allocator keeps "
        "the memory the process frees, so exporting this model "
        f"({weight_bytes / 2**30:.2f} GiB of weights) may take 3.3 to 4.2 times "
        f"its weights resident; set {ONEDNN}=0 before TensorFlow is imported "
        'for about 2.9 times (docs/export.md, "Large models")'
    )
