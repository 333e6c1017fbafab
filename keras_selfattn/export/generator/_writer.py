"""Writes a generator in a TensorFlow-backend process, from the model's .keras file.

A generator keeps its loop in the graph, which only TensorFlow can trace:
jax2tf cannot bound the prompt's symbolic length by the cache's ("symbolic
dimension comparison '- time + max_length' >= '0' is inconclusive") and
torch.export cannot trace the loop. On JAX and torch, `export_generator`
saves the model as .keras (`keras_file`), and the pipeline stages the
artifact with `writer`: `python -m keras_selfattn.export.generator._writer_process`
under KERAS_BACKEND=tensorflow loads that file (the saved weights, bit for bit),
rebuilds the generator and writes the format's artifact at the staged path.
The caller's pipeline then checks it against `keras_selfattn.generate` on
the caller's own backend and moves it into place; a failure leaves nothing.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Iterator, Mapping

import keras

from keras_selfattn import _tensorflow_extra
from keras_selfattn.export import tensorflow_env
from keras_selfattn.export.formats import ExportError, Writer, one_line
from keras_selfattn.export.signature import Signature
from keras_selfattn.generation import decode_check

WRITER_BACKEND = "tensorflow"
# The TensorFlow process's entry point (a module of its own: it imports the
# generator, which imports this module).
WORKER = "keras_selfattn.export.generator._writer_process"
# A generator's conversion takes seconds to a few minutes; a hung one fails.
_TIMEOUT_S = 1800


@contextlib.contextmanager
def keras_file(model: keras.Model) -> Iterator[str]:
    """`model` saved as .keras in a temporary folder, removed after the block.

    Raises:
        ValueError: if the model cannot be saved (one line saying why).
    """
    with tempfile.TemporaryDirectory(prefix="keras_selfattn_writer_") as folder:
        path = os.path.join(folder, "model.keras")
        try:
            model.save(path)
        except Exception as error:
            raise ValueError(
                f"A generator exports from {keras.backend.backend()} through a "
                f"{WRITER_BACKEND} process that loads the model's .keras file, "
                f"and saving it failed ({one_line(error)}): register custom "
                "layers with keras.saving.register_keras_serializable, or "
                f"export under KERAS_BACKEND={WRITER_BACKEND}"
            ) from error
        yield path


def class_modules(layers: Iterable[keras.layers.Layer]) -> dict[str, str]:
    """The modules defining the classes of `layers` (a model's: its
    `Reading.every`) that the TensorFlow process must import before it
    loads the .keras file (their classes register themselves there: the
    user's, keras-hub's), each with the folder it is imported from.
    Keras's and this package's are left out, and so is `__main__`, which
    another process cannot import."""
    found = {}
    for layer in layers:
        name = type(layer).__module__
        if name.split(".")[0] in ("keras", "keras_selfattn", "builtins", "__main__"):
            continue
        path = getattr(sys.modules.get(name), "__file__", None)
        if path is None:
            continue
        root = os.path.dirname(path)  # the module's package folder
        if os.path.basename(path) == "__init__.py":
            root = os.path.dirname(root)
        for _ in range(name.count(".")):
            root = os.path.dirname(root)
        found[name] = root
    return found


def writer(
    path: str,
    export_format: str,
    max_length: int,
    jit_compile: bool,
    modules: Mapping[str, str],
) -> Writer:
    """A `formats.Writer` that writes the generator of the .keras file at
    `path` as `export_format` (`max_length`, `jit_compile` as in
    `export_generator`) in a TensorFlow-backend process, which imports
    `modules` ({module: folder}, `class_modules`) first."""
    _tensorflow_extra.require(
        f"A generator exported from {keras.backend.backend()} (written by a "
        f"{WRITER_BACKEND} process)"
    )

    def write(target: Signature, staged: str, options: Mapping[str, object]):
        # The generator is rebuilt from the .keras file by the TensorFlow
        # process; this process does `target.meanwhile` (the check's
        # references) while it writes, in an empty `contextvars` context.
        request = {
            "keras_file": path,
            "max_length": max_length,
            "jit_compile": jit_compile,
            "format": export_format,
            "path": staged,
            "options": dict(options),
            "modules": sorted(modules),
            "check_decoding": not decode_check.is_waived(),
        }
        package_root = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
        search = [package_root, *sorted(set(modules.values()))]
        search.append(os.environ.get("PYTHONPATH", ""))
        env = tensorflow_env.writer_env(
            KERAS_BACKEND=WRITER_BACKEND,
            TF_CPP_MIN_LOG_LEVEL="3",
            PYTHONPATH=os.pathsep.join(p for p in search if p),
        )
        with tempfile.TemporaryFile(mode="w+") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", WORKER, json.dumps(request)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=log,
                env=env,
            )
            try:
                if target.meanwhile is not None:
                    contextvars.Context().run(target.meanwhile)
                process.wait(timeout=_TIMEOUT_S)
            except BaseException:
                process.kill()
                process.wait()
                raise
            log.seek(0)
            printed = log.read()
        if process.returncode != 0:
            lines = printed.strip().splitlines() or ["no output"]
            raise ExportError(
                f"The {WRITER_BACKEND} process writing the generator failed "
                f"(exit status {process.returncode}): {lines[-1]}",
                printed,
            )

    return write
