"""`python -m benchmarks.score_mods`: what score modifications cost.

Three measurements, each in a fresh process per Keras backend (TensorFlow,
JAX, PyTorch; a backend that is not installed is skipped):

- forward: one SelfAttention call (compiled: `tf.function`, `jax.jit`;
  eager on PyTorch, both as called, gradients recorded, and in
  `torch.no_grad()`, as `predict` calls it) at B8·T512, D=256, 4 heads,
  unmodified against ALiBi, T5's relative bias, sinks and a soft-cap,
  interleaved; ratio = modified time / unmodified time, with gradients
  recorded or not alike (1.3 is the target for the position biases);
- memory: the peak resident memory of one chunked forward at T=16384
  (chunk 512), unmodified against ALiBi and T5's relative bias, each in a
  process of its own (on JAX the temporaries of its compiled program);
  ratio = modified / unmodified peak growth;
- packing: a training step (`train_on_batch`) and a prediction
  (`predict_on_batch`) of a SelfAttention + MLP block (D=256, 4 heads,
  the layer's defaults, `compile`'s defaults) on 64 sequences of lengths
  drawn uniformly from 16 to 512, padded to 512 (a Keras mask) against
  packed into rows of 2048 with `segment_ids`, the four interleaved;
  speedup = padded time / packed time (1.5 is the target), each with the
  path the layer takes.

Usage:
    python -m benchmarks.score_mods [--quick] [--out DIR] [--backends ...]
        [--sections forward memory packing]

`--quick` uses tiny sizes (seconds; its numbers mean nothing). Results go to
DIR/score_mods.json and DIR/score_mods.md (default DIR: benchmarks/results);
with some `--sections` only, to DIR/score_mods_SECTION[_SECTION].json and
.md. PyTorch runs with its default threads: set `OMP_NUM_THREADS=1` for one.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
BACKENDS = ("tensorflow", "jax", "torch")
SECTIONS = ("forward", "memory", "packing")
MODS = {
    "alibi": {"position_bias": "alibi"},
    "relative": {"position_bias": "relative"},
    "sinks": {"use_sinks": True},
    "soft_cap": {"logit_soft_cap": 30.0},
}


def _sizes(quick: bool) -> dict:
    if quick:
        return {
            "batch": 2,
            "time": 32,
            "features": 16,
            "rounds": 2,
            "long_time": 256,
            "chunk": 64,
            "sequences": 6,
            "longest": 32,
            "row": 256,
            "block": 32,
        }
    return {
        "batch": 8,
        "time": 512,
        "features": 256,
        "rounds": 9,
        "long_time": 16384,
        "chunk": 512,
        "sequences": 64,
        "longest": 512,
        "row": 2048,
        "block": 256,
    }


def _compiled(fn):
    import keras

    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        return tf.function(fn, jit_compile=False)
    if backend == "jax":
        import jax

        return jax.jit(fn)
    return fn


def _forward_rows(sizes: dict) -> list[dict]:
    import keras
    import numpy as np

    from benchmarks.timing import interleave
    from keras_selfattn import SelfAttention

    x = (
        np.random.default_rng(0)
        .normal(size=(sizes["batch"], sizes["time"], sizes["features"]))
        .astype("float32")
    )
    x = keras.ops.convert_to_tensor(x)
    torch = keras.backend.backend() == "torch"
    candidates = {}
    for name, arguments in {"unmodified": {}, **MODS}.items():
        layer = SelfAttention(num_heads=4, **arguments)
        layer(x[:, :2])
        fn = _compiled(lambda x, layer=layer: layer(x))
        candidates[name] = lambda fn=fn: keras.ops.convert_to_numpy(fn(x))
        if torch:  # as `predict` calls it: no gradient recorded
            candidates[f"{name}, no_grad"] = lambda fn=fn: _no_grad(fn, x)
    timed = interleave(candidates, rounds=sizes["rounds"])
    rows = []
    for name in candidates:
        modification, _, no_grad = name.partition(", ")
        base = timed.median("unmodified" + (", no_grad" if no_grad else ""))
        layer = SelfAttention(num_heads=4, **MODS.get(modification, {}))
        rows.append(
            {
                "modification": modification,
                # Eager PyTorch records gradients unless told not to; the
                # compiled calls of TensorFlow and JAX record none.
                "gradients": "recorded" if torch and not no_grad else "not recorded",
                "path": layer.implementation(x),
                "ms": round(timed.median(name) * 1e3, 3),
                "ratio_to_unmodified": round(timed.median(name) / base, 3),
            }
        )
    return rows


def _no_grad(fn, x):
    import keras
    import torch

    with torch.no_grad():
        return keras.ops.convert_to_numpy(fn(x))


def _peak_child(modification: str, sizes: dict) -> float:
    """MiB of peak memory one chunked forward adds, in a child: the growth
    of the peak resident memory, or on JAX the temporaries XLA's compiled
    program needs (its memory analysis): an eager JAX call's resident peak
    includes compiling the long shape, which moved by 30 % between runs of
    the same code."""
    code = f"""
