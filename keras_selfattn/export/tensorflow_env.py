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
ops on (`converter_env`), where it peaked lower converting a 0.59 B
Llama's generator (16.10 GiB against 18.25 GiB off; 7.41 and 7.45 GiB,
one way and the other, at 0.81 GiB of weights).
"""

from __future__ import annotations

import os

ONEDNN = "TF_ENABLE_ONEDNN_OPTS"
# The converter folds constants by running TensorFlow's kernels on them
# expanded, a marker's matrix (`litert_weights`) at a time. glibc's malloc
# keeps such blocks in its heap once freed (its mapping threshold grows to
# 32 MiB), and a 0.59 B Llama's converter peaked at 9.23 GiB; each block
# from 1 MiB mapped on its own and handed back when freed, at 4.33 GiB.
MMAP_THRESHOLD = "MALLOC_MMAP_THRESHOLD_"
MMAP_BYTES = 2**20


def writer_env(**variables: str) -> dict[str, str]:
    """This process's environment for a TensorFlow process that writes an
    export: oneDNN's ops off unless set here, then `variables`."""
    return {**os.environ, ONEDNN: os.environ.get(ONEDNN, "0"), **variables}


def converter_env(**variables: str) -> dict[str, str]:
    """This process's environment for the LiteRT converter's process:
    oneDNN's ops on, glibc's malloc mapping each block from `MMAP_BYTES`
    (`MALLOC_MMAP_THRESHOLD_`), then `variables`."""
    return {**os.environ, ONEDNN: "1", MMAP_THRESHOLD: str(MMAP_BYTES), **variables}
