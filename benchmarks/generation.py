"""Generation: tokens per second of `generate`, the exported generators, and
the exported decoding step driven token by token.

Usage:
    python -m benchmarks.generation [--quick] [--out DIR] [--rounds N]

Two causal token models (greedy, prompts of PROMPT tokens, NEW_TOKENS new
ones, batch 1 and 8): "example", the size of examples/text_generation.py
(width 64, 4 heads over 2 key/value heads, 2 blocks, 96 characters), and
"d256" (4 blocks, D=256, 8 heads x key_dim 32, vocabulary 256); blocks are
rotary causal SelfAttention + residual + LayerNorm, then a Dense MLP +
residual + LayerNorm. On TensorFlow, in this process and interleaved
(A B C ..., C B A ...): `keras_selfattn.generate`, the SavedModel
generator's `generate` signature (as exported by default, and with
`jit_compile=True`: its loop compiled by XLA), the ONNX generator (ONNX
Runtime), and
the same generation driven from Python one token per call through the
exported decoding step (SavedModel `decode_step` signature and ONNX), numpy
arrays in and out as a serving client would send them (every layer's cache
both ways), the next token chosen in numpy. Every candidate must return the
same tokens as `generate`. The SavedModel generator and step are timed
again in a child process whose TensorFlow runs everything on one thread
(SERVING_THREADS; TF Serving: `--tensorflow_intra_op_parallelism=1
--tensorflow_inter_op_parallelism=1`): on a shared 2-core machine, a
loop whose ops hand work to a second thread waits whenever that thread's
core is busy elsewhere. Then `generate` on JAX and PyTorch, each timed
in a child process of its own (`KERAS_BACKEND` fixed there). Writes
DIR/generation.json and DIR/generation.md (default DIR: benchmarks/results).
Nothing here asserts a target: the run reports each with its value.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable

import numpy as np

from benchmarks import machine, report
from benchmarks.timing import interleave

# The target: the SavedModel generator against its step driven from
# Python, at least this many times faster.
GENERATOR_SPEEDUP = 3.0
PROMPT = 32
NEW_TOKENS = 256
BATCHES = (1, 8)
# The second TensorFlow configuration timed (the first is TensorFlow's
# default thread pools, as many threads as cores).
SERVING_THREADS = {"intra_op": 1, "inter_op": 1}


@dataclasses.dataclass(frozen=True)
class Size:
    """One model size."""

    name: str
    vocabulary: int
    width: int
    heads: int
    kv_heads: int
    blocks: int


SIZES = (
    Size("example", 96, 64, 4, 2, 2),
    Size("d256", 256, 256, 8, 8, 4),
)
QUICK_SIZES = (Size("tiny", 16, 16, 2, 1, 1),)
# The help of `--quick` and `--rounds`.
_HELPS = {"quick": "tiny sizes, 1 round", "rounds": "rounds per batch"}


def build_model(size: Size, seed: int = 0):
    """The causal token model of `size` (module docstring)."""
    import keras

    from keras_selfattn import SelfAttention

    keras.utils.set_random_seed(seed)
    tokens = keras.Input((None,), dtype="int32", name="tokens")
    h = keras.layers.Embedding(size.vocabulary, size.width)(tokens)
    for block in range(size.blocks):
        attended = SelfAttention(
            num_heads=size.heads,
            num_key_value_heads=size.kv_heads,
            causal=True,
            rope_max_wavelength=10000,
            output_dim=size.width,
            use_bias=True,
            name=f"attention_{block}",
        )(h)
        h = keras.layers.LayerNormalization()(keras.layers.Add()([h, attended]))
        mlp = keras.layers.Dense(4 * size.width, activation="gelu")(h)
        mlp = keras.layers.Dense(size.width)(mlp)
        h = keras.layers.LayerNormalization()(keras.layers.Add()([h, mlp]))
    return keras.Model(tokens, keras.layers.Dense(size.vocabulary, name="logits")(h))


def prompts(size: Size, batch: int, length: int) -> np.ndarray:
    rng = np.random.default_rng(batch)
    return rng.integers(1, size.vocabulary, size=(batch, length)).astype("int32")


def greedy_request(batch_prompts: np.ndarray, new: int, vocabulary: int) -> dict:
    """An exported generator's inputs: `new` greedy tokens after each of
    `batch_prompts` (int32, all of their full length)."""
    return {
        "prompt_tokens": batch_prompts,
        "prompt_lengths": np.full(len(batch_prompts), batch_prompts.shape[1], "int32"),
        "max_new_tokens": np.array(new, "int32"),
        "temperature": np.array(0.0, "float32"),
        "top_k": np.array(vocabulary, "int32"),
        "top_p": np.array(1.0, "float32"),
        "seed": np.array(0, "int32"),
        "end_token": np.array(-1, "int32"),
    }


def _stepped(step_call: Callable, caches: dict, batch_prompts: np.ndarray, new: int):
    """Greedy generation through a decoding step, one call per token."""
    arrays = {"tokens": batch_prompts, **caches, "cache_update_index": np.int32(0)}
    generated = []
    index = 0
    for _ in range(new):
        outputs = step_call(arrays)
        token = np.argmax(outputs["logits"][:, -1], axis=-1).astype("int32")
        generated.append(token)
        index += arrays["tokens"].shape[1]
        arrays = {
            "tokens": token[:, None],
            "cache_update_index": np.array(index, "int32"),
            **{
                name[len("updated_") :]: value
                for name, value in outputs.items()
                if name.startswith("updated_cache_")
            },
        }
    return np.stack(generated, axis=1)


def _saved_model_signature(directory: str, name: str) -> Callable[[dict], dict]:
    """The SavedModel's signature `name`, TensorFlow's XLA as it is (the
    generator compiled with XLA needs it)."""
    import keras_selfattn_runtimes as runtimes

    return runtimes.load("saved_model", directory, name, tf_serving=False)


def _onnx_session(path: str) -> Callable[[dict], dict]:
    """A CPU session without spinning between calls: it would take the cores
    from the next candidate timed."""
    import keras_selfattn_runtimes as runtimes

    return runtimes.load("onnx", path, spinning=False)


def _export_all(model, directory: str, max_length: int, check: bool) -> dict[str, str]:
    """Every exported candidate; `check=False` (the quick run) skips the
    exporters' fresh-process checks: each row still compares its tokens
    with `generate`'s."""
    from keras_selfattn.export import export_decode_step
    from keras_selfattn.export.generator import export_generator

    common = {"max_length": max_length, "check": check}
    path = functools.partial(os.path.join, directory)
    return {
        "saved_model_generator": export_generator(
            model, path("generator"), "saved_model", name="lm", **common
        ),
        "saved_model_generator_xla": export_generator(
            model,
            path("generator_xla"),
            "saved_model",
            name="lm",
            jit_compile=True,
            **common,
        ),
        "onnx_generator": export_generator(
            model, path("generator.onnx"), "onnx", **common
        ),
        "saved_model_step": export_decode_step(
            model, path("step"), "saved_model", name="lm", **common
        ),
        "onnx_step": export_decode_step(model, path("step.onnx"), "onnx", **common),
    }


