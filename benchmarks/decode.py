"""Per-token decode time with and without SelfAttention's key/value cache.

Usage:
    python -m benchmarks.decode [--rounds 15] [--json PATH]
    KERAS_BACKEND=jax python -m benchmarks.decode
    python -m benchmarks.decode --quick      # tiny smoke run; numbers mean nothing

Model: a stack of LAYERS causal SelfAttention layers, `h = h + layer(h)`,
D = 256 features, 8 heads x key_dim 32, rotary positions, biases, output
projection to D, float32, batch 1; once with full key/value heads and once
with grouped-query attention (`num_key_value_heads = num_heads / 4`). For
each context C the two ways of producing the output at position C - 1 are:

- uncached: the full causal forward over (1, C, D), which is what decoding
  without a cache recomputes for every new token;
- cached: one step over (1, 1, D) at `cache_update_index = C - 1`, with one
  cache per layer of max_length C holding positions 0 .. C - 2 (filled by one
  cached call over them first).

Before anything is timed, the cached step's output is compared with the
uncached forward's last position (max abs difference). All four callables of
a context (uncached and cached, full heads and GQA) run interleaved in one
process (`benchmarks.timing`); the tables give medians and medians of the
per-round ratios, with quartiles. Compilation, per backend: JAX `jax.jit`
over `stateless_call` (the step donates its caches, so their update happens
in place, as in a decoding loop); TensorFlow `tf.function`; PyTorch eager
under `torch.no_grad()`. Cache memory is the bytes of the cache tensors.

Targets (reported as met / not met, never asserted): cached decode at least
5x faster per token than recomputing at context 512 and 20x at 2048; GQA
caches 4x smaller; GQA no slower than full heads (median time ratio <= 1).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace

import keras
import numpy as np
from keras import ops

from benchmarks import machine, report, runners
from benchmarks.timing import Interleaved, interleave
from keras_selfattn import SelfAttention

FULL, GQA = "full", "gqa"
UNCACHED, CACHED = "uncached", "cached"
SPEEDUP_TARGETS = {512: 5.0, 2048: 20.0}
GQA_DIVISOR = 4
MIB = 2**20


@dataclass(frozen=True)
class Settings:
    """Sizes and repetitions of one run."""

    features: int = 256
    num_heads: int = 8
    layers: int = 4
    contexts: tuple[int, ...] = (512, 2048)
    rounds: int = 15
    min_round_s: float = 0.05


QUICK = Settings(
    features=32, num_heads=4, layers=2, contexts=(32, 64), rounds=2, min_round_s=0.0
)


def _log(message: str) -> None:
    print(f"[decode] {message}", file=sys.stderr, flush=True)


# -------------------------------------------------------------------- model
class AttentionStack(keras.Model):
    """`layers` causal SelfAttention layers with residuals, cacheable.

    `stack(x)` runs the full causal forward and returns the last position,
    (batch, features); `stack(x, caches=caches, cache_update_index=i)` runs
    positions `i ..` and returns `(last position, updated caches)`.

    Args:
        settings: Sizes.
        num_key_value_heads: Key/value heads of every layer.
        **kwargs: Base model arguments.
    """

    def __init__(self, settings: Settings, num_key_value_heads: int, **kwargs):
        super().__init__(**kwargs)
        self.attention_layers = [
            SelfAttention(
                num_heads=settings.num_heads,
                num_key_value_heads=num_key_value_heads,
                causal=True,
                rope_max_wavelength=10000,
                output_dim=settings.features,
                use_bias=True,
                name=f"attention_{i}",
            )
            for i in range(settings.layers)
        ]

    def call(self, x, caches=None, cache_update_index=None):
        if caches is None:
            for layer in self.attention_layers:
                x = ops.add(x, layer(x))
            return x[:, -1]
        updated = []
        for layer, cache in zip(self.attention_layers, caches, strict=True):
            out, cache = layer(x, cache=cache, cache_update_index=cache_update_index)
            x = ops.add(x, out)
            updated.append(cache)
        return x[:, -1], updated

    def empty_caches(self, batch_size: int, max_length: int) -> list:
        """One zero cache per layer."""
        return [
            layer.empty_cache(batch_size, max_length) for layer in self.attention_layers
        ]


def cache_bytes(caches: Sequence) -> int:
    """Total bytes of the cache tensors."""
    return sum(
        int(np.prod(tuple(cache.shape)))
        * np.dtype(keras.backend.standardize_dtype(cache.dtype)).itemsize
        for cache in caches
    )


# ------------------------------------------------------- compiled callables
Forward = Callable[[object], object]
Step = Callable[[object, list, object], tuple[object, list]]


def _compile_jax(stack: AttentionStack) -> tuple[Forward, Step, str]:
    import jax

    trainable = [v.value for v in stack.trainable_variables]
    non_trainable = [v.value for v in stack.non_trainable_variables]

    def forward(trainable, non_trainable, x):
        return stack.stateless_call(trainable, non_trainable, x)[0]

    def step(trainable, non_trainable, x, caches, index):
        return stack.stateless_call(
            trainable, non_trainable, x, caches=caches, cache_update_index=index
        )[0]

    forward_jit = jax.jit(forward)
    step_jit = jax.jit(step, donate_argnums=(3,))
    return (
        lambda x: jax.block_until_ready(forward_jit(trainable, non_trainable, x)),
        lambda x, caches, index: jax.block_until_ready(
            step_jit(trainable, non_trainable, x, caches, index)
        ),
        "jax.jit over stateless_call, caches donated",
    )


def _compile_tensorflow(stack: AttentionStack) -> tuple[Forward, Step, str]:
    import tensorflow as tf

    forward = tf.function(lambda x: stack(x))
    step = tf.function(
        lambda x, caches, index: stack(x, caches=caches, cache_update_index=index)
    )
    return forward, step, "tf.function (no XLA, Keras's default on CPU)"


def _compile_torch(stack: AttentionStack) -> tuple[Forward, Step, str]:
    import torch

    def forward(x):
        with torch.no_grad():
            return stack(x)

    def step(x, caches, index):
        with torch.no_grad():
            return stack(x, caches=caches, cache_update_index=index)

    return forward, step, "eager under torch.no_grad()"


def compile_calls(stack: AttentionStack) -> tuple[Forward, Step, str]:
    """(forward, step, description) for the current backend; both return
    when their work is finished."""
    return {
        "jax": _compile_jax,
        "tensorflow": _compile_tensorflow,
        "torch": _compile_torch,
    }[keras.backend.backend()](stack)


# ------------------------------------------------------------- measurement
@dataclass
class Prepared:
    """One model at one context, ready to time."""

    uncached: Callable[[], object]
    cached: Callable[[], object]
    cache_bytes: int
    max_abs_difference: float
    compiled: str


class _CachedCall:
    """One decode step at a fixed index, feeding each step's caches to the
    next (on JAX the previous ones were donated)."""

    def __init__(self, step: Step, x, caches: list, index):
        self._step, self._x, self.caches, self._index = step, x, caches, index

    def __call__(self):
        out, self.caches = self._step(self._x, self.caches, self._index)
        return out


def prepare(settings: Settings, context: int, kv_heads: int, seed: int) -> Prepared:
    """Builds the stack, fills its caches with positions 0 .. C - 2, checks
    the cached step against the full forward, and returns the callables."""
    keras.utils.set_random_seed(seed)
    stack = AttentionStack(settings, kv_heads)
    x = np.random.default_rng(seed).normal(size=(1, context, settings.features))
    x = ops.convert_to_tensor(x.astype("float32"))
    stack(x[:, :2])  # builds the layers
    forward, step, compiled = compile_calls(stack)
    expected = ops.convert_to_numpy(forward(x))
    _, caches = stack(
        x[:, : context - 1],
        caches=stack.empty_caches(1, context),
        cache_update_index=0,
    )
    size = cache_bytes(caches)
    last, index = x[:, context - 1 :], ops.convert_to_tensor(context - 1, "int32")
    cached = _CachedCall(step, last, caches, index)
    got = ops.convert_to_numpy(cached())
    return Prepared(
        uncached=lambda: forward(x),
        cached=cached,
        cache_bytes=size,
        max_abs_difference=float(np.max(np.abs(got - expected))),
        compiled=compiled,
    )


def _name(mode: str, kind: str) -> str:
    return f"{mode}/{kind}"


def _ratio(timing: Interleaved, numerator: str, denominator: str) -> dict:
    """Median and quartiles of the per-round numerator / denominator times."""
    # Interleaved.speedup(a, b) is the median of the per-round a / b.
    q1, q3 = timing.quartiles(numerator, denominator)
    return {
        "median": timing.speedup(numerator, denominator),
        "q1": q1,
        "q3": q3,
    }


def measure_context(settings: Settings, context: int) -> dict:
    """Times uncached and cached, full heads and GQA, at one context."""
    heads = {FULL: settings.num_heads, GQA: settings.num_heads // GQA_DIVISOR}
    prepared = {
        kind: prepare(settings, context, kv, seed=index)
        for index, (kind, kv) in enumerate(heads.items())
    }
    candidates = {}
    for kind, p in prepared.items():
        candidates[_name(UNCACHED, kind)] = p.uncached
        candidates[_name(CACHED, kind)] = p.cached
    start = time.perf_counter()
    timing = interleave(
        candidates, rounds=settings.rounds, min_round_s=settings.min_round_s
    )
    _log(f"context {context}: timed in {time.perf_counter() - start:.1f} s")
    rows = []
    for kind, p in prepared.items():
        rows.append(
            {
                "context": context,
                "kind": kind,
                "num_heads": settings.num_heads,
                "num_key_value_heads": heads[kind],
                "uncached_ms": 1e3 * timing.median(_name(UNCACHED, kind)),
                "cached_ms": 1e3 * timing.median(_name(CACHED, kind)),
                # uncached time / cached time, per round.
                "speedup": _ratio(timing, _name(UNCACHED, kind), _name(CACHED, kind)),
                "cache_bytes": p.cache_bytes,
                "max_abs_difference": p.max_abs_difference,
            }
        )
    gqa = {
        "context": context,
        "cache_bytes_full": prepared[FULL].cache_bytes,
        "cache_bytes_gqa": prepared[GQA].cache_bytes,
        "memory_ratio": prepared[FULL].cache_bytes / prepared[GQA].cache_bytes,
        # GQA time / full-heads time, per round (< 1: GQA faster).
        "cached_time_ratio": _ratio(timing, _name(CACHED, GQA), _name(CACHED, FULL)),
        "uncached_time_ratio": _ratio(
            timing, _name(UNCACHED, GQA), _name(UNCACHED, FULL)
        ),
    }
    return {"rows": rows, "gqa": gqa, "compiled": prepared[FULL].compiled}


def targets(rows: list[dict], gqa_rows: list[dict]) -> list[dict]:
    """The issue's targets with the measured value and whether each is met."""
    results = []
    for row in rows:
        goal = SPEEDUP_TARGETS.get(row["context"])
        if row["kind"] == FULL and goal is not None:
            results.append(
                {
                    "target": f"cached decode >= {goal:g}x faster per token than "
                    f"recomputing, context {row['context']}",
                    "measured": f"{row['speedup']['median']:.1f}x",
                    "met": row["speedup"]["median"] >= goal,
                }
            )
    for g in gqa_rows:
        context = g["context"]
        results.append(
            {
                "target": f"GQA cache memory {GQA_DIVISOR}x smaller, context {context}",
                "measured": f"{g['memory_ratio']:.2f}x smaller",
                "met": g["memory_ratio"] >= GQA_DIVISOR,
            }
        )
        for key, what in (
            ("cached_time_ratio", "cached step"),
            ("uncached_time_ratio", "full forward"),
        ):
            ratio = g[key]["median"]
            results.append(
                {
                    "target": f"GQA {what} no slower than full heads, context "
                    f"{context}",
                    "measured": f"time ratio {ratio:.2f}",
                    "met": ratio <= 1.0,
                }
            )
    return results


