"""Keras's own `model.export` of SelfAttention models, and their check in
fresh processes (run by tests/test_keras_export.py).

    KERAS_BACKEND=jax python tests/_keras_export_worker.py export OUT
    python tests/_keras_export_worker.py check onnxruntime OUT

`export` builds the models (seeded, tiny), saves their `predict`
outputs on the inputs, and tries every format Keras offers on the
backend; `OUT/<backend>/manifest.json` records each cell: the artifact, or
Keras's error when it refuses. `check` loads every artifact of one runtime's
format in this process, which never imports keras or keras_selfattn, runs it
on the saved inputs and writes `OUT/check_<runtime>.json`: the max abs error
of each case, and which of those modules were imported. `export-litert`
exports one torch -> LiteRT artifact in a fresh interpreter (see
`_export_in_child`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np

FORMATS = ("tf_saved_model", "onnx", "openvino", "litert", "torch")
SUFFIX = {
    "tf_saved_model": "",
    "onnx": ".onnx",
    "openvino": ".xml",
    "litert": ".tflite",
    "torch": ".pt2",
}
# The runtime that loads each format, and the format each runtime loads.
RUNTIMES = {
    "onnxruntime": "onnx",
    "openvino": "openvino",
    "litert": "litert",
    "torch": "torch",
    "tensorflow": "tf_saved_model",
}
# What `check` must not import.
BLOCKED = ("keras", "keras_selfattn")
VOCAB, FEATURES = 50, 16
# (batch, time) of the cases checked.
SHAPES = [(2, 7), (2, 33), (3, 16), (1, 5)]
# Keras's torch LiteRT export takes fixed shapes only: one artifact per shape.
LITERT_TORCH_SHAPES = [(2, 7), (2, 33)]


# --------------------------------------------------------------------- models
def _models(backend: str) -> dict:
    """name -> (builder, formats it is exported to).

    One model with every feature of the issue's two, and the issue's two
    models, to every format; on PyTorch the issue's two again with
    `flash_attention=False` (a path that once baked in the length)."""
    import keras

    from keras_selfattn import SelfAttention

    def classifier(flash=None):
        tokens = keras.Input(shape=(None,), dtype="int32", name="tokens")
        x = keras.layers.Embedding(VOCAB, FEATURES, mask_zero=True)(tokens)
        x = SelfAttention(
            num_heads=4, output_dim=32, use_bias=True, flash_attention=flash
        )(x)
        x = keras.layers.GlobalAveragePooling1D()(x)
        return keras.Model(tokens, keras.layers.Dense(3)(x))

    def rotary(flash=None):
        features = keras.Input(shape=(None, FEATURES), name="features")
        y = SelfAttention(
            num_heads=2,
            num_key_value_heads=1,
            rope_max_wavelength=10000,
            output_dim=FEATURES,
            causal=True,
            flash_attention=flash,
        )(features)
        return keras.Model(features, y)

    def combined():
        """Padding, grouped-query, rotary and causal, both paths."""
        tokens = keras.Input(shape=(None,), dtype="int32", name="tokens")
        x = keras.layers.Embedding(VOCAB, FEATURES, mask_zero=True)(tokens)
        x = SelfAttention(num_heads=4, output_dim=32, use_bias=True)(x)
        x = SelfAttention(
            num_heads=2,
            num_key_value_heads=1,
            rope_max_wavelength=10000,
            output_dim=FEATURES,
            causal=True,
            flash_attention=False,
        )(x)
        x = keras.layers.GlobalAveragePooling1D()(x)
        return keras.Model(tokens, keras.layers.Dense(3)(x))

    models = {
        "combined": (combined, FORMATS),
        "classifier": (classifier, FORMATS),
        "rotary": (rotary, FORMATS),
    }
    if backend == "torch":
        models.update(
            classifier_explicit=(lambda: classifier(False), FORMATS),
            rotary_explicit=(lambda: rotary(False), FORMATS),
        )
    return models


def _inputs(name: str, batch: int, time: int) -> np.ndarray:
    """Seeded inputs; token rows are padded at the end, at the start, or not
    at all (a length-1 sequence keeps its token)."""
    rng = np.random.default_rng(1000 * batch + time)
    if not name.startswith(("classifier", "combined")):
        return rng.standard_normal((batch, time, FEATURES)).astype("float32")
    tokens = rng.integers(1, VOCAB, size=(batch, time)).astype("int32")
    pad = min(3, time - 1)
    if batch > 0 and pad:
        tokens[0, time - pad :] = 0
    if batch > 1 and pad:
        tokens[1, : pad - 1 or 1] = 0
    return tokens


# --------------------------------------------------------------------- export
def _export_kwargs(fmt: str, backend: str, model, shape) -> dict:
    """What Keras's export of `fmt` needs beyond the defaults (which are
    dynamic batch and time)."""
    import keras

    if fmt == "torch" and backend == "torch":
        import torch

        dims = {0: torch.export.Dim("batch", min=1), 1: torch.export.Dim("time")}
        return {"dynamic_shapes": dims}
    if fmt == "litert" and backend == "torch":
        spec = model.inputs[0]
        fixed = shape + tuple(spec.shape[2:])
        return {"input_signature": [keras.InputSpec(shape=fixed, dtype=spec.dtype)]}
    return {}


def _export_targets(backend: str, formats):
    """(format, fixed shape or None) for each artifact of one model."""
    for fmt in formats:
        if fmt == "litert" and backend == "torch":
            for shape in LITERT_TORCH_SHAPES:
                yield fmt, shape
        else:
            yield fmt, None


def _export_one(model, backend: str, fmt: str, shape, path: Path) -> dict:
    """Keras's `model.export` of one artifact: its status, and Keras's error
    when it refuses."""
    cell = {}
    start = time.perf_counter()
    try:
        kwargs = _export_kwargs(fmt, backend, model, shape)
        model.export(str(path), format=fmt, verbose=False, **kwargs)
        cell["status"] = "exported"
    except Exception as error:  # Keras's refusal, recorded as is.
        cell["status"] = "refused"
        cell["error"] = f"{type(error).__name__}: {error}"
        cell["traceback"] = traceback.format_exc(limit=-8)
    cell["seconds"] = round(time.perf_counter() - start, 1)
    return cell


def _export_in_child(out: Path, name: str, shape, path: Path) -> dict:
    """`_export_one` of a torch -> LiteRT artifact in a fresh interpreter:
    after one conversion, litert_torch fails the next conversion of a model
    with int32 inputs in the same process (an int32/int64 operand mismatch;
    Keras 3.15.1, litert-torch 0.10)."""
    result = out / f"{path.name}.json"
    argv = [sys.executable, __file__, "export-litert", str(out), name]
    subprocess.run(argv + [f"{shape[0]}x{shape[1]}"], check=True)
    return json.loads(result.read_text())


def _build(name: str, build, root: Path):
    """The model, with the weights the parent process saved for `name`."""
    import keras

    keras.utils.set_random_seed(0)
    model = build()
    weights = root / f"{name}.weights.h5"
    if weights.exists():
        model.load_weights(weights)
    else:
        model.save_weights(weights)
    return model


def export_litert(out: Path, name: str, shape: str) -> None:
    """The child of `_export_in_child`."""
    backend = "torch"
    build, _ = _models(backend)[name]
    model = _build(name, build, out / backend)
    fixed = tuple(int(size) for size in shape.split("x"))
    model(_inputs(name, *fixed))
    path = out / backend / f"{name}_litert_{shape}.tflite"
    cell = _export_one(model, backend, "litert", fixed, path)
    (out / f"{path.name}.json").write_text(json.dumps(cell))


def export(out: Path) -> None:
    import keras

    backend = keras.backend.backend()
    root = out / backend
    root.mkdir(parents=True, exist_ok=True)
    cells = []
    converted_litert = False
    for name, (build, formats) in _models(backend).items():
        model = _build(name, build, root)
        cases = {}
        for batch, length in SHAPES:
            x = _inputs(name, batch, length)
            cases[f"in_{batch}x{length}"] = x
            cases[f"ref_{batch}x{length}"] = model.predict(x, verbose=0)
        model(cases[next(iter(cases))])  # Keras exports only called models.
        np.savez(root / f"{name}.npz", **cases)
        for fmt, shape in _export_targets(backend, formats):
            label = fmt if shape is None else f"{fmt}_{shape[0]}x{shape[1]}"
            path = root / f"{name}_{label}{SUFFIX[fmt]}"
            cell = {
                "backend": backend,
                "format": fmt,
                "model": name,
                "path": str(path),
                "fixed_shape": shape,
                "cases": str(root / f"{name}.npz"),
            }
            int_inputs = "int" in str(model.inputs[0].dtype)
            if (
                backend == "torch"
                and fmt == "litert"
                and converted_litert
                and int_inputs
            ):
                cell.update(_export_in_child(out, name, shape, path))
            else:
                cell.update(_export_one(model, backend, fmt, shape, path))
            converted_litert |= backend == "torch" and fmt == "litert"
            cells.append(cell)
            print(f"{backend} {name} {label}: {cell['status']} {cell['seconds']} s")
    (root / "manifest.json").write_text(json.dumps(cells, indent=1))


# ---------------------------------------------------------------------- check
def _runner(fmt: str, path: str):
    """A function numpy input -> numpy output, loaded by fmt's own runtime."""
    if fmt == "onnx":
        import onnxruntime

        session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
        name = session.get_inputs()[0].name
        return lambda x: session.run(None, {name: x})[0]
    if fmt == "openvino":
        import openvino

        core = openvino.Core()
        # f32: on a CPU with AVX512-BF16 OpenVINO would otherwise run bf16.
        compiled = core.compile_model(
            core.read_model(path), "CPU", {"INFERENCE_PRECISION_HINT": "f32"}
        )
        return lambda x: compiled([x])[compiled.outputs[0]]
    if fmt == "litert":
        from ai_edge_litert.interpreter import Interpreter

        interpreter = Interpreter(model_path=path)

        def run(x):
            index = interpreter.get_input_details()[0]["index"]
            interpreter.resize_tensor_input(index, x.shape, strict=True)
            interpreter.allocate_tensors()
            interpreter.set_tensor(index, x)
            interpreter.invoke()
            output = interpreter.get_output_details()[0]["index"]
            return interpreter.get_tensor(output)

        return run
    if fmt == "torch":
        import torch

        module = torch.export.load(path).module()
        return lambda x: module(torch.from_numpy(x)).detach().numpy()
    if fmt == "tf_saved_model":
        import tensorflow as tf

        loaded = tf.saved_model.load(path)  # kept alive: it owns the weights
        return lambda x: loaded.serve(tf.constant(x)).numpy()
    raise ValueError(f"Unknown format: {fmt!r}")


