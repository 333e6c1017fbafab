"""Several export targets in one LiteRT file, each under a signature of its own.

Keras's LiteRT export converts one function: its signature is
"serving_default" and its outputs are named by position (`output_0`, ...).
A file with several entry points over one model (a generator's "generate",
"prefill" and "decode") is converted the way Keras converts one (TensorFlow
backend): a SavedModel as Keras's `ExportArchive` writes one, here with
one signature per target, each returning its outputs keyed by name, each
traced once and holding no custom gradient (`_write_saved_model`), then
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

from keras_selfattn.export.formats import (
    litert_process,
    litert_unfolded,
    litert_weights,
)
from keras_selfattn.export.formats._base import released
from keras_selfattn.export.signature import Signature

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
        # back, before the converter starts beside this process
        # (`_base.released`): a 0.59 B Llama's generator held 3.24-3.33 GiB
        # beside it, 3.78 when its SiLUs' gradients kept the graphs alive.
        with released(entries[0][0].model):
            _write_saved_model(entries, marked, saved)
        keys = [target.signature_name for target, _ in entries]
        litert_process.convert(
            saved,
            path,
            keys,
            large,
            weights,
            unfold=large and bool(marked),
            meanwhile=entries[0][0].meanwhile,
        )


def _write_saved_model(
    entries: Sequence[tuple[Signature, list]],
    marked: Sequence[litert_weights.Marked],
    directory: str,
) -> None:
    """The SavedModel of the targets, one signature each, into `directory`,
    as Keras's `ExportArchive` writes it (`tf.function`s without autograph,
    each tracking the variables it reads), each traced once."""
    import tensorflow as tf  # this format converts on TensorFlow alone

    # Each signature is given as its concrete function: given the
    # `tf.function`, TensorFlow's writer traces it again under its save
    # context (Keras's archive traced each endpoint twice, about 70 s of a
    # 0.59 B Llama's generator on an AVX2 CPU).
    signatures, read = {}, {}
    for target, signature in entries:
        specs = [
            [tf.TensorSpec(spec.shape, spec.dtype, name=spec.name) for spec in inputs]
            for inputs in signature
        ]
        function = tf.function(
            _named(target, marked), input_signature=specs, autograph=False
        )
        concrete = function.get_concrete_function()
        signatures[target.signature_name] = concrete
        read.update({id(variable): variable for variable in concrete.variables})
    # Only the variables the signatures read are saved: the matrices they
    # read as markers are not (`track(model)` would save every weight).
    root = tf.Module()
    root.read = list(read.values())
    # Without the gradient functions of `tf.custom_gradient` (every SiLU's):
    # loading them registers each in TensorFlow's process-wide gradient
    # registry, which then keeps every function the converter loaded alive
    # (`_base.released`): a 28-layer Llama's converter peaked at 3.00 GiB
    # with them, 1.81 without.
    options = tf.saved_model.SaveOptions(experimental_custom_gradients=False)
    tf.saved_model.save(root, directory, signatures=signatures, options=options)