def measure_size(size: Size, plan: dict, rounds: int) -> list[dict]:
    """Every TensorFlow candidate at each batch, interleaved; one row each."""
    import keras

    from keras_selfattn import generate

    model = build_model(size)
    new, prompt = plan["new_tokens"], plan["prompt"]
    max_length = prompt + new
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_generation_") as directory:
        paths = _export_all(model, directory, max_length, plan["check"])
        generators = {
            "saved_model_generator": _saved_model_signature(
                paths["saved_model_generator"], "generate"
            ),
            "saved_model_generator_xla": _saved_model_signature(
                paths["saved_model_generator_xla"], "generate"
            ),
            "onnx_generator": _onnx_session(paths["onnx_generator"]),
        }
        steps = {
            "saved_model_step": _saved_model_signature(
                paths["saved_model_step"], "decode_step"
            ),
            "onnx_step": _onnx_session(paths["onnx_step"]),
        }
        layers = [layer for layer in model.layers if hasattr(layer, "empty_cache")]
        cases = []
        for batch in plan["batches"]:
            batch_prompts = prompts(size, batch, prompt)
            caches = {
                f"cache_{layer.name}": keras.ops.convert_to_numpy(
                    layer.empty_cache(batch, max_length)
                )
                for layer in layers
            }
            request = greedy_request(batch_prompts, new, size.vocabulary)
            candidates = {
                "generate": lambda p=batch_prompts: generate(model, p, new).tokens,
                **{
                    name: (lambda c=call, r=request: c(r)["tokens"])
                    for name, call in generators.items()
                },
                **{
                    name: (
                        lambda c=call, p=batch_prompts, k=caches: _stepped(c, k, p, new)
                    )
                    for name, call in steps.items()
                },
            }
            reference = candidates["generate"]()
            same = {
                name: bool(np.array_equal(fn(), reference))
                for name, fn in candidates.items()
            }
            timing = interleave(candidates, rounds=rounds, warmup=1, min_round_s=0.0)
            rows += _timed_rows(size.name, batch, new, timing, same, "default")
            cases.append(
                {
                    "batch": batch,
                    "prompts": batch_prompts.tolist(),
                    "caches": {k: [v.shape, str(v.dtype)] for k, v in caches.items()},
                    "reference": np.asarray(reference).tolist(),
                }
            )
        child = {
            "model": size.name,
            "vocabulary": size.vocabulary,
            "new_tokens": new,
            "rounds": rounds,
            "generator": paths["saved_model_generator"],
            "step": paths["saved_model_step"],
            "cases": cases,
            **SERVING_THREADS,
        }
        rows += _in_child(
            threads_child.__name__, child, "tensorflow", "saved_model_generator"
        )
    return rows


