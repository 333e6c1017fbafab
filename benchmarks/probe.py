"""Child process of the memory and long-sequence benchmarks.

Peak RSS only grows, so each measurement runs in a fresh process and reads
the peak from /proc/self/status (VmHWM, the high-water mark of this process
image). `ru_maxrss` is not used: after fork + exec it keeps the parent's
peak, so a child of a big benchmark process would report the parent's RSS.
`python -m benchmarks.probe memory SPEC` prints
{"baseline_mib", "peak_mib", "seconds"} and `python -m benchmarks.probe speed
SPEC_A SPEC_B ROUNDS` prints {"speedup", "ms_a", "ms_b"} (median of the pairwise
ratios time_a / time_b). A SPEC is a JSON object: "layer" ("self_attention"
or "mha"), "batch", "time", "features", "num_heads", "key_dim",
"output_dim" (None: no output projection), "options" (extra SelfAttention
arguments such as chunk_size, sliding_window, causal).
"""

from __future__ import annotations

import json
import sys
import time


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


def run(argv: list[str]) -> dict:
    """Runs `memory SPEC` or `speed SPEC_A SPEC_B ROUNDS`; returns the result."""
    mode, *args = argv
    if mode == "memory":
        return memory(json.loads(args[0]))
    if mode == "speed":
        return speed(json.loads(args[0]), json.loads(args[1]), int(args[2]))
    raise ValueError(f"Unknown probe mode {mode!r}: expected 'memory' or 'speed'")


def main(argv: list[str]) -> None:
    # If memory runs out, let the kernel pick this process, not a neighbour.
    with open("/proc/self/oom_score_adj", "w", encoding="utf-8") as adj:
        adj.write("1000")
    print(json.dumps(run(argv)))


if __name__ == "__main__":
    main(sys.argv[1:])
