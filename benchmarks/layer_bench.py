"""Forward and training-step comparisons of SelfAttention and MultiHeadAttention.

Each row interleaves three callables (MultiHeadAttention, SelfAttention, and
a square float32 matmul of about the same FLOPs as the ceiling), so the
speedup and the fraction of the matmul throughput come from the same rounds.
"""

from __future__ import annotations

import numpy as np

from benchmarks import cases
from benchmarks.timing import Interleaved, interleave


def _gflops(flops: int, seconds: float) -> float:
    return flops / seconds / 1e9


def _row(
    result: Interleaved, shape: cases.Shape, flops: int, matmul_n: int, **fields
) -> dict:
    matmul_flops = 2 * matmul_n**3
    return {
        "shape": shape.label,
        **fields,
        "speedup_vs_mha": result.speedup("mha", "ours"),
        "speedup_vs_mha_quartiles": list(result.quartiles("mha", "ours")),
        "gflops_ours": _gflops(flops, result.median("ours")),
        "gflops_mha": _gflops(flops, result.median("mha")),
        "gflops_matmul": _gflops(matmul_flops, result.median("matmul")),
        "matmul_n": matmul_n,
        # Per round: (flops / t_ours) / (matmul_flops / t_matmul).
        "fraction_of_matmul": result.speedup("matmul", "ours") * flops / matmul_flops,
        "ms_ours": 1e3 * result.median("ours"),
        "ms_mha": 1e3 * result.median("mha"),
        "rounds": len(result.times["ours"]),
    }


def _max_difference(calls: dict, mask=None) -> float:
    """Largest |ours - mha| over real (unpadded) query positions."""
    ours = np.asarray(calls["ours"]())
    mha = np.asarray(calls["mha"]())
    if mask is not None:
        keep = np.asarray(mask)[..., None]
        ours, mha = ours * keep, mha * keep
    return float(np.max(np.abs(ours - mha)))


def _timed_row(
    plan: cases.Plan, calls: dict, shape: cases.Shape, flops: int, **fields
) -> dict:
    """`calls` and a matmul of about `flops` interleaved, as one row."""
    matmul_n = cases.matmul_size(flops)
    result = interleave(
        {**calls, "matmul": cases.matmul_fn(matmul_n)},
        rounds=plan.rounds,
        min_round_s=plan.min_round_s,
    )
    return _row(result, shape, flops, matmul_n, **fields)


def forward_rows(plan: cases.Plan) -> list[dict]:
    """One row per shape and mask kind ("none", "padding", "causal")."""
    rows = []
    for shape in plan.forward_shapes:
        x = cases.random_input(shape)
        mask = cases.padding_mask(shape)
        for kind in cases.MASK_KINDS:
            ours, mha = cases.build_layers(shape, plan.config, causal=kind == "causal")
            calls = cases.forward_calls(ours, mha, x, kind, mask)
            difference = _max_difference(calls, mask if kind == "padding" else None)
            flops = cases.forward_flops(shape, plan.config)
            rows.append(
                _timed_row(
                    plan, calls, shape, flops, mask=kind, max_abs_difference=difference
                )
            )
    return rows


def training_rows(plan: cases.Plan) -> list[dict]:
    """One row per shape: forward + gradients of every weight, no mask."""
    rows = []
    for shape in plan.forward_shapes:
        ours, mha = cases.build_layers(shape, plan.config)
        calls = cases.training_calls(ours, mha, cases.random_input(shape))
        flops = cases.training_flops(shape, plan.config)
        rows.append(_timed_row(plan, calls, shape, flops, mask="none"))
    return rows
