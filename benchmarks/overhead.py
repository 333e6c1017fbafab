"""`python -m benchmarks.overhead`: the per-call (eager) overhead of
SelfAttention against keras.layers.MultiHeadAttention, on each backend.

At a tiny shape, (1, 8, 32), a call is almost all Python and framework
dispatch, not arithmetic: what PyTorch users pay by default, and every
eager decoding step or custom training loop. Both layers: 4 heads,
key_dim 8, biases, an output projection back to 32 features (MultiHead
Attention's defaults; SelfAttention(num_heads=4, key_dim=8, output_dim=32,
use_bias=True)), the same weights (MultiHeadAttention's copied in,
`keras_selfattn.migration`). Two rows per backend:

- unpadded: `layer(x)` against `mha(x, x)`;
- padded: the last 2 of 8 positions padding, `layer(x, mask=mask)`
  against `mha(x, x, attention_mask=mask[:, None, :])` (what a Keras mask
  becomes in MultiHeadAttention).

Each backend runs in a fresh process of its own (KERAS_BACKEND set); in it
the two calls alternate one by one (A B A B ...) and each is timed alone;
the ratio is the median SelfAttention time over the median
MultiHeadAttention time of the same run (below 1: SelfAttention faster).
The outputs of the two layers are compared once (max abs difference).
PyTorch runs on one thread (`torch.set_num_threads(1)`), both layers alike.

Usage:
    python -m benchmarks.overhead [--quick] [--out DIR] [--rounds N]

`--quick` times 20 calls (seconds; the numbers mean little). Results go to
DIR/overhead.json and DIR/overhead.md (default DIR: benchmarks/results).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

from benchmarks import report

BACKENDS = ("tensorflow", "jax", "torch")
SHAPE = (1, 8, 32)
NUM_HEADS, KEY_DIM = 4, 8
PADDED = 2  # padding positions at the end of the padded row
ROUNDS = 300


def _median_us(times: list[float]) -> float:
    return round(statistics.median(times) * 1e6, 1)


def time_pair(
    ours: Callable[[], object], theirs: Callable[[], object], rounds: int
) -> tuple[list[float], list[float]]:
    """Seconds of `rounds` calls of each, alternated one by one (the order
    swapped every round), after 20 untimed calls of each."""
    for _ in range(20):
        ours()
        theirs()
    times: tuple[list[float], list[float]] = ([], [])
    pair = ((0, ours), (1, theirs))
    for index in range(rounds):
        for slot, fn in pair if index % 2 == 0 else pair[::-1]:
            start = time.perf_counter()
            fn()
            times[slot].append(time.perf_counter() - start)
    return times


def _child(rounds: int) -> dict:
    """Both rows on this process's backend."""
    import keras
    import numpy as np

    from benchmarks import machine
    from keras_selfattn import SelfAttention

    if keras.backend.backend() == "torch":
        import torch

        # One thread: at this size the work is one small kernel per op, and
        # on a shared machine idle intra-op threads made calls of both
        # layers many times slower (benchmarks/README.md, "Per-call overhead").
        torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    x = keras.ops.convert_to_tensor(rng.normal(size=SHAPE).astype("float32"))
    valid = np.ones(SHAPE[:2], bool)
    valid[:, SHAPE[1] - PADDED :] = False
    mask = keras.ops.convert_to_tensor(valid)
    attention_mask = keras.ops.convert_to_tensor(
        np.broadcast_to(valid[:, None, :], (SHAPE[0], SHAPE[1], SHAPE[1]))
    )
    mha = keras.layers.MultiHeadAttention(num_heads=NUM_HEADS, key_dim=KEY_DIM)
    mha(x, x)
    ours = SelfAttention.from_multi_head_attention(mha)
    cases = {
        "unpadded": (lambda: ours(x), lambda: mha(x, x)),
        "padded": (
            lambda: ours(x, mask=mask),
            lambda: mha(x, x, attention_mask=attention_mask),
        ),
    }
    rows = []
    for name, (call_ours, call_mha) in cases.items():
        difference = np.abs(
            keras.ops.convert_to_numpy(call_ours())[valid]
            - keras.ops.convert_to_numpy(call_mha())[valid]
        ).max()
        ours_s, mha_s = time_pair(call_ours, call_mha, rounds)
        rows.append(
            {
                "backend": keras.backend.backend(),
                "case": name,
                "shape": str(SHAPE),
                "us_self_attention": _median_us(ours_s),
                "us_mha": _median_us(mha_s),
                "ratio": round(statistics.median(ours_s) / statistics.median(mha_s), 3),
                "max_abs_difference": float(difference),
            }
        )
    return {"rows": rows, "machine": machine.describe()}


def run(quick: bool = False, rounds: int | None = None) -> dict:
    """Each backend's rows, each in a fresh process (a backend that is not
    installed or fails gets a row saying so)."""
    rounds = rounds or (20 if quick else ROUNDS)
    rows, machines = [], {}
    for backend in BACKENDS:
        done = subprocess.run(
            [sys.executable, "-m", "benchmarks.overhead", "--child", str(rounds)],
            capture_output=True,
            text=True,
            env={**os.environ, "KERAS_BACKEND": backend},
        )
        if done.returncode:
            reason = (done.stderr.strip().splitlines() or ["failed"])[-1][:200]
            rows.append({"backend": backend, "status": f"not run: {reason}"})
            continue
        child = json.loads(done.stdout.strip().splitlines()[-1])
        rows += child["rows"]
        machines[backend] = child["machine"]
    return {"rounds": rounds, "rows": rows, "machines": machines}


def to_markdown(results: dict) -> str:
    """The run as one Markdown table, with the CPU and the method."""
    described = next(iter(results["machines"].values()), {})
    lines = [
        "# Per-call (eager) overhead: SelfAttention vs MultiHeadAttention",
        "",
        f"- CPU: {described.get('cpu', 'unknown')}, {described.get('cores')} "
        f"cores (load average {described.get('load_average_1_5_15min')}); "
        f"{described.get('date_utc', '')}, commit {described.get('git_commit')}",
        f"- Eager calls at {SHAPE}, {NUM_HEADS} heads x key_dim {KEY_DIM}, "
        f"output projection, biases, the same weights; medians of "
        f"{results['rounds']} calls each, alternated; ratio = SelfAttention "
        "/ MultiHeadAttention (below 1: SelfAttention faster); padded: the "
        f"last {PADDED} positions masked.",
        "",
    ]
    columns = [
        ("backend", "backend"),
        ("case", "case"),
        ("us_self_attention", "SelfAttention us"),
        ("us_mha", "MultiHeadAttention us"),
        (lambda row: row.get("status") or f"{row['ratio']:.2f}x", "ratio"),
        ("max_abs_difference", "max abs diff"),
    ]
    return "\n".join(lines + report.table(columns, results["rows"])) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--child"]:
        print(json.dumps(_child(int(argv[1]))))
        return
    report.main(
        __doc__,
        run,
        to_markdown,
        "overhead",
        {
            "quick": "20 calls per layer (seconds; numbers mean little)",
            "rounds": f"calls per layer and case (default {ROUNDS})",
        },
        argv,
    )


if __name__ == "__main__":
    main()
