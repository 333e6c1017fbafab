"""TensorFlow's LiteRT converter in a process of its own, watched for memory.

`litert_signatures` writes the targets' SavedModel, then converts it here:
`convert` runs this file as a script (`python litert_process.py
REQUEST_JSON`, no Keras model and no package imported there: TensorFlow
alone), which converts the SavedModel with Keras's settings and writes the
.tflite file. The Keras process keeps only its model meanwhile, and every
copy the converter makes (the loaded variables, MLIR's constants, the
flatbuffer, Python's bytes of it) is returned to the system when the
process ends.

A LiteRT generator's converter needs several times the weights
(`NEEDED_PER_WEIGHT_BYTE`, measured): an export that cannot fit in the
memory available is refused before the conversion starts, and a
conversion that runs the machine short (`/proc/meminfo`'s MemAvailable
under `RESERVE_BYTES`) is stopped, each in one line naming what it
needed, not left for the kernel to kill.
"""

from __future__ import annotations

import concurrent.futures
import contextvars
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence

# Peak resident memory of a LiteRT generator's converter per byte of
# float32 weights, and a base (TensorFlow imported, MLIR's context), the
# matrices read as markers (`litert_weights`; docs/export.md, "Large
# models"). A small model's converter writes each marker's buffer expanded
# into the flatbuffer, then returns Python's bytes of it (7.8 GiB at 2.21
# GiB of weights, 15.5 at 4.60, before the markers were unfolded).
NEEDED_PER_WEIGHT_BYTE = 3.3
BASE_BYTES = 2**29
# A large model's markers, unfolded into FILL operations
# (`litert_unfolded`), are never expanded: the converter holds the traced
# graph and the constants it folds (4.43 GiB at 2.21 GiB of weights, a
# 28-layer Llama's three signatures; 6.65 GiB at 4.60, 16 layers; 3.2 GiB
# at 2.21 since it runs in one malloc arena, `tensorflow_env`; 1.6-1.9
# GiB since its SavedModel holds no custom gradients: the reckoning is
# kept, on the safe side). Its check runs a large file on LiteRT's builtin
# kernels, one row a request, in about the file's size (docs/export.md).
UNFOLDED_PER_WEIGHT_BYTE = 1.5
UNFOLDED_BASE_BYTES = 3 * 2**29
# The machine's available memory under which a conversion is stopped.
RESERVE_BYTES = 2**29
_POLL_S = 0.2
# A generator's conversion takes seconds to several minutes; a hung one fails.
_TIMEOUT_S = 3600


class OutOfMemory(RuntimeError):
    """The conversion needs, or took, more memory than the machine has."""