def run(settings: Settings) -> dict:
    """Measures every context; returns rows, GQA comparisons and targets."""
    backend = runners.current()
    results = {
        "machine": machine.describe(backend),
        "settings": {**asdict(settings), "gqa_divisor": GQA_DIVISOR},
        "rows": [],
        "gqa": [],
    }
    for context in settings.contexts:
        measured = measure_context(settings, context)
        results["rows"] += measured["rows"]
        results["gqa"].append(measured["gqa"])
        results["compiled"] = measured["compiled"]
    results["targets"] = targets(results["rows"], results["gqa"])
    return results


# ------------------------------------------------------------------ report
def _quartiles(ratio: dict, digits: int) -> str:
    return (
        f"{ratio['median']:.{digits}f} "
        f"({ratio['q1']:.{digits}f}-{ratio['q3']:.{digits}f})"
    )


def to_markdown(results: dict) -> str:
    """Settings, the per-token table, the GQA table and the targets."""
    m, s = results["machine"], results["settings"]
    lines = [
        f"- Machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB "
        f"(load average {m['load_average_1_5_15min']}), {m['os']}",
        f"- Software: Python {m['python']}, Keras {m['keras']}, {m['backend']} "
        f"{m['backend_version']}; device {m['device']}; commit {m['git_commit']}",
        f"- Model: {s['layers']} causal SelfAttention layers with residuals, "
        f"D={s['features']}, {s['num_heads']} heads x key_dim "
        f"{s['features'] // s['num_heads']}, RoPE, biases, output_dim=D; "
        f"float32, batch 1; GQA: num_key_value_heads = num_heads / "
        f"{s['gqa_divisor']}",
        f"- Compiled: {results['compiled']}; {s['rounds']} interleaved rounds; "
        f"{m['date_utc']}",
        "",
        "| context | heads (kv heads) | uncached ms/token | cached ms/token "
        "| cached speedup (quartiles) | cache MiB | max abs diff |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results["rows"]:
        lines.append(
            f"| {r['context']} | {r['num_heads']} ({r['num_key_value_heads']}) "
            f"| {r['uncached_ms']:.3f} | {r['cached_ms']:.3f} "
            f"| {_quartiles(r['speedup'], 1)} | {r['cache_bytes'] / MIB:.3f} "
            f"| {r['max_abs_difference']:.1e} |"
        )
    lines += [
        "",
        "| context | cache bytes, full -> GQA | memory ratio "
        "| GQA/full time, cached step | GQA/full time, full forward |",
        "|---|---|---|---|---|",
    ]
    for g in results["gqa"]:
        lines.append(
            f"| {g['context']} | {g['cache_bytes_full']} -> {g['cache_bytes_gqa']} "
            f"| {g['memory_ratio']:.2f}x | {_quartiles(g['cached_time_ratio'], 2)} "
            f"| {_quartiles(g['uncached_time_ratio'], 2)} |"
        )
    lines += ["", "Targets:"]
    lines += [
        f"- {t['target']}: {t['measured']}, {'met' if t['met'] else 'NOT met'}"
        for t in results["targets"]
    ]
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--quick", action="store_true", help="tiny sizes, 2 rounds (smoke test)"
    )
    parser.add_argument("--rounds", type=int, help="interleaved rounds (default 15)")
    parser.add_argument("--json", metavar="PATH", help="write the results here")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    settings = QUICK if args.quick else Settings()
    if args.rounds is not None:
        settings = replace(settings, rounds=args.rounds)
    results = run(settings)
    print(to_markdown(results), end="")
    if args.json:
        report.write_json(results, args.json)
        _log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