import resource, numpy as np, keras
from keras_selfattn import SelfAttention
layer = SelfAttention(num_heads=4, chunk_size={sizes["chunk"]}, causal=True,
                      **{MODS.get(modification, {})!r})
small = np.zeros((1, 8, {sizes["features"]}), "float32")
keras.ops.convert_to_numpy(layer(small))
x = np.random.default_rng(0).normal(size=(1, {sizes["long_time"]},
    {sizes["features"]})).astype("float32")
if keras.backend.backend() == "jax":
    import jax
    compiled = jax.jit(lambda x: layer(x)).lower(x).compile()
    print(compiled.memory_analysis().temp_size_in_bytes / 2**20)
else:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    keras.ops.convert_to_numpy(layer(x))
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print((after - before) / 1024)
"""
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    return float(done.stdout.strip().splitlines()[-1])


def _memory_rows(sizes: dict) -> list[dict]:
    peaks = {
        name: _peak_child(name, sizes) for name in ("unmodified", "alibi", "relative")
    }
    return [
        {
            "modification": name,
            "time": sizes["long_time"],
            "peak_growth_mib": round(peak, 1),
            "ratio_to_unmodified": round(peak / max(peaks["unmodified"], 1e-9), 3),
        }
        for name, peak in peaks.items()
    ]


def _packed(lengths, row: int):
    """Greedy first-fit packing: (rows, segment ids), ids from 1, 0 = empty."""
    rows: list[list[int]] = []
    for index, length in enumerate(lengths):
        for members in rows:
            if sum(lengths[i] for i in members) + length <= row:
                members.append(index)
                break
        else:
            rows.append([index])
    return rows


def _packing_rows(sizes: dict) -> list[dict]:
    import keras
    import numpy as np

    from benchmarks.timing import interleave
    from keras_selfattn import SelfAttention

    rng = np.random.default_rng(0)
    features, longest = sizes["features"], sizes["longest"]
    lengths = rng.integers(16 if longest >= 32 else 2, longest + 1, sizes["sequences"])
    tokens = [rng.normal(size=(n, features)).astype("float32") for n in lengths]
    padded = np.zeros((len(lengths), longest, features), "float32")
    padding = np.zeros((len(lengths), longest), bool)
    for i, sequence in enumerate(tokens):
        padded[i, : len(sequence)] = sequence
        padding[i, : len(sequence)] = True
    rows = _packed(list(lengths), sizes["row"])
    packed = np.zeros((len(rows), sizes["row"], features), "float32")
    segments = np.zeros((len(rows), sizes["row"]), "int32")
    real = np.zeros((len(rows), sizes["row"]), bool)
    for r, members in enumerate(rows):
        start = 0
        for segment, index in enumerate(members, start=1):
            n = lengths[index]
            packed[r, start : start + n] = tokens[index]
            segments[r, start : start + n] = segment
            real[r, start : start + n] = True
            start += n

    def block(packed=False):
        """The padded model (a Keras mask) or the packed one (`segment_ids`),
        its SelfAttention with the layer's defaults; and that layer."""
        keras.utils.set_random_seed(0)
        x = keras.Input((None, features))
        mask = keras.Input((None,), dtype="bool")
        inputs = [x, mask]
        attention = SelfAttention(num_heads=4)
        if packed:
            segment_ids = keras.Input((None,), dtype="int32")
            inputs.append(segment_ids)
            y = x + attention(x, mask=mask, segment_ids=segment_ids)
        else:
            y = x + attention(x, mask=mask)
        h = keras.layers.Dense(4 * features, activation="gelu")(y)
        y = y + keras.layers.Dense(features)(h)
        model = keras.Model(inputs, y)
        model.compile("adam", "mse")
        return model, attention

    batches = {
        "padded": ([padded, padding], {"mask": padding}),
        "packed": ([packed, real, segments], {"mask": real, "segment_ids": segments}),
    }
    models = {layout: block(packed=layout == "packed") for layout in batches}
    candidates = {}
    for layout, (inputs, _) in batches.items():
        model = models[layout][0]
        candidates[f"training, {layout}"] = lambda m=model, i=inputs: m.train_on_batch(
            i, i[0]
        )
        candidates[f"prediction, {layout}"] = lambda m=model, i=inputs: (
            m.predict_on_batch(i)
        )
    timed = interleave(candidates, rounds=max(3, sizes["rounds"] // 2 + 1))
    rows = []
    for step in ("training", "prediction"):
        paths = {
            layout: models[layout][1].implementation(
                inputs[0], training=step == "training", **call
            )
            for layout, (inputs, call) in batches.items()
        }
        rows.append(
            {
                "step": step,
                "sequences": len(lengths),
                "padded_shape": list(padded.shape[:2]),
                "packed_shape": list(packed.shape[:2]),
                "padded_path": paths["padded"],
                "packed_path": paths["packed"],
                "padded_ms": round(timed.median(f"{step}, padded") * 1e3, 1),
                "packed_ms": round(timed.median(f"{step}, packed") * 1e3, 1),
                "speedup": round(
                    timed.speedup(f"{step}, padded", f"{step}, packed"), 3
                ),
                "threads": _threads(),
            }
        )
    return rows


def _threads() -> str:
    """PyTorch's intra-op threads; "default" on the other backends."""
    import keras

    if keras.backend.backend() != "torch":
        return "default"
    import torch

    return str(torch.get_num_threads())


def _child(quick: bool, sections) -> dict:
    import keras

    from benchmarks import machine

    sizes = _sizes(quick)
    measure = {
        "forward": _forward_rows,
        "memory": _memory_rows,
        "packing": _packing_rows,
    }
    return {
        "backend": keras.backend.backend(),
        "machine": machine.describe(),
        **{section: measure[section](sizes) for section in sections},
    }


def _markdown(results: list[dict]) -> str:
    lines = ["# Score modifications", ""]
    for result in results:
        cpu = result["machine"].get("cpu", "unknown CPU")
        lines += [f"## {result['backend']} ({cpu})", ""]
        for section in (name for name in SECTIONS if name in result):
            rows = result[section]
            keys = list(rows[0])
            lines += [
                f"### {section}",
                "",
                "| " + " | ".join(keys) + " |",
                "|" + "---|" * len(keys),
            ]
            lines += ["| " + " | ".join(str(r[k]) for k in keys) + " |" for r in rows]
            lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--backends", nargs="+", default=list(BACKENDS))
    parser.add_argument(
        "--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS)
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sections = [name for name in SECTIONS if name in args.sections]
    if args.child:
        print(json.dumps(_child(args.quick, sections)))
        return []
    results = []
    for backend in args.backends:
        command = [sys.executable, "-m", "benchmarks.score_mods", "--child"]
        command += ["--sections", *sections]
        done = subprocess.run(
            command + (["--quick"] if args.quick else []),
            capture_output=True,
            text=True,
            env={**os.environ, "KERAS_BACKEND": backend},
        )
        if done.returncode:
            print(f"{backend}: failed\n{done.stderr[-2000:]}", file=sys.stderr)
            continue
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    args.out.mkdir(parents=True, exist_ok=True)
    # Some sections only: files of their own, beside the whole run's.
    name = "_".join(["score_mods", *(sections if sections != list(SECTIONS) else [])])
    (args.out / f"{name}.json").write_text(json.dumps(results, indent=1) + "\n")
    text = _markdown(results)
    (args.out / f"{name}.md").write_text(text + "\n")
    print(text)
    return results


if __name__ == "__main__":
    main()
