"""One model, any backend, any export: train on JAX or PyTorch, export under TensorFlow.

The model classifies padded token sequences: `Embedding(mask_zero=True)`
(token 0 is padding, so a padding mask flows into the attention), then
`SelfAttention` (2 heads, biases, output projection), a masked mean and a
softmax. It runs in two stages, each in its own process because Keras picks
its backend once per process, from `KERAS_BACKEND`:

1. `--stage train` (under `KERAS_BACKEND=jax` or `torch`): trains the model
   for a few steps on generated sequences, saves `cross_backend_BACKEND.keras`
   and `cross_backend_BACKEND.npz` (padded check inputs, the predictions and
   the attention layer's outputs on them, and every weight by its path).
2. `--stage export` (under `KERAS_BACKEND=tensorflow`): loads the `.keras`
   file with nothing but `import keras_selfattn` (no `custom_objects`),
   checks that the weights are bit-identical to the trained ones and that
   the predictions and attention outputs agree within 1e-5 (padded positions
   exactly 0 on both backends), exports a SavedModel in TF Serving's layout
   (`serving/cross_backend_BACKEND/N/`, a new version per run) and an ONNX
   file, runs `keras_selfattn.export.verify`, and checks that both exports
   reproduce the trained backend's predictions within 1e-5.

Without `--stage` the script is a driver: it runs both stages as
subprocesses, with `KERAS_BACKEND` set per process, and prints each step.

Run: `.venv/bin/python examples/cross_backend.py [--train-backend jax|torch]
[--fast] [--out DIR]`, or one stage:
`KERAS_BACKEND=torch .venv/bin/python examples/cross_backend.py --stage train
--train-backend torch` then `KERAS_BACKEND=tensorflow .venv/bin/python
examples/cross_backend.py --stage export --train-backend torch`.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import _common
import numpy as np

# keras is imported inside the stages, never here: the driver must not start a
# backend of its own, and each stage first checks which backend it got.
if TYPE_CHECKING:
    import keras

SEED = 0
VOCAB = 24  # token 0 is padding; real tokens are 1..VOCAB-1
MAX_LEN = 10
WIDTH = 16
HEADS = 2
ATOL = 1e-5
BACKENDS = ("jax", "torch", "tensorflow")
# (sequences, epochs) of training, normal and with --fast.
TRAINING = {False: (2048, 4), True: (256, 1)}


# ------------------------------------------------------------ command line
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parses the stage, the training backend, `--fast` and `--out DIR`.

    Args:
        argv: Arguments to parse; None means `sys.argv[1:]`.

    Returns:
        The namespace, with `out` an absolute `Path` that exists.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--stage",
        choices=("all", "train", "export"),
        default="all",
        help="'train' runs under this process's KERAS_BACKEND, 'export' under "
        "tensorflow; 'all' (default) runs both as subprocesses",
    )
    parser.add_argument(
        "--train-backend",
        choices=BACKENDS,
        default="jax",
        help="backend that trains the model (default: jax); the train stage "
        "refuses to run under any other, the export stage reads its files",
    )
    parser.add_argument(
        "--fast",
        action="store_true",
        help=f"train on {TRAINING[True][0]} sequences for {TRAINING[True][1]} "
        "epoch (for tests)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=_common.DEFAULT_OUT,
        help=f"folder for the files this example writes (default: "
        f"{_common.DEFAULT_OUT})",
    )
    args = parser.parse_args(argv)
    if args.out.exists() and not args.out.is_dir():
        parser.error(f"--out must be a folder. Received: --out={args.out}")
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    return args


def file_stem(train_backend: str) -> str:
    """Stem of every file of a run trained under `train_backend`."""
    return f"cross_backend_{train_backend}"


def section(title: str) -> None:
    """Prints a section header (flushed, so it precedes a subprocess's output)."""
    print(f"\n=== {title}", flush=True)


def require_backend(wanted: str, why: str) -> None:
    """Exits with an error unless this process's Keras backend is `wanted`."""
    import keras

    running = keras.backend.backend()
    if running != wanted:
        sys.exit(
            f"cross_backend: error: {why} needs KERAS_BACKEND={wanted}, but this "
            f"process runs Keras on '{running}' (KERAS_BACKEND="
            f"{os.environ.get('KERAS_BACKEND', '<unset>')})"
        )


# ------------------------------------------------------------ data, model
def make_data(count: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Padded (count, MAX_LEN) int32 sequences of lengths 1..MAX_LEN, labels.

    The label is 1 when the sequence holds more tokens from the upper half
    of the vocabulary than from the lower half.
    """
    lengths = rng.integers(1, MAX_LEN + 1, size=count)
    real = np.arange(MAX_LEN)[None, :] < lengths[:, None]
    tokens = np.where(real, rng.integers(1, VOCAB, size=(count, MAX_LEN)), 0)
    upper = ((tokens >= VOCAB // 2) & real).sum(axis=1)
    labels = (2 * upper > lengths).astype("int32")
    return tokens.astype("int32"), labels


def check_tokens() -> np.ndarray:
    """(MAX_LEN, MAX_LEN) int32: row i is a sequence of length i + 1, padded."""
    rng = np.random.default_rng(SEED + 1)
    tokens = rng.integers(1, VOCAB, size=(MAX_LEN, MAX_LEN)).astype("int32")
    return np.where(np.tri(MAX_LEN, dtype=bool), tokens, 0)


def build_model() -> keras.Model:
    """The compiled classifier; its SelfAttention layer is named "attention"."""
    import keras

    from keras_selfattn import SelfAttention

    tokens = keras.Input((None,), dtype="int32", name="tokens")
    h = keras.layers.Embedding(VOCAB, WIDTH, mask_zero=True, name="embed")(tokens)
    h = SelfAttention(
        num_heads=HEADS, output_dim=WIDTH, use_bias=True, name="attention"
    )(h)
    h = keras.layers.GlobalAveragePooling1D(name="mean_over_real")(h)
    label = keras.layers.Dense(2, activation="softmax", name="label")(h)
    model = keras.Model(tokens, label, name="cross_backend")
    model.compile(
        keras.optimizers.Adam(1e-2),
        "sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    return model


def attention_probe(model: keras.Model) -> keras.Model:
    """Maps the model's input to its attention layer's (masked) output."""
    import keras

    return keras.Model(model.input, model.get_layer("attention").output)


def max_abs_diff(expected: np.ndarray, got: np.ndarray) -> float:
    """max |expected - got|, or inf when the shapes differ."""
    expected, got = np.asarray(expected), np.asarray(got)
    if expected.shape != got.shape:
        return float("inf")
    return float(np.max(np.abs(expected.astype("float64") - got), initial=0.0))


def check_close(what: str, expected: np.ndarray, got: np.ndarray) -> None:
    """Prints max |expected - got| for `what`; exits beyond ATOL."""
    diff = max_abs_diff(expected, got)
    print(f"  {what}: max abs diff {diff:.2e} (tolerance {ATOL:g})")
    if not diff <= ATOL:
        sys.exit(f"cross_backend: error: {what} differ by {diff:.3g} > {ATOL:g}")


def padded_max(outputs: np.ndarray, tokens: np.ndarray) -> float:
    """Largest |output| at padded positions of a (batch, time, width) output."""
    return float(np.max(np.abs(outputs[tokens == 0]), initial=0.0))


# ------------------------------------------------------------ stage 1
def train(out: Path, train_backend: str, fast: bool) -> None:
    """Stage 1: trains under this process's backend; saves .keras and .npz."""
    require_backend(train_backend, "--stage train --train-backend " + train_backend)
    import keras

    section(f"stage 1: training under Keras {keras.__version__} on {train_backend}")
    keras.utils.set_random_seed(SEED)
    count, epochs = TRAINING[fast]
    x, y = make_data(count, np.random.default_rng(SEED))
    model = build_model()
    model.fit(x, y, epochs=epochs, batch_size=32, verbose=2)
    steps = epochs * -(-count // 32)
    print(f"trained {steps} steps on {count} padded sequences")

    tokens = check_tokens()
    predictions = model.predict(tokens, verbose=0)
    attention = attention_probe(model).predict(tokens, verbose=0)
    print(
        f"attention output at padded positions: max |.| = "
        f"{padded_max(attention, tokens):g} on {train_backend}"
    )
    stem = file_stem(train_backend)
    keras_path = _common.write_replacing(out / f"{stem}.keras", model.save)
    arrays = {
        "backend": np.array(keras.backend.backend()),
        "tokens": tokens,
        "predictions": predictions,
        "attention_output": attention,
        "weight_paths": np.array([w.path for w in model.weights]),
    }
    for i, weight in enumerate(model.weights):
        arrays[f"weight_{i}"] = keras.ops.convert_to_numpy(weight.value)
    npz_path = _common.write_replacing(
        out / f"{stem}.npz", lambda tmp: np.savez(tmp, **arrays)
    )
    print(f"Keras model: {keras_path}")
    print(f"inputs, predictions and {len(model.weights)} weights: {npz_path}")


# ------------------------------------------------------------ stage 2
def load_trained(
    out: Path, train_backend: str
) -> tuple[keras.Model, dict[str, np.ndarray]]:
    """The .keras model loaded under TensorFlow and stage 1's saved arrays."""
    import keras

    import keras_selfattn  # noqa: F401  (registers SelfAttention; nothing else)

    stem = file_stem(train_backend)
    paths = [out / f"{stem}.keras", out / f"{stem}.npz"]
    missing = [str(path) for path in paths if not path.is_file()]
    if missing:
        sys.exit(
            f"cross_backend: error: {missing} not found; run --stage train "
            f"--train-backend {train_backend} first"
        )
    model = keras.models.load_model(paths[0])
    with np.load(paths[1]) as saved:
        arrays = {key: saved[key] for key in saved.files}
    return model, arrays


def check_weights(model: keras.Model, saved: dict[str, np.ndarray]) -> None:
    """Exits unless the loaded weights are bit-identical to the trained ones."""
    import keras

    paths = [w.path for w in model.weights]
    if paths != saved["weight_paths"].tolist():
        sys.exit(
            f"cross_backend: error: weight paths differ: loaded {paths}, "
            f"trained {saved['weight_paths'].tolist()}"
        )
    for i, weight in enumerate(model.weights):
        loaded = keras.ops.convert_to_numpy(weight.value)
        if not np.array_equal(loaded, saved[f"weight_{i}"]):
            diff = max_abs_diff(saved[f"weight_{i}"], loaded)
            sys.exit(f"cross_backend: error: {weight.path} differs by {diff:.3g}")
    print(f"  {len(paths)} weights, bit-identical: {', '.join(paths)}")


def check_predictions(
    model: keras.Model, saved: dict[str, np.ndarray], trained_on: str
) -> None:
    """Exits unless TensorFlow reproduces stage 1's outputs within ATOL."""
    tokens = saved["tokens"]
    check_close(
        f"predictions, tensorflow vs {trained_on}",
        saved["predictions"],
        model.predict(tokens, verbose=0),
    )
    attention = attention_probe(model).predict(tokens, verbose=0)
    check_close(
        f"attention outputs, tensorflow vs {trained_on}",
        saved["attention_output"],
        attention,
    )
    padded = {
        trained_on: padded_max(saved["attention_output"], tokens),
        "tensorflow": padded_max(attention, tokens),
    }
    print(
        "  attention output at padded positions: "
        + ", ".join(f"max |.| = {value:g} on {name}" for name, value in padded.items())
    )
    if any(padded.values()):
        sys.exit("cross_backend: error: padded positions are not exactly 0")


def run_exports(
    version_dir: str, onnx_path: Path, tokens: np.ndarray
) -> dict[str, np.ndarray]:
    """{runtime: predictions} of the SavedModel signature and onnxruntime."""
    import keras_selfattn_runtimes as runtimes

    # TensorFlow as it is: no XLA switch flipped as TF Serving's would.
    signature = runtimes.load("saved_model", version_dir, tf_serving=False)
    (served,) = signature({"tokens": tokens}).values()
    (onnx_out,) = runtimes.load("onnx", str(onnx_path))({"tokens": tokens}).values()
    return {"saved_model": served, "onnx": onnx_out}


def export(out: Path, train_backend: str) -> None:
    """Stage 2: loads under TensorFlow, checks, exports, verifies."""
    require_backend("tensorflow", "--stage export")
    import keras

    from keras_selfattn.export import export_onnx, export_saved_model, verify

    section(f"stage 2: loading under Keras {keras.__version__} on tensorflow")
    model, saved = load_trained(out, train_backend)
    trained_on = str(saved["backend"])
    print(f"loaded {file_stem(train_backend)}.keras, trained on {trained_on}")
    check_weights(model, saved)
    check_predictions(model, saved, trained_on)

    section("stage 2: exporting")
    stem = file_stem(train_backend)
    version_dir = export_saved_model(model, out / "serving", stem)
    print(f"SavedModel: {version_dir}  (TF Serving layout)")
    # export_onnx never overwrites: the new file (checked in onnxruntime)
    # replaces the previous run's once complete.
    onnx_path = _common.write_replacing(
        out / f"{stem}.onnx", lambda tmp: export_onnx(model, tmp)
    )
    print(f"ONNX: {onnx_path}")

    section("stage 2: verify, each runtime against Keras on tensorflow")
    print(verify(model, saved_model_dir=version_dir, onnx_path=onnx_path).table())
    section(f"stage 2: each runtime against the predictions made on {trained_on}")
    for runtime, predictions in run_exports(
        version_dir, onnx_path, saved["tokens"]
    ).items():
        check_close(f"{runtime} vs {trained_on}", saved["predictions"], predictions)
    print(f"\ntrained on {trained_on}, exported and verified on tensorflow: ok")


# ------------------------------------------------------------ driver
def stage_command(stage: str, args: argparse.Namespace) -> list[str]:
    """The command line that runs one stage of this script."""
    command = [sys.executable, str(Path(__file__).resolve()), "--stage", stage]
    command += ["--train-backend", args.train_backend, "--out", str(args.out)]
    return command + (["--fast"] if args.fast else [])


def run_stage(step: str, backend: str, command: list[str]) -> None:
    """Runs `command` with KERAS_BACKEND=backend; exits if it fails."""
    section(f"{step}: KERAS_BACKEND={backend} {' '.join(command[1:])}")
    env = dict(os.environ, KERAS_BACKEND=backend)
    result = subprocess.run(command, env=env, check=False)
    if result.returncode != 0:
        sys.exit(f"cross_backend: error: {step} exited {result.returncode}")


def drive(args: argparse.Namespace) -> None:
    """Runs both stages as subprocesses, each with its own KERAS_BACKEND."""
    start = time.perf_counter()
    run_stage("step 1/2, train", args.train_backend, stage_command("train", args))
    run_stage("step 2/2, export", "tensorflow", stage_command("export", args))
    print(f"\ncross_backend finished in {time.perf_counter() - start:.0f} s")


def main(argv: Sequence[str] | None = None) -> None:
    """Runs the stage `--stage` names, or both through the driver."""
    args = parse_args(argv)
    if args.stage == "train":
        train(args.out, args.train_backend, args.fast)
    elif args.stage == "export":
        export(args.out, args.train_backend)
    else:
        drive(args)


if __name__ == "__main__":
    main()
