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

The printed report (`to_markdown`) is made from the results alone, what
--json writes: every number in it is a measured value, a setting, a target's
threshold, or the model as built (key_dim and kv heads read from the caches).

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
# The targets (thresholds, not measurements): cached speedup per
# context, GQA cache memory ratio (= GQA_DIVISOR), GQA / full time ratio.
SPEEDUP_TARGETS = {512: 5.0, 2048: 20.0}
GQA_DIVISOR = 4
NO_SLOWER = 1.0
BATCH = 1
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
    cache_shape: list[int]
    max_abs_difference: float
    compiled: str
    model: dict


class _CachedCall:
    """One decode step at a fixed index, feeding each step's caches to the
    next (on JAX the previous ones were donated)."""

    def __init__(self, step: Step, x, caches: list, index):
        self._step, self._x, self.caches, self._index = step, x, caches, index

    def __call__(self):
        out, self.caches = self._step(self._x, self.caches, self._index)
        return out


def describe_model(stack: AttentionStack, x, caches: Sequence) -> dict:
    """The built stack as the report states it, read from its input `x`, its
    first layer's config and its caches, (batch, 2, max_length, kv heads,
    key_dim)."""
    layer = stack.attention_layers[0]
    config = layer.get_config()
    batch, _, _, _, key_dim = tuple(caches[0].shape)
    return {
        "layers": len(stack.attention_layers),
        "features": int(x.shape[-1]),
        "num_heads": int(config["num_heads"]),
        "key_dim": int(key_dim),
        "output_dim": config["output_dim"],
        "causal": bool(config["causal"]),
        "rope_max_wavelength": config["rope_max_wavelength"],
        "use_bias": bool(config["use_bias"]),
        "dtype": layer.compute_dtype,
        "batch": int(batch),
    }