def _threads(config: dict) -> str:
    return f"intra-op {config['intra_op']}, inter-op {config['inter_op']}"


def _timed_rows(model, batch, new, timing, same, threads: str) -> list[dict]:
    return [
        {
            "model": model,
            "batch": batch,
            "backend": "tensorflow",
            "threads": threads,
            "candidate": name,
            "tokens_per_s": batch * new / timing.median(name),
            "seconds": timing.median(name),
            "vs_saved_model_step": timing.speedup("saved_model_step", name),
            "same_tokens": same[name],
        }
        for name in timing.times
    ]


def threads_child() -> None:
    """The child process of `measure_size`: the SavedModel generator and
    step interleaved, with TensorFlow's thread pools as the plan (JSON, the
    first argument) says; prints its rows."""
    import tensorflow as tf

    plan = json.loads(sys.argv[1])
    tf.config.threading.set_intra_op_parallelism_threads(plan["intra_op"])
    tf.config.threading.set_inter_op_parallelism_threads(plan["inter_op"])
    generator = _saved_model_signature(plan["generator"], "generate")
    step = _saved_model_signature(plan["step"], "decode_step")
    new, rows = plan["new_tokens"], []
    for case in plan["cases"]:
        batch_prompts = np.asarray(case["prompts"], "int32")
        caches = {k: np.zeros(*shape) for k, shape in case["caches"].items()}
        request = greedy_request(batch_prompts, new, plan["vocabulary"])
        candidates = {
            "saved_model_generator": lambda r=request: generator(r)["tokens"],
            "saved_model_step": lambda p=batch_prompts, k=caches: _stepped(
                step, k, p, new
            ),
        }
        same = {
            name: bool(np.array_equal(fn(), case["reference"]))
            for name, fn in candidates.items()
        }
        timing = interleave(
            candidates, rounds=plan["rounds"], warmup=1, min_round_s=0.0
        )
        rows += _timed_rows(
            plan["model"], case["batch"], new, timing, same, _threads(plan)
        )
    print("ROWS " + json.dumps(rows))


def generate_child() -> None:
    """The child process of `measure_backend`: `generate` on this process's
    backend for the plan (JSON, the first argument); prints its rows."""
    import time

    from keras_selfattn import generate

    plan = json.loads(sys.argv[1])
    new, rows = plan["new_tokens"], []
    for fields in plan["sizes"]:
        size = Size(**fields)
        model = build_model(size)
        for batch in plan["batches"]:
            batch_prompts = prompts(size, batch, plan["prompt"])
            generate(model, batch_prompts, new)  # compiles
            times = []
            for _ in range(plan["rounds"]):
                start = time.perf_counter()
                generate(model, batch_prompts, new)
                times.append(time.perf_counter() - start)
            seconds = float(np.median(times))
            rows.append(
                {
                    "model": size.name,
                    "batch": batch,
                    "candidate": "generate",
                    "tokens_per_s": batch * new / seconds,
                    "seconds": seconds,
                }
            )
    print("ROWS " + json.dumps(rows))


def _in_child(function: str, plan: dict, backend: str, candidate: str) -> list[dict]:
    """This module's `function` run in a child process on `backend` with
    `plan`; the rows it printed, with the backend, or one row for
    `candidate` saying why there are none."""
    env = {**os.environ, "KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "3"}
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            f"from benchmarks.generation import {function}; {function}()",
            json.dumps(plan),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("ROWS ")]
    if done.returncode != 0 or not lines:
        why = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return [{"backend": backend, "candidate": candidate, "status": why}]
    return [{**row, "backend": backend} for row in json.loads(lines[-1][5:])]


