"""One way of running a LiteRT generator file, in its own process.

    python -m benchmarks.litert_runtime_child WAY FILE VOCABULARY CACHE

WAY is "interpreter" (`ai_edge_litert`'s Interpreter, its default XNNPACK
delegate: what the export's check runs on a file of at most 1 GiB),
"builtin" (the Interpreter on LiteRT's builtin kernels, XNNPACK off: what
the check runs on a larger file) or "compiled_model" (LiteRT's
CompiledModel on the CPU with an XNNPACK weight cache file at CACHE,
written by its first load and mapped by the next). The file's "generate"
runs `ROUNDS` greedy requests of `real_size_child`'s prompt; the last line
of stdout is JSON: the tokens, the time to load and the first request, and
the median of the others.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import numpy as np

from benchmarks.generation import greedy_request
from benchmarks.real_size_child import NEW_TOKENS, _prompts

ROUNDS = 4
THREADS = 2


def _request(vocabulary: int) -> dict:
    return greedy_request(_prompts(vocabulary), NEW_TOKENS, vocabulary)


def _interpreter(path: str, request: dict, xnnpack: bool):
    from keras_selfattn_runtimes import litert

    loaded = litert.load(path, "generate", num_threads=THREADS, xnnpack=xnnpack)
    return lambda: loaded(request)["tokens"]


def _compiled_model(path: str, request: dict, cache: str):
    from ai_edge_litert.compiled_model import CompiledModel
    from ai_edge_litert.cpu_options import CpuOptions
    from ai_edge_litert.hardware_accelerator import HardwareAccelerator
    from ai_edge_litert.options import Options
    from ai_edge_litert.tensor_buffer import TensorBuffer

    options = Options(
        hardware_accelerators=HardwareAccelerator.CPU,
        cpu_options=CpuOptions(num_threads=THREADS, xnnpack_weight_cache_path=cache),
    )
    model = CompiledModel.from_file(path, options=options)
    inputs = {}
    for name, value in request.items():
        if value.ndim:
            model.resize_input_tensor_by_name("generate", name, list(value.shape))
    for name, value in request.items():
        inputs[name] = model.create_input_buffer_by_name("generate", name)
        inputs[name].write(value)
    shape = (len(request["prompt_tokens"]), NEW_TOKENS)
    # The tokens' shape depends on a value (max_new_tokens): buffers of the
    # request's size, which the model's own would not be.
    outputs = {
        "tokens": TensorBuffer.create_from_host_memory(np.zeros(shape, np.int32)),
        "lengths": TensorBuffer.create_from_host_memory(np.zeros(shape[:1], np.int32)),
    }

    def run():
        model.run_by_name("generate", inputs, outputs)
        return outputs["tokens"].read(shape[0] * shape[1], np.int32).reshape(shape)

    return run


def main(argv: list[str]) -> None:
    way, path, vocabulary, cache = argv
    request = _request(int(vocabulary))
    start = time.perf_counter()
    if way in ("interpreter", "builtin"):
        run = _interpreter(path, request, xnnpack=way == "interpreter")
    else:
        run = _compiled_model(path, request, cache)
    tokens = np.asarray(run())
    first = time.perf_counter() - start
    times = []
    for _ in range(ROUNDS - 1):
        start = time.perf_counter()
        again = np.asarray(run())
        times.append(time.perf_counter() - start)
        if not (again == tokens).all():
            raise RuntimeError("the same request gave other tokens")
    record = {
        "tokens": tokens.tolist(),
        "load_and_first_s": first,
        "request_s": statistics.median(times),
    }
    print(json.dumps(record))


if __name__ == "__main__":
    main(sys.argv[1:])
