"""The TensorFlow process that writes a generator from a .keras file.

Started by `_writer.writer` as `python -m
keras_selfattn.export.generator._writer_process REQUEST_JSON` under
KERAS_BACKEND=tensorflow. The request names the .keras file, `max_length`,
`jit_compile`, the format, the staged path, the format's checked
options and the modules defining the model's layer classes; the worker
imports those, loads the model, rebuilds its generator and writes the
artifact there. A failure is one line on stderr and exit status 1.
"""

from __future__ import annotations

import importlib
import json
import sys

import keras

from keras_selfattn.export import formats
from keras_selfattn.export.generator.graph import build_generator
from keras_selfattn.generation import decode_check


def main(argv: list[str]) -> None:
    """Writes the generator the JSON request in `argv[0]` describes."""
    request = json.loads(argv[0])
    try:
        for module in request["modules"]:  # the model's own layer classes
            importlib.import_module(module)
        model = keras.saving.load_model(request["keras_file"])
        with decode_check.waived(not request["check_decoding"]):
            generator = build_generator(
                model, request["max_length"], request["jit_compile"]
            )
        options = dict(request["options"])
        if options.get("shape") is not None:
            options["shape"] = tuple(options["shape"])
        formats.get(request["format"]).write(
            generator.target(request["format"]), request["path"], options
        )
    except Exception as error:
        print(f"{type(error).__name__}: {formats.one_line(error)}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main(sys.argv[1:])
