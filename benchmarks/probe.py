"""The one RSS probe: a measurement in a fresh child process (`run_child`).

Peak RSS only grows, so each measurement runs in a fresh process and reads
the peak from /proc/self/status (VmHWM, the high-water mark of this process
image). `ru_maxrss` is not used: after fork + exec it keeps the parent's
peak, so a child of a big benchmark process would report the parent's RSS.

- `python -m benchmarks.probe memory SPEC` (TensorFlow, `benchmarks.cpu`)
  prints {"baseline_mib", "peak_mib", "seconds"}; a SPEC is a JSON object:
  "layer" ("self_attention" or "mha"), "batch", "time", "features",
  "num_heads", "key_dim", "output_dim" (None: no output projection),
  "options" (extra SelfAttention arguments such as chunk_size,
  sliding_window, causal).
- `python -m benchmarks.probe speed SPEC_A SPEC_B ROUNDS` prints {"speedup",
  "ms_a", "ms_b"} (median of the pairwise ratios time_a / time_b).
- `python -m benchmarks.probe layer SPEC` (any backend, `benchmarks.backends`;
  imports TensorFlow only on that backend) prints the same as memory; SPEC:
  {"row": `pairs.Row` fields, "layer", "dtype", "flash"}. Its baseline is
  VmRSS after building the layer and a warm-up call at a tiny length (and,
  on JAX, compiling the full-size call), just before the measured pass.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time

from benchmarks import machine

WARMUP_TIME = 16


def _status_mib(field: str) -> float:
    """A memory field of /proc/self/status ("VmRSS", "VmHWM") in MiB."""
    with open("/proc/self/status", encoding="utf-8") as status:
        for line in status:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"{field} missing from /proc/self/status")


def _forward(spec: dict):
    """A tf.function forward of the layer `spec` describes (dynamic shapes)."""
    import keras
    import tensorflow as tf

    from keras_selfattn import SelfAttention

    features = spec["features"]
    if spec["layer"] == "mha":
        layer = keras.layers.MultiHeadAttention(
            num_heads=spec["num_heads"],
            key_dim=spec["key_dim"],
            output_shape=spec["output_dim"],
            use_bias=True,
        )
        causal = spec.get("options", {}).get("causal", False)

        def call(x):
            return layer(x, x, use_causal_mask=causal)

    else:
        layer = SelfAttention(
            num_heads=spec["num_heads"],
            key_dim=spec["key_dim"],
            output_dim=spec["output_dim"],
            use_bias=True,
            **spec.get("options", {}),
        )
        call = layer
    forward = tf.function(
        call,
        input_signature=[tf.TensorSpec((None, None, features), tf.float32)],
        autograph=False,
    )
    forward(tf.zeros((1, 4, features)))
    return forward


def _input(spec: dict):
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(0)
    shape = (spec["batch"], spec["time"], spec["features"])
    return tf.constant(rng.normal(size=shape), tf.float32)


def memory(spec: dict) -> dict:
    forward = _forward(spec)
    x = _input(spec)
    baseline = _status_mib("VmRSS")
    start = time.perf_counter()
    forward(x).numpy()
    seconds = time.perf_counter() - start
    peak = _status_mib("VmHWM")
    return {"baseline_mib": baseline, "peak_mib": peak, "seconds": seconds}


def speed(spec_a: dict, spec_b: dict, rounds: int) -> dict:
    from benchmarks.timing import interleave

    calls = {}
    for name, spec in (("a", spec_a), ("b", spec_b)):
        forward, x = _forward(spec), _input(spec)
        calls[name] = lambda f=forward, x=x: f(x).numpy()
    result = interleave(calls, rounds=rounds, warmup=1, min_round_s=0.0)
    return {
        "speedup": result.speedup("a", "b"),
        "ms_a": 1e3 * result.median("a"),
        "ms_b": 1e3 * result.median("b"),
    }


def layer_memory(spec: dict) -> dict:
    """One forward pass of a `pairs` layer on the current backend, in MiB."""
    from benchmarks import pairs, runners

    row = pairs.Row.from_dict(spec["row"])
    kind = spec["layer"]
    backend = runners.current()
    layer = pairs.build_layer(kind, row, spec["dtype"], spec["flash"])
    apply = pairs.apply_fn(kind, row)
    x, mask = pairs.inputs(row)
    full = backend.prepare(layer, apply, x, mask, train=False)
    small_x, small_mask = pairs.inputs(row, time=min(WARMUP_TIME, row.time))
    backend.prepare(layer, apply, small_x, small_mask, train=False).calls["forward"]()
    baseline = _status_mib("VmRSS")
    start = time.perf_counter()
    full.calls["forward"]()
    seconds = time.perf_counter() - start
    return {
        "baseline_mib": baseline,
        "peak_mib": _status_mib("VmHWM"),
        "seconds": seconds,
    }


def run(argv: list[str]) -> dict:
    """Runs `memory SPEC`, `speed SPEC_A SPEC_B ROUNDS` or `layer SPEC`."""
    mode, *args = argv
    if mode == "memory":
        return memory(json.loads(args[0]))
    if mode == "speed":
        return speed(json.loads(args[0]), json.loads(args[1]), int(args[2]))
    if mode == "layer":
        return layer_memory(json.loads(args[0]))
    raise ValueError(
        f"Unknown probe mode {mode!r}: expected 'memory', 'speed' or 'layer'"
    )


def run_child(argv: list[str], timeout_s: float) -> dict:
    """`run(argv)` in a fresh interpreter; raises RuntimeError if it fails."""
    completed = subprocess.run(
        [sys.executable, "-m", "benchmarks.probe", *argv],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
        cwd=machine.REPO,
    )
    if completed.returncode != 0:
        tail = completed.stderr.strip().splitlines()[-3:]
        raise RuntimeError(
            f"probe {argv[0]} failed (exit {completed.returncode}): {tail}"
        )
    return json.loads(completed.stdout.strip().splitlines()[-1])


def _summary(results: list[dict]) -> dict:
    peaks = [r["peak_mib"] for r in results]
    return {
        "peak_mib": statistics.median(peaks),
        "baseline_mib": statistics.median(r["baseline_mib"] for r in results),
        "growth_mib": statistics.median(
            r["peak_mib"] - r["baseline_mib"] for r in results
        ),
        "seconds": statistics.median(r["seconds"] for r in results),
        "peak_mib_runs": peaks,
    }


def peak_rss(
    row_dict: dict, dtype: str, flash: str, runs: int, timeout_s: float = 1800
) -> dict:
    """{layer: medians over `runs` `layer` children}, the two layers in turn.

    The order alternates (SA MHA, MHA SA, ...), so neither layer always runs
    after the other on a machine whose load drifts.
    """
    layers = ["self_attention", "mha"]
    results: dict[str, list[dict]] = {layer: [] for layer in layers}
    for index in range(runs):
        for layer in layers if index % 2 == 0 else layers[::-1]:
            spec = {"row": row_dict, "layer": layer, "dtype": dtype, "flash": flash}
            results[layer].append(run_child(["layer", json.dumps(spec)], timeout_s))
    return {layer: _summary(values) for layer, values in results.items()}


def main(argv: list[str]) -> None:
    # If memory runs out, let the kernel pick this process, not a neighbour.
    with open("/proc/self/oom_score_adj", "w", encoding="utf-8") as adj:
        adj.write("1000")
    print(json.dumps(run(argv)))


if __name__ == "__main__":
    main(sys.argv[1:])
