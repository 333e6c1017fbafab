"""The exported model: TF SavedModel signature vs onnxruntime, interleaved.

The model is `keras.Input((None, features), name="x")` -> SelfAttention, exported
with `keras_selfattn.export`, plain and fused ONNX (one ONNX Attention node
per layer). Every format's runtime on a whole model: `benchmarks.runtimes`.
"""

from __future__ import annotations

import os
import tempfile

import keras
import numpy as np

from benchmarks import cases
from benchmarks.runtimes import onnx_call, saved_model_call
from benchmarks.timing import interleave
from keras_selfattn.export import export_onnx, export_saved_model


def _model(shape: cases.Shape, config: cases.AttentionConfig) -> keras.Model:
    ours = cases.build_layers(shape, config)[0]
    inputs = keras.Input((None, shape.features), name="x")
    return keras.Model(inputs, ours(inputs), name="bench")


def _export_all(model: keras.Model, directory: str) -> dict:
    saved_model = export_saved_model(
        model, directory, "bench", 1, models_config=False, check=False
    )
    unfused = export_onnx(model, os.path.join(directory, "unfused.onnx"), check=False)
    fused = export_onnx(
        model, os.path.join(directory, "fused.onnx"), check=False, fuse_attention=True
    )
    return {
        "saved_model": saved_model_call(saved_model, "x"),
        "onnx": onnx_call(unfused),
        "onnx_fused": onnx_call(fused),
    }


def exported_rows(plan: cases.Plan) -> list[dict]:
    """One row per shape: speedups of onnxruntime over the SavedModel."""
    rows = []
    for shape in plan.export_shapes:
        x = cases.random_input(shape).numpy()
        with tempfile.TemporaryDirectory() as directory:
            calls = _export_all(_model(shape, plan.config), directory)
            outputs = {name: call(x) for name, call in calls.items()}
            result = interleave(
                {name: (lambda c=call, x=x: c(x)) for name, call in calls.items()},
                rounds=plan.rounds,
                min_round_s=plan.min_round_s,
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
            "rounds": plan.rounds,
        }
        row["fused_vs_onnx"] = result.speedup("onnx", "onnx_fused")
        row["fused_vs_saved_model"] = result.speedup("saved_model", "onnx_fused")
        row["ms_onnx_fused"] = 1e3 * result.median("onnx_fused")
        rows.append(row)
    return rows