def available_bytes() -> int | None:
    """The machine's available memory (`/proc/meminfo`), or None off Linux."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def needed_bytes(weights: int, unfolded: bool = False) -> int:
    """The memory the converting process needs for `weights` bytes (their
    markers `unfolded` or not)."""
    if unfolded:
        return int(UNFOLDED_PER_WEIGHT_BYTE * weights) + UNFOLDED_BASE_BYTES
    return int(NEEDED_PER_WEIGHT_BYTE * weights) + BASE_BYTES


def _gib(size: int) -> str:
    return f"{size / 2**30:.1f} GiB"


def check_memory(weights: int, unfolded: bool = False) -> None:
    """Refuses a conversion that cannot fit in the available memory
    (`needed_bytes`).

    Raises:
        OutOfMemory: naming what it needs and what is available.
    """
    available = available_bytes()
    needed = needed_bytes(weights, unfolded)
    if available is None or needed <= available - RESERVE_BYTES:
        return
    if unfolded:
        times, base = UNFOLDED_PER_WEIGHT_BYTE, UNFOLDED_BASE_BYTES
        why = "TensorFlow's converter holds the traced graph and folds constants"
    else:
        times, base = NEEDED_PER_WEIGHT_BYTE, BASE_BYTES
        why = (
            "TensorFlow's converter writes them into the flatbuffer, then "
            "Python's bytes of it"
        )
    raise OutOfMemory(
        f"a LiteRT generator of {_gib(weights)} of weights needs about "
        f"{_gib(needed)} ({times:g} times the weights plus {_gib(base)}: "
        f"{why}) and this machine has {_gib(available)} available"
    )


def convert(
    saved_model: str,
    path: str,
    signature_keys: Sequence[str],
    large: bool,
    weights: int,
    unfold: bool = False,
    meanwhile: Callable[[], None] | None = None,
) -> None:
    """Converts the SavedModel's `signature_keys` into the .tflite file `path`
    in a new process (`large`: weights after the flatbuffer; `unfold`: large
    markers written as FILL operations, `litert_unfolded`), unless the
    memory available now (the model traced and its SavedModel written)
    cannot hold it for `weights` bytes of weights (`check_memory`).

    While the converter runs, this process runs `meanwhile` (the check's
    Keras references, `Signature.meanwhile`) in an empty `contextvars`
    context, so the conversion's tracing modes do not reach it, while a
    thread watches the converter; an exception out of it stops the
    converter.

    Raises:
        OutOfMemory: if the conversion cannot fit (it does not start), the
            machine's available memory fell under `RESERVE_BYTES` (the
            process is stopped) or the process was killed by a signal.
        RuntimeError: the converter's failure, with what it printed.
    """
    check_memory(weights, unfold)
    request = {
        "saved_model": saved_model,
        "path": path,
        "signature_keys": list(signature_keys),
        "large": large,
        "unfold": unfold,
    }
    # Imported here: run as a script, this file imports TensorFlow alone.
    from keras_selfattn.export import tensorflow_env

    env = tensorflow_env.converter_env(TF_CPP_MIN_LOG_LEVEL="3")
    with tempfile.TemporaryFile(mode="w+") as log:
        process = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), json.dumps(request)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            watched = pool.submit(_watch, process)
            try:
                if meanwhile is not None:
                    contextvars.Context().run(meanwhile)
            except BaseException:
                process.kill()
                raise
            low = watched.result()
        log.seek(0)
        printed = log.read()
    if low is not None:
        raise OutOfMemory(
            "TensorFlow's LiteRT converter was stopped when this machine's "
            f"available memory fell to {_gib(low)}"
        )
    if process.returncode < 0:
        name = signal.Signals(-process.returncode).name
        raise OutOfMemory(
            f"TensorFlow's LiteRT converter was killed ({name}), most likely "
            "by the system for memory"
        )
    if process.returncode != 0:
        raise RuntimeError(printed.strip() or f"exit status {process.returncode}")


def _watch(process: subprocess.Popen) -> int | None:
    """Waits for `process`; stops it (returning the available memory then)
    if the machine's available memory falls under `RESERVE_BYTES`."""
    deadline = time.monotonic() + _TIMEOUT_S
    try:
        while process.poll() is None:
            available = available_bytes()
            if available is not None and available < RESERVE_BYTES:
                process.kill()
                process.wait()
                return available
            if time.monotonic() > deadline:
                process.kill()
                process.wait()
                raise RuntimeError(f"the conversion took over {_TIMEOUT_S} s")
            time.sleep(_POLL_S)
    except BaseException:
        if process.poll() is None:
            process.kill()
            process.wait()
        raise
    return None


def _main(argv: list[str]) -> None:
    """Converts as the JSON request in `argv[0]` says and writes the file."""
    import tensorflow as tf
    from tensorflow.lite.python import lite

    request = json.loads(argv[0])
    # The converter `TFLiteConverter.from_saved_model` returns, made without
    # its Python load of the SavedModel, which only checks that the
    # signatures are there (this package wrote them), and holds a copy of
    # the weights until its reference cycles are collected: a 0.59 B
    # Llama's generator converted in a median 47 s instead of 52 (AMD EPYC,
    # 2026-12-02; docs/export.md, "Large models").
    converter = lite.TFLiteSavedModelConverterV2(
        request["saved_model"],
        {tf.saved_model.SERVING},
        request["signature_keys"],
    )
    if converter.saved_model_dir is None:  # unreadable: TensorFlow drops it
        raise OSError(
            f"no SavedModel TensorFlow's converter can import at "
            f"{request['saved_model']!r}"
        )
    # Keras's settings (keras/src/export/litert.py), so each signature
    # converts as Keras's export converts it alone: TensorFlow ops are
    # allowed there too, yet the package's graphs become builtin ops only
    # (attention unchunked), which LiteRT runs without Flex.
    converter.target_spec.supported_ops = [
        tf.lite.OpsSet.TFLITE_BUILTINS,
        tf.lite.OpsSet.SELECT_TF_OPS,
    ]
    converter.experimental_enable_resource_variables = True
    # The converter's metadata (its version and options) would be added by
    # reading the whole flatbuffer into Python objects and writing it anew.
    converter.exclude_conversion_metadata = True
    # Kept as Keras computes them: the pass clamping +-inf constants to
    # +-3.4e38 (Keras's default) read every element of every float constant,
    # the markers expanded: 178 of the 200 s of a 0.59 B Llama's passes.
    converter.canonicalizing_inf_as_min_max_float = False
    if request["large"]:
        converter._experimental_use_buffer_offset = True
    if request["unfold"]:
        # Markers as FILL operations (`litert_unfolded`), not expanded.
        converter._experimental_unfold_large_splat_constant = True
    flatbuffer = converter.convert()
    del converter
    with open(request["path"], "wb") as file:
        file.write(flatbuffer)


if __name__ == "__main__":
    # This folder's modules (`onnx`, `torch`) would shadow the packages
    # TensorFlow imports.
    sys.path.pop(0)
    try:
        _main(sys.argv[1:])
    except Exception as error:  # the parent reads it from the log
        print(f"error: {type(error).__name__}: {error}", file=sys.stderr)
        sys.exit(1)