def prepare(settings: Settings, context: int, kv_heads: int, seed: int) -> Prepared:
    """Builds the stack, fills its caches with positions 0 .. C - 2, checks
    the cached step against the full forward, and returns the callables."""
    keras.utils.set_random_seed(seed)
    stack = AttentionStack(settings, kv_heads)
    x = np.random.default_rng(seed).normal(size=(BATCH, context, settings.features))
    x = ops.convert_to_tensor(x.astype("float32"))
    stack(x[:, :2])  # builds the layers
    forward, step, compiled = compile_calls(stack)
    expected = ops.convert_to_numpy(forward(x))
    _, caches = stack(
        x[:, : context - 1],
        caches=stack.empty_caches(BATCH, context),
        cache_update_index=0,
    )
    size, model = cache_bytes(caches), describe_model(stack, x, caches)
    shape = [int(n) for n in caches[0].shape]
    last, index = x[:, context - 1 :], ops.convert_to_tensor(context - 1, "int32")
    cached = _CachedCall(step, last, caches, index)
    got = ops.convert_to_numpy(cached())
    return Prepared(
        uncached=lambda: forward(x),
        cached=cached,
        cache_bytes=size,
        cache_shape=shape,
        max_abs_difference=float(np.max(np.abs(got - expected))),
        compiled=compiled,
        model=model,
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
                "num_heads": p.model["num_heads"],
                # (batch, 2, max_length, kv heads, key_dim) of one layer.
                "cache_shape": p.cache_shape,
                "num_key_value_heads": p.cache_shape[3],
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
    return {
        "rows": rows,
        "gqa": gqa,
        "compiled": prepared[FULL].compiled,
        "model": prepared[FULL].model,
    }


def _target(text: str, context: int, unit: str, value: float, threshold: float) -> dict:
    """One target: its value and threshold as numbers, met when the value is
    at least the threshold (unit "speedup", "memory_ratio") or at most it
    ("time_ratio")."""
    met = value <= threshold if unit == "time_ratio" else value >= threshold
    return {
        "target": text,
        "context": context,
        "unit": unit,
        "value": value,
        "threshold": threshold,
        "met": bool(met),
    }


def targets(rows: list[dict], gqa_rows: list[dict]) -> list[dict]:
    """The issue's targets with the measured value and whether each is met."""
    results = []
    for row in rows:
        goal = SPEEDUP_TARGETS.get(row["context"])
        if row["kind"] == FULL and goal is not None:
            text = (
                f"cached decode >= {goal:g}x faster per token than recomputing, "
                f"context {row['context']}"
            )
            results.append(
                _target(text, row["context"], "speedup", row["speedup"]["median"], goal)
            )
    for g in gqa_rows:
        context = g["context"]
        text = f"GQA cache memory {GQA_DIVISOR:g}x smaller, context {context}"
        results.append(
            _target(
                text, context, "memory_ratio", g["memory_ratio"], float(GQA_DIVISOR)
            )
        )
        for key, what in (
            ("cached_time_ratio", "cached step"),
            ("uncached_time_ratio", "full forward"),
        ):
            text = f"GQA {what} no slower than full heads, context {context}"
            results.append(
                _target(text, context, "time_ratio", g[key]["median"], NO_SLOWER)
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
        results["model"] = measured["model"]
    results["targets"] = targets(results["rows"], results["gqa"])
    return results


# ------------------------------------------------------------------ report
# Every number the report prints is a field of the results (the JSON written
# by --json), formatted here; nothing in it is typed in.
def _quartiles(ratio: dict, digits: int) -> str:
    return (
        f"{ratio['median']:.{digits}f} "
        f"({ratio['q1']:.{digits}f}-{ratio['q3']:.{digits}f})"
    )


# (key of a row, or function of a row -> cell text, header): `report.table`.
ROW_COLUMNS: list[tuple[str | Callable[[dict], str], str]] = [
    ("context", "context"),
    (lambda r: f"{r['num_heads']} ({r['num_key_value_heads']})", "heads (kv heads)"),
    (lambda r: f"{r['uncached_ms']:.3f}", "uncached ms/token"),
    (lambda r: f"{r['cached_ms']:.3f}", "cached ms/token"),
    (lambda r: _quartiles(r["speedup"], 1), "cached speedup (quartiles)"),
    (lambda r: f"{r['cache_bytes'] / MIB:.3f}", "cache MiB"),
    ("max_abs_difference", "max abs diff"),
]
GQA_COLUMNS: list[tuple[str | Callable[[dict], str], str]] = [
    ("context", "context"),
    (
        lambda g: f"{g['cache_bytes_full']} -> {g['cache_bytes_gqa']}",
        "cache bytes, full -> GQA",
    ),
    (lambda g: f"{g['memory_ratio']:.2f}x", "memory ratio"),
    (lambda g: _quartiles(g["cached_time_ratio"], 2), "GQA/full time, cached step"),
    (
        lambda g: _quartiles(g["uncached_time_ratio"], 2),
        "GQA/full time, full forward",
    ),
]
# A target's measured value, by unit.
MEASURED = {
    "speedup": "{:.1f}x",
    "memory_ratio": "{:.2f}x smaller",
    "time_ratio": "time ratio {:.2f}",
}


def _model_line(model: dict, settings: dict) -> str:
    causal = "causal " if model["causal"] else ""
    parts = [
        f"{model['layers']} {causal}SelfAttention layers with residuals",
        f"D={model['features']}",
        f"{model['num_heads']} heads x key_dim {model['key_dim']}",
    ]
    if model["rope_max_wavelength"]:
        parts.append(f"RoPE (max wavelength {model['rope_max_wavelength']:g})")
    if model["use_bias"]:
        parts.append("biases")
    if model["output_dim"]:
        parts.append(f"output_dim={model['output_dim']}")
    return (
        f"- Model: {', '.join(parts)}; {model['dtype']}, batch "
        f"{model['batch']}; GQA: num_key_value_heads = num_heads / "
        f"{settings['gqa_divisor']}"
    )


def _target_line(target: dict) -> str:
    measured = MEASURED[target["unit"]].format(target["value"])
    return f"- {target['target']}: {measured}, {'met' if target['met'] else 'NOT met'}"


def to_markdown(results: dict) -> str:
    """Settings, the per-token table, the GQA table and the targets, all from
    `results` (what `run` returns and --json writes)."""
    m, s = results["machine"], results["settings"]
    lines = [
        f"- Machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB "
        f"(load average {m['load_average_1_5_15min']}), {m['os']}",
        f"- Software: Python {m['python']}, Keras {m['keras']}, {m['backend']} "
        f"{m['backend_version']}; device {m['device']}; commit {m['git_commit']}",
        _model_line(results["model"], s),
        f"- Compiled: {results['compiled']}; {s['rounds']} interleaved rounds; "
        f"{m['date_utc']}",
        "",
        *report.table(ROW_COLUMNS, results["rows"]),
        "",
        *report.table(GQA_COLUMNS, results["gqa"]),
        "",
        "Targets:",
        *(_target_line(t) for t in results["targets"]),
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
