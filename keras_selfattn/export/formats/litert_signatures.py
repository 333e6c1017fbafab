"""Several export targets in one LiteRT file, each under a signature of its own.

Keras's LiteRT export converts one function: its signature is
"serving_default" and its outputs are named by position (`output_0`, ...).
A file with several entry points over one model (a generator's "generate",
"prefill" and "decode") is converted the way Keras converts one (TensorFlow
backend): a SavedModel written by Keras's `ExportArchive`, here with one
endpoint per target, each returning its outputs keyed by name, then
TensorFlow's converter with Keras's settings, asked for exactly those
signatures, in a process of its own (`litert_process`). The signatures
keep the targets' names, inputs and outputs alike. The variables are
frozen into constants, which the signatures share; the model's matrices
are converted as markers and written in after (`litert_weights`; a large
model's as FILL operations the converter never expands,
`litert_unfolded`), so the converter never holds them.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Callable, Sequence

import keras

from keras_selfattn.export.formats import (
    litert_process,
    litert_unfolded,
    litert_weights,
)
from keras_selfattn.export.signature import Signature
from keras_selfattn.export.traced_graphs import released

logger = logging.getLogger(__name__)


def _named(target: Signature, marked: Sequence[litert_weights.Marked]) -> Callable:
    """`target`'s function on one list of its inputs, returning its outputs
    keyed by name (the signature's output names), the `marked` matrices
    read as their markers."""

    def serve(tensors):
        with litert_weights.read_as_markers(marked):
            return target.call_named(
                dict(zip(target.input_names, tensors, strict=True))
            )

    return serve


def convert(
    entries: Sequence[tuple[Signature, list]],
    path: str,
    weights: int,
    large: bool = False,
) -> None:
    """Writes the targets into the .tflite file `path`, one signature each.

    Run it inside the LiteRT format's contexts (quantized layers traced,
    attention unchunked), as Keras's export is.

    Args:
        entries: (target, input signature) pairs: each target becomes the
            signature `target.signature_name`, its inputs as given
            (`model.export`'s `input_signature`: one list of
            `keras.InputSpec`).
        weights: The model's weights in bytes, which the converter's
            memory is reckoned from (`litert_process.check_memory`).
        large: Write the weights after the flatbuffer, at offsets it records
            (TensorFlow's `_experimental_use_buffer_offset`: a flatbuffer
            holds at most 2 GiB).

    Raises:
        litert_process.OutOfMemory: if the converter cannot fit in the
            memory available, or ran the machine short.
        RuntimeError: the converter's failure, with what it printed.
    """
    marked = litert_weights.marks(entries[0][0].model)
    if marked:
        try:
            _convert(entries, path, weights, large, marked)
            placed = litert_unfolded.place(path, marked) if large else set()
            if placed is not None and litert_weights.fill(path, marked, placed):
                return
            why = "a marked matrix's buffer could not be told apart"
        except litert_weights.Assigned as error:
            why = str(error)
        logger.info("LiteRT: converting again with the weights (%s)", why)
    _convert(entries, path, weights, large, ())


def _convert(
    entries: Sequence[tuple[Signature, list]],
    path: str,
    weights: int,
    large: bool,
    marked: Sequence[litert_weights.Marked],
) -> None:
    """Writes the SavedModel of the targets, `marked` matrices read as their
    markers, and converts it into `path`."""
    with tempfile.TemporaryDirectory(prefix="keras_selfattn_litert_") as saved:
        # The traced graphs are dropped, and the memory they held handed
        # back, before the converter starts beside this process: a 0.59 B
        # Llama's generator 4.37 GiB resident then, 3.78 with the graphs
        # its SiLUs' gradients kept alive (`traced_graphs`).
        with released(entries[0][0].model):
            _write_saved_model(entries, marked, saved)
        keys = [target.signature_name for target, _ in entries]
        litert_process.convert(
            saved, path, keys, large, weights, unfold=large and bool(marked)
        )


def _write_saved_model(
    entries: Sequence[tuple[Signature, list]],
    marked: Sequence[litert_weights.Marked],
    directory: str,
) -> None:
    """The SavedModel of the targets, one endpoint each, into `directory`."""
    import tensorflow as tf  # this format converts on TensorFlow alone

    # The endpoints track the variables they read (`_all_variables`), each
    # saved once: `track(model)` would save every weight a second time, as
    # the model's Keras variables, and the converter would load both.
    archive = keras.export.ExportArchive()
    for target, signature in entries:
        archive.add_endpoint(
            target.signature_name, _named(target, marked), input_signature=signature
        )
    # Without the gradient functions of `tf.custom_gradient` (every SiLU's):
    # loading them registers each in TensorFlow's process-wide gradient
    # registry, which then keeps every function the converter loaded alive
    # (`traced_graphs`): a 28-layer Llama's converter peaked at 3.00 GiB
    # with them, 2.38 with its 112 registrations dropped.
    options = tf.saved_model.SaveOptions(experimental_custom_gradients=False)
    archive.write_out(directory, verbose=False, options=options)