def measure_backend(backend: str, plan: dict, sizes, rounds: int) -> list[dict]:
    """`generate` on another backend, in a child process; its rows."""
    child_plan = {
        **plan,
        "rounds": rounds,
        "sizes": [dataclasses.asdict(size) for size in sizes],
    }
    return _in_child(generate_child.__name__, child_plan, backend, "generate")


def run(quick: bool = False, rounds: int | None = None) -> dict:
    sizes = QUICK_SIZES if quick else SIZES
    plan = {
        "prompt": 4 if quick else PROMPT,
        "new_tokens": 6 if quick else NEW_TOKENS,
        "batches": [2] if quick else list(BATCHES),
        "check": not quick,
    }
    rounds = rounds or (1 if quick else 3)
    start = datetime.datetime.now()
    rows = []
    for size in sizes:
        rows += measure_size(size, plan, rounds)
    for backend in ("jax", "torch"):
        rows += measure_backend(backend, plan, sizes, rounds)
    return {
        "machine": machine.describe(),
        "mode": "quick" if quick else "full",
        "plan": {**plan, "rounds": rounds, "sizes": [s.name for s in sizes]},
        "rows": rows,
        "targets": targets(rows),
        "seconds": (datetime.datetime.now() - start).total_seconds(),
    }


def targets(rows: list[dict]) -> list[dict]:
    """The SavedModel generators (without and with XLA) against the step
    driven from Python, with each thread configuration."""
    return [
        {
            "target": (
                f"{row['candidate']} >= {GENERATOR_SPEEDUP}x the step driven "
                f"token by token ({row['model']}, batch {row['batch']}; "
                f"TensorFlow threads: {row['threads']})"
            ),
            "value": row["vs_saved_model_step"],
            "met": row["vs_saved_model_step"] >= GENERATOR_SPEEDUP,
        }
        for row in rows
        # A child that failed left a row with its status and no ratio.
        if row.get("candidate", "").startswith("saved_model_generator")
        and "vs_saved_model_step" in row
    ]


COLUMNS = [
    ("model", "model"),
    ("batch", "batch"),
    ("backend", "backend"),
    ("threads", "TensorFlow threads"),
    ("candidate", "candidate"),
    (lambda r: f"{r['tokens_per_s']:.0f}" if "tokens_per_s" in r else "", "tokens/s"),
    (
        lambda r: (
            f"{r['vs_saved_model_step']:.2f}x" if "vs_saved_model_step" in r else ""
        ),
        "speedup vs the step driven per token",
    ),
    (lambda r: {True: "yes", False: "NO"}.get(r.get("same_tokens"), ""), "same tokens"),
    ("status", "note"),
]


def to_markdown(results: dict) -> str:
    m, plan = results["machine"], results["plan"]
    vnni = "yes" if m.get("vnni") else "no"
    lines = [
        "# Generation: tokens per second",
        "",
        f"- Machine: {m['cpu']}, VNNI: {vnni}, {m['cores']} cores, "
        f"{m['memory_gib']} GiB (load average {m['load_average_1_5_15min']}), "
        f"{m['os']}",
        f"- Date: {m['date_utc']}, commit {m['git_commit']}; mode: "
        f"{results['mode']}; {plan['rounds']} rounds; total "
        f"{results['seconds']:.0f} s",
        f"- Greedy, prompts of {plan['prompt']} tokens, {plan['new_tokens']} new "
        "tokens. TensorFlow candidates interleaved in one process; JAX and "
        "PyTorch `generate` each in a child process of its own (medians of "
        "their rounds). Step candidates: the exported decoding step called "
        "once per token from Python, numpy in and out (caches included). "
        f"TensorFlow threads: its default pools, then (a child process) "
        f"{_threads(SERVING_THREADS)}.",
        "",
    ]
    lines += report.table(COLUMNS, results["rows"])
    lines += ["", "## Targets (reported, not asserted)", ""]
    for target in results["targets"]:
        verdict = "met" if target["met"] else "NOT met"
        lines.append(f"- {target['target']}: {target['value']:.2f}x ({verdict})")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    report.main(__doc__, run, to_markdown, "generation", _HELPS)
