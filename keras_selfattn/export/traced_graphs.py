"""Dropping what tracing a model's graphs kept, and handing the memory back.

TensorFlow's `tf.custom_gradient`, traced into a graph, registers its
gradient function in TensorFlow's process-wide gradient registry under a
new name and never removes it (tensorflow/tensorflow#97697, #27492). The
function holds the traced tensors, and through them the whole graph:
every `tf.nn.silu` (the feed-forward layers of keras-hub's Llama, Mistral
and Gemma call it) keeps the graph it was traced in alive for the life of
the process. An export differentiates none of the graphs it traces (the
artifact's function, the loop a generator's check runs as the reference,
the SavedModel a LiteRT file is converted from), so `released` drops the
registrations made within it and, for a model of `COLLECTED_BYTES` of
weights or more, collects and gives the freed memory back to the system:
before the fresh-process check (`pipeline.stage`), and before LiteRT's
converter starts beside the model (`formats.litert_signatures`;
docs/export.md, "Large models").
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING

from keras_selfattn.export import formats

if TYPE_CHECKING:
    import keras
# How `tf.custom_gradient` names the gradients it registers in a graph.
_CUSTOM_GRADIENT = "CustomGradient-"
# A full collection takes about 0.2 s in a process holding TensorFlow and
# Keras, longer as it grows: under this much weight, the dropped graphs are
# left to Python's own collections.
COLLECTED_BYTES = 2**27


def _gradient_registry() -> dict | None:
    """TensorFlow's gradient functions by name (private: no public route
    removes one), or None where TensorFlow is not imported or holds no
    such registry."""
    ops = sys.modules.get("tensorflow.python.framework.ops")
    registry = getattr(getattr(ops, "_gradient_registry", None), "_registry", None)
    return registry if isinstance(registry, dict) else None


@contextlib.contextmanager
def released(model: keras.Model) -> Iterator[None]:
    """Within the context, graphs of `model` may be traced; after it, the
    custom gradients they registered are dropped, and where the model
    holds `COLLECTED_BYTES` of weights or more, the memory they held goes
    back to the system (`return_freed_memory`)."""
    before = set(_gradient_registry() or ())
    try:
        yield
    finally:
        registry = _gradient_registry()
        if registry is not None:
            for name in [n for n in registry if n not in before]:
                if name.startswith(_CUSTOM_GRADIENT):
                    del registry[name]
        if formats.model_weight_bytes(model) >= COLLECTED_BYTES:
            return_freed_memory()


def return_freed_memory() -> None:
    """Collects reference cycles and gives the memory this process freed
    back to the system (glibc's `malloc_trim`; nothing elsewhere)."""
    gc.collect()
    name = ctypes.util.find_library("c")
    try:
        ctypes.CDLL(name).malloc_trim(0)
    except (OSError, AttributeError, TypeError):  # not glibc
        pass
