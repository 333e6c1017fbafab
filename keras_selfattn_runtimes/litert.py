"""A LiteRT (.tflite) file in LiteRT's interpreter.

The interpreter runs on as many threads as this process has CPUs
(`default_threads`): LiteRT's own default is one, and a generator's step
at batch 8 is mostly matmuls that XNNPACK splits across them. On cores
other work keeps busy, one thread can be faster (docs/performance.md):
pass `num_threads=1`.

XNNPACK, LiteRT's default delegate, packs the weights again for each
subgraph that reads them: a generator file's four (the "generate" prompt
pass and loop body, "prefill", "decode") hold four more copies of its
weights (10.6 GiB resident for a 2.1 GiB file). `xnnpack=False` runs the
file on LiteRT's builtin kernels instead, which read the mapped file's
weights as they are (2.3 GiB for that file).
"""

from __future__ import annotations

import os
import weakref

import numpy as np

from ._common import Loaded, natural

# The interpreters open in this process, one per file: the signatures of one
# file share its weights (a generator's "prefill" and "decode" would hold
# them twice, each in an interpreter of its own).
_OPEN: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def default_threads() -> int:
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _interpreter(path: str, num_threads: int, xnnpack: bool):
    """The interpreter of the file at `path` on `num_threads` threads, with
    or without the XNNPACK delegate, shared while one is in use."""
    from ai_edge_litert.interpreter import Interpreter, OpResolverType

    resolver = (
        OpResolverType.AUTO
        if xnnpack
        else OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES
    )

    def opened():
        return Interpreter(
            model_path=path,
            num_threads=num_threads,
            experimental_op_resolver_type=resolver,
        )

    try:
        stat = os.stat(path)
    except OSError:  # the interpreter's own error names it
        return opened()
    key = (os.path.realpath(path), stat.st_mtime_ns, stat.st_size, num_threads, xnnpack)
    interpreter = _OPEN.get(key)
    if interpreter is None:
        interpreter = opened()
        _OPEN[key] = interpreter
    return interpreter


class LiteRTInterpreter(Loaded):
    """One signature of a LiteRT file, or its positional tensors.

    Attributes:
        int8_matrices: How many of its weight matrices are int8 (with
            scales): LiteRT files carry no statement of their own.
    """

    def __init__(self, path: str, signature: str, num_threads: int, xnnpack: bool):
        interpreter = _interpreter(path, num_threads, xnnpack)
        self.int8_matrices = sum(
            detail["dtype"] == np.int8
            and len(detail["shape"]) == 2
            and len(detail["quantization_parameters"]["scales"]) > 0
            for detail in interpreter.get_tensor_details()
        )
        self.description = {"scheme": "float weights", "exact": False}
        if self.int8_matrices:  # dynamic range: int8 weights, float inputs
            scheme = "int8 weights, activations quantized per row (dynamic range)"
            self.description = {"scheme": scheme, "exact": False}
        signatures = interpreter.get_signature_list()
        if len(signatures) > 1 and signature not in signatures:
            raise ValueError(f"no {signature!r} signature; it has {sorted(signatures)}")
        if signatures:  # Keras's export names its one "serving_default"
            key = signature if signature in signatures else next(iter(signatures))
            self._runner = interpreter.get_signature_runner(key)
            details = self._runner.get_input_details()
            order = sorted(details, key=lambda n: details[n]["index"])
            self.input_names = order
            outputs = self._runner.get_output_details()
            self.output_names = sorted(outputs, key=natural)
        else:  # no signature: positional tensors
            self._runner = None
            self._interpreter = interpreter
            self.input_names = [d["name"] for d in interpreter.get_input_details()]
            self.output_names = [d["name"] for d in interpreter.get_output_details()]

    def __call__(self, arrays):
        if self._runner is not None:
            return {k: np.asarray(v) for k, v in self._runner(**arrays).items()}
        interpreter = self._interpreter
        details = interpreter.get_input_details()
        for detail in details:
            interpreter.resize_tensor_input(
                detail["index"], arrays[detail["name"]].shape
            )
        interpreter.allocate_tensors()
        for detail in details:
            interpreter.set_tensor(detail["index"], arrays[detail["name"]])
        interpreter.invoke()
        return {
            d["name"]: interpreter.get_tensor(d["index"])
            for d in interpreter.get_output_details()
        }


def load(
    path: str, signature: str, num_threads: int | None = None, xnnpack: bool = True
) -> LiteRTInterpreter:
    """The LiteRT file `path`: its `signature` (its only one, whatever its
    name), or its positional tensors when it has no signature.

    Args:
        path: The .tflite file.
        signature: The signature to run.
        num_threads: The interpreter's threads. None (default):
            `default_threads()`.
        xnnpack: Whether the XNNPACK delegate runs it (LiteRT's default);
            False: LiteRT's builtin kernels, without copies of the weights.

    Raises:
        ValueError: if `num_threads` is not a positive int, or `xnnpack`
            not a bool.
    """
    if num_threads is None:
        num_threads = default_threads()
    if (
        not isinstance(num_threads, int)
        or isinstance(num_threads, bool)
        or num_threads < 1
    ):
        raise ValueError(
            "`num_threads` must be a positive int. "
            f"Received: num_threads={num_threads!r}"
        )
    if not isinstance(xnnpack, bool):
        raise ValueError(f"`xnnpack` must be a bool. Received: xnnpack={xnnpack!r}")
    return LiteRTInterpreter(path, signature, num_threads, xnnpack)