def check(runtime: str, out: Path) -> None:
    fmt = RUNTIMES[runtime]
    results = []
    for manifest in sorted(out.glob("*/manifest.json")):
        for cell in json.loads(manifest.read_text()):
            if cell["format"] != fmt or cell["status"] != "exported":
                continue
            result = {key: cell[key] for key in ("backend", "format", "model")}
            result.update(fixed_shape=cell["fixed_shape"], errors={})
            try:
                run = _runner(fmt, cell["path"])
                cases = np.load(cell["cases"])
                for key in cases.files:
                    if not key.startswith("in_"):
                        continue
                    x, shape = cases[key], key[3:]
                    fixed = cell["fixed_shape"]
                    if fixed is not None and list(x.shape[:2]) != list(fixed):
                        continue
                    y = np.asarray(run(x))
                    reference = cases[f"ref_{shape}"]
                    if y.shape != reference.shape:
                        result["errors"][shape] = (
                            f"shape {y.shape} != {reference.shape}"
                        )
                    else:
                        result["errors"][shape] = float(np.max(np.abs(y - reference)))
            except Exception as error:
                result["failure"] = f"{type(error).__name__}: {error}"[:2000]
            results.append(result)
    report = {
        "runtime": runtime,
        "results": results,
        "imported": sorted(
            name
            for name, module in sys.modules.items()
            if module is not None and name.split(".")[0] in BLOCKED
        ),
    }
    (out / f"check_{runtime}.json").write_text(json.dumps(report, indent=1))


def main(argv: list[str]) -> None:
    if argv[0] == "export":
        export(Path(argv[1]))
    elif argv[0] == "export-litert":
        export_litert(Path(argv[1]), *argv[2:])
    elif argv[0] == "check":
        # Neither can be imported here (`import tensorflow` imports keras
        # when it can): the artifacts must stand on their own.
        for name in BLOCKED:
            sys.modules[name] = None
        check(argv[1], Path(argv[2]))
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    main(sys.argv[1:])
