"""The exported model: TF SavedModel signature vs onnxruntime, interleaved.

The model is `keras.Input((None, features), name="x")` -> SelfAttention, exported
with `keras_selfattn.export`. When `export_onnx` has `fuse_attention`, the
fused ONNX export (one ONNX Attention node per layer) is timed too.
"""

from __future__ import annotations

import inspect
import os
import tempfile

import keras
import numpy as np
import onnxruntime
import tensorflow as tf

from benchmarks import cases
from benchmarks.timing import interleave
from keras_selfattn.export import export_onnx, export_saved_model

NOT_LANDED = "not available: feature not landed"


def fused_export_available() -> bool:
    """Whether `export_onnx` accepts `fuse_attention`."""
    return "fuse_attention" in inspect.signature(export_onnx).parameters


def _model(shape: cases.Shape, config: cases.AttentionConfig) -> keras.Model:
    ours = cases.build_layers(shape, config)[0]
    inputs = keras.Input((None, shape.features), name="x")
    return keras.Model(inputs, ours(inputs), name="bench")


def _saved_model_call(directory: str):
    signature = tf.saved_model.load(directory).signatures["serving_default"]

    def call(x: np.ndarray) -> np.ndarray:
        (output,) = signature(x=tf.constant(x)).values()
        return output.numpy()

    return call


def _onnx_call(path: str):
    session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name

    def call(x: np.ndarray) -> np.ndarray:
        return session.run(None, {name: x})[0]

    return call


def _export_all(model: keras.Model, directory: str) -> dict:
    calls = {
        "saved_model": _saved_model_call(
            export_saved_model(
                model, directory, "bench", 1, models_config=False, check=False
            )
        ),
        "onnx": _onnx_call(
            export_onnx(model, os.path.join(directory, "unfused.onnx"), check=False)
        ),
    }
    if fused_export_available():
        path = os.path.join(directory, "fused.onnx")
        calls["onnx_fused"] = _onnx_call(
            export_onnx(model, path, check=False, fuse_attention=True)
        )
    return calls


def exported_rows(
    shapes: list[cases.Shape],
    config: cases.AttentionConfig,
    rounds: int,
    min_round_s: float,
) -> list[dict]:
    """One row per shape: speedups of onnxruntime over the SavedModel."""
    rows = []
    for shape in shapes:
        x = cases.random_input(shape).numpy()
        with tempfile.TemporaryDirectory() as directory:
            calls = _export_all(_model(shape, config), directory)
            outputs = {name: call(x) for name, call in calls.items()}
            result = interleave(
                {name: (lambda c=call, x=x: c(x)) for name, call in calls.items()},
                rounds=rounds,
                min_round_s=min_round_s,
            )
        row = {
            "shape": shape.label,
            "onnx_vs_saved_model": result.speedup("saved_model", "onnx"),
            "ms_saved_model": 1e3 * result.median("saved_model"),
            "ms_onnx": 1e3 * result.median("onnx"),
            "max_abs_difference": max(
                float(np.max(np.abs(out - outputs["saved_model"])))
                for out in outputs.values()
            ),
            "rounds": rounds,
        }
        if "onnx_fused" in calls:
            row["fused_vs_onnx"] = result.speedup("onnx", "onnx_fused")
            row["fused_vs_saved_model"] = result.speedup("saved_model", "onnx_fused")
            row["ms_onnx_fused"] = 1e3 * result.median("onnx_fused")
        else:
            row["fused_vs_onnx"] = NOT_LANDED
            row["fused_vs_saved_model"] = NOT_LANDED
        rows.append(row)
    return rows
