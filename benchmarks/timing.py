"""Interleaved timing: A B C A B C ..., reported as medians of pairwise ratios.

The machines these benchmarks run on are shared and noisy, so absolute times
drift by tens of percent between minutes. Running the candidates in turn and
dividing the times of the same round cancels most of that drift.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Interleaved:
    """Per-round times (seconds per call) of several callables run in turn.

    Attributes:
        times: name -> list of seconds per call, one entry per round.
    """

    times: dict[str, list[float]]

    def median(self, name: str) -> float:
        """Median seconds per call of `name`."""
        return statistics.median(self.times[name])

    def ratios(self, baseline: str, candidate: str) -> list[float]:
        """Per-round baseline time / candidate time (>1: candidate faster)."""
        return [
            a / b
            for a, b in zip(self.times[baseline], self.times[candidate], strict=True)
        ]

    def speedup(self, baseline: str, candidate: str) -> float:
        """Median over rounds of baseline time / candidate time (>1: faster)."""
        return statistics.median(self.ratios(baseline, candidate))

    def quartiles(self, baseline: str, candidate: str) -> tuple[float, float]:
        """First and third quartiles of the per-round ratios (the noise).

        Exclusive quartiles, kept within the ratios' range: with two rounds
        the exclusive method extrapolates beyond them (ratios 1 and 3 would
        give 0.5 and 3.5; -0.1 for a time ratio was seen).
        """
        ratios = self.ratios(baseline, candidate)
        if len(ratios) < 2:
            return ratios[0], ratios[0]
        q1, _, q3 = statistics.quantiles(ratios, n=4)
        return max(q1, min(ratios)), min(q3, max(ratios))


@dataclass(frozen=True, kw_only=True)
class Plan:
    """What a benchmark times: at each (batch, time) of `shapes`, `rounds`
    interleaved rounds whose samples last about `min_round_s` (`interleave`).
    A benchmark's own plan adds its sizes to these (keyword-only fields, after
    its own)."""

    shapes: list[tuple[int, int]]
    rounds: int
    min_round_s: float


def _calls_per_round(fn: Callable[[], object], min_round_s: float) -> int:
    start = time.perf_counter()
    fn()
    once = time.perf_counter() - start
    return max(1, int(min_round_s / max(once, 1e-9)))


def interleave(
    candidates: dict[str, Callable[[], object]],
    rounds: int,
    warmup: int = 2,
    min_round_s: float = 0.05,
) -> Interleaved:
    """Times each callable in turn for `rounds` rounds.

    Odd rounds run the callables in reverse order (A B C, C B A, ...), so no
    candidate always follows the same neighbour.

    Args:
        candidates: name -> zero-argument callable; each call must finish its
            work before returning (e.g. convert the result to numpy).
        rounds: number of rounds; each round times every candidate once.
        warmup: untimed calls of each candidate first (tracing, caches).
        min_round_s: each timed sample repeats a call until about this long,
            so tiny workloads are not dominated by timer resolution.

    Returns:
        An `Interleaved` with seconds per call per round.

    Example:

    >>> result = interleave({"a": lambda: sum(range(100)),
    ...                      "b": lambda: sum(range(200))}, rounds=3)
    >>> result.speedup("b", "a") > 0
    True
    """
    if rounds < 1:
        raise ValueError(f"`rounds` must be >= 1. Received: rounds={rounds}")
    for fn in candidates.values():
        for _ in range(warmup):
            fn()
    repeats = {
        name: _calls_per_round(fn, min_round_s) for name, fn in candidates.items()
    }
    times: dict[str, list[float]] = {name: [] for name in candidates}
    order = list(candidates.items())
    for round_index in range(rounds):
        for name, fn in order if round_index % 2 == 0 else order[::-1]:
            start = time.perf_counter()
            for _ in range(repeats[name]):
                fn()
            times[name].append((time.perf_counter() - start) / repeats[name])
    return Interleaved(times)
