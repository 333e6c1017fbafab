"""Several export targets in one LiteRT file, each under a signature of its own.

Keras's LiteRT export converts one function: its signature is
"serving_default" and its outputs are named by position (`output_0`, ...).
A file with several entry points over one model (a generator's "generate",
"prefill" and "decode") is converted the way Keras converts one (TensorFlow
backend): a SavedModel written by Keras's `ExportArchive`, here with one
endpoint per target, each returning its outputs keyed by name, then
TensorFlow's converter with Keras's settings, asked for exactly those
signatures. The signatures keep the targets' names, inputs and outputs
alike. The variables are frozen into constants, which the signatures share.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Sequence

import keras

from keras_selfattn.export.signature import Signature


def _named(target: Signature) -> Callable:
    """`target`'s function on one list of its inputs, returning its outputs
    keyed by name (the signature's output names)."""

    def serve(tensors):
        return target.call_named(dict(zip(target.input_names, tensors, strict=True)))

    return serve


def convert(
    entries: Sequence[tuple[Signature, list]], path: str, large: bool = False
) -> None:
    """Writes the targets into the .tflite file `path`, one signature each.

    Run it inside the LiteRT format's contexts (quantized layers traced,
    attention unchunked), as Keras's export is.

    Args:
        entries: (target, input signature) pairs: each target becomes the
            signature `target.signature_name`, its inputs as given
            (`model.export`'s `input_signature`: one list of
            `keras.InputSpec`).
        large: Write the weights after the flatbuffer, at offsets it records
            (TensorFlow's `_experimental_use_buffer_offset`: a flatbuffer
            holds at most 2 GiB), without conversion metadata.
    """
    import tensorflow as tf

    archive = keras.export.ExportArchive()
    for model in {id(target.model): target.model for target, _ in entries}.values():
        archive.track(model)
    for target, signature in entries:
        archive.add_endpoint(
            target.signature_name, _named(target), input_signature=signature
        )
    with tempfile.TemporaryDirectory(prefix="keras_selfattn_litert_") as saved:
        archive.write_out(saved, verbose=False)
        converter = tf.lite.TFLiteConverter.from_saved_model(
            saved, signature_keys=[target.signature_name for target, _ in entries]
        )
        # Keras's settings (keras/src/export/litert.py), so each signature
        # converts as Keras's export converts it alone: TensorFlow ops are
        # allowed there too, yet the package's graphs become builtin ops
        # only (attention unchunked), which LiteRT runs without Flex.
        converter.target_spec.supported_ops = [
            tf.lite.OpsSet.TFLITE_BUILTINS,
            tf.lite.OpsSet.SELECT_TF_OPS,
        ]
        converter.experimental_enable_resource_variables = True
        if large:
            converter._experimental_use_buffer_offset = True
            converter.exclude_conversion_metadata = True
        flatbuffer = converter.convert()
    with open(path, "wb") as file:
        file.write(flatbuffer)
