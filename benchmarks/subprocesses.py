"""Memory and long-sequence measurements, each in a fresh child process.

A child that would need more memory than the machine has available
(`pairs.estimated_bytes`, the one estimate, plus `MARGIN_BYTES`) is not
started; its row says so instead of holding a number. With
`in_process=True` (the quick run of the test suite) the probes run in this
process instead: faster, but the peak RSS is then this process's.
"""

from __future__ import annotations

import json

from benchmarks import pairs, probe

GIB = 1024**3
# Kept free besides the estimate (`pairs.estimated_bytes`, the attention
# tensors only): the child process itself (about 0.6-0.7 GiB with TensorFlow
# loaded), its weights and activations, and the rest of the machine.
MARGIN_BYTES = 3 * GIB // 2


def spec(
    layer: str,
    batch: int,
    time: int,
    features: int,
    num_heads: int,
    key_dim: int,
    output_dim: int | None,
    **options,
) -> dict:
    """A probe SPEC (see benchmarks.probe)."""
    return {
        "layer": layer,
        "batch": batch,
        "time": time,
        "features": features,
        "num_heads": num_heads,
        "key_dim": key_dim,
        "output_dim": output_dim,
        "options": options,
    }


def estimate(probe_spec: dict) -> int:
    """`pairs.estimated_bytes` of the forward pass a probe SPEC describes."""
    return pairs.estimated_bytes(
        probe_spec["batch"],
        probe_spec["time"],
        probe_spec["num_heads"],
        chunk_size=probe_spec["options"].get("chunk_size"),
    )


def available_bytes() -> int:
    """MemAvailable of /proc/meminfo, in bytes."""
    with open("/proc/meminfo", encoding="utf-8") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("MemAvailable missing from /proc/meminfo")


def _too_big(probe_spec: dict) -> str | None:
    return refusal(estimate(probe_spec))


def refusal(estimated: int) -> str | None:
    """Why a measurement needing about `estimated` bytes
    (`pairs.estimated_bytes`) is not started, or None when it fits in
    MemAvailable with `MARGIN_BYTES` to spare."""
    needed = estimated + MARGIN_BYTES
    available = available_bytes()
    if needed > available:
        return (
            f"not run: needs about {needed / GIB:.1f} GiB, "
            f"{available / GIB:.1f} GiB available"
        )
    return None


def _run_probe(args: list[str], timeout_s: float, in_process: bool) -> dict:
    return probe.run(args) if in_process else probe.run_child(args, timeout_s)


def peak_memory(
    probe_spec: dict, in_process: bool = False, timeout_s: float = 600
) -> dict:
    """{"peak_mib", "baseline_mib", "seconds"} or {"status": reason not run}."""
    reason = _too_big(probe_spec)
    if reason:
        return {"status": reason}
    return _run_probe(["memory", json.dumps(probe_spec)], timeout_s, in_process)


def speed(
    spec_a: dict,
    spec_b: dict,
    rounds: int,
    in_process: bool = False,
    timeout_s: float = 900,
) -> dict:
    """{"speedup" (time_a / time_b), "ms_a", "ms_b"} or {"status": reason}."""
    reason = _too_big(spec_a) or _too_big(spec_b)
    if reason:
        return {"status": reason}
    args = ["speed", json.dumps(spec_a), json.dumps(spec_b), str(rounds)]
    return _run_probe(args, timeout_s, in_process)


def memory_rows(
    times: list[int],
    features: int,
    num_heads: int,
    key_dim: int,
    output_dim: int,
    in_process: bool = False,
) -> list[dict]:
    """Peak RSS of one forward pass (batch 1), SelfAttention vs MultiHeadAttention."""
    rows = []
    for time in times:
        for layer in ("self_attention", "mha"):
            probe_spec = spec(layer, 1, time, features, num_heads, key_dim, output_dim)
            rows.append(
                {
                    "layer": layer,
                    "shape": f"(1, {time}, {features})",
                    **peak_memory(probe_spec, in_process),
                }
            )
    return rows


def long_sequence_rows(
    time: int, window: int, chunk_size: int, rounds: int, in_process: bool = False
) -> list[dict]:
    """Issue 6's targets: batch 1, one head, key_dim 64, features 64.

    - peak RSS of a forward pass with and without chunk_size;
    - speed of sliding_window=`window` chunked vs unchunked.
    """
    shape = f"(1, {time}, 64)"

    def probe_spec(**options) -> dict:
        return spec("self_attention", 1, time, 64, 1, 64, None, **options)

    rows = [
        {
            "case": "memory chunked",
            "shape": shape,
            "chunk_size": chunk_size,
            **peak_memory(probe_spec(chunk_size=chunk_size), in_process),
        },
        {
            "case": "memory unchunked",
            "shape": shape,
            "chunk_size": None,
            **peak_memory(probe_spec(), in_process),
        },
    ]
    unchunked = probe_spec(sliding_window=window)
    chunked = probe_spec(sliding_window=window, chunk_size=chunk_size)
    rows.append(
        {
            "case": "sliding window",
            "shape": shape,
            "sliding_window": window,
            "chunk_size": chunk_size,
            **speed(unchunked, chunked, rounds, in_process),
        }
    )
    return rows
