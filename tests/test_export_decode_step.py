"""Decoding-step export: SavedModel and ONNX decode whole sequences like Keras.

The main test exports a two-layer causal language model, then decodes in a
fresh interpreter that loads the SavedModel with `tf.saved_model.load` and the
ONNX file with onnxruntime without importing keras_selfattn, against outputs
Keras computed here (cached step by step, and the full uncached forward).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest

import keras_selfattn_cli as cli
from keras_selfattn import SelfAttention
from keras_selfattn.export import decode_step as ds
from tests import model_zoo
from tests.decode_step_runtimes import PRELUDE

pytestmark = pytest.mark.tensorflow_only("decode-step export is a tf.function")

MAX_LENGTH = 10
VOCAB = 40


_FRESH = (
    PRELUDE
    + r"""
ref = arrays

errors = {}
for case in names["cases"]:
    sequence, prompt = ref[case + "/sequence"], int(ref[case + "/prompt"])
    for runtime, run in (("saved_model", saved_model), ("onnx", onnx)):
        caches = {c: np.zeros_like(ref[case + "/empty_" + c]) for c in names["caches"]}
        index, step, outputs, worst = 0, 0, [], 0.0
        while index < sequence.shape[1]:
            new = prompt if index == 0 else 1
            feed = {"tokens": sequence[:, index : index + new], **caches,
                    "cache_update_index": np.asarray(index, np.int32)}
            out = run(feed)
            want = ref[f"{case}/step{step}/logits"]
            worst = max(worst, float(np.abs(out["logits"] - want).max()))
            for c, u in zip(names["caches"], names["updated"]):
                want = ref[f"{case}/step{step}/{u}"]
                worst = max(worst, float(np.abs(out[u] - want).max()))
                caches[c] = out[u]
            outputs.append(out["logits"])
            index, step = index + new, step + 1
        full = float(np.abs(np.concatenate(outputs, 1) - ref[case + "/full"]).max())
        errors[f"{runtime} {case}"] = [worst, full, step]
assert "keras_selfattn" not in sys.modules
print(json.dumps(errors))
print(json.dumps(sorted(m for m in sys.modules if "keras" in m)), file=sys.stderr)
"""
)


@pytest.fixture(scope="module")
def cli_export(tmp_path_factory) -> dict:
    """The language model saved and exported once by the CLI (SavedModel, ONNX,
    LiteRT decode steps): {model, status, out, err, folder}."""
    folder = tmp_path_factory.mktemp("decode_step")
    model = model_zoo.decoder_language_model(VOCAB)
    model.save(folder / "lm.keras")
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = cli.main(
            [
                "export",
                str(folder / "lm.keras"),
                "--decode-step",
                "--max-length",
                str(MAX_LENGTH),
                "--saved-model",
                str(folder / "serving"),
                "--onnx",
                str(folder / "out" / "lm.onnx"),
                "--litert",
                str(folder / "out" / "lm.tflite"),
            ]
        )
    return dict(
        model=model,
        status=status,
        out=out.getvalue(),
        err=err.getvalue(),
        folder=folder,
    )


# A three-format CLI export and a fresh interpreter: 55 s on 2 shared AVX2 cores.
@pytest.mark.slow
def test_exports_decode_like_keras_in_a_fresh_process(cli_export, tmp_path):
    assert cli_export["status"] == 0, cli_export["err"]
    model, folder = cli_export["model"], cli_export["folder"]
    version_dir = str(folder / "serving" / "lm" / "1")
    onnx_path = str(folder / "out" / "lm.onnx")
    assert (folder / "serving" / "models.config").is_file()

    step = ds.build_decode_step(model, MAX_LENGTH)
    arrays = {}
    for case, (batch, prompt) in {"a": (2, 3), "b": (1, 1), "c": (3, 4)}.items():
        sequence = ds.teacher_inputs(step, batch, seed=10 + batch)
        results = ds.keras_decode(step, ds.schedule(step, sequence, prompt))
        arrays[case + "/sequence"] = sequence
        arrays[case + "/prompt"] = np.asarray(prompt)
        arrays[case + "/full"] = keras.ops.convert_to_numpy(model(sequence))
        for name, cache in step.empty_caches(batch).items():
            arrays[f"{case}/empty_{name}"] = cache
        for number, result in enumerate(results):
            for name, value in result.items():
                arrays[f"{case}/step{number}/{name}"] = value
    np.savez(tmp_path / "reference.npz", **arrays)
    names = {
        "cases": ["a", "b", "c"],
        "caches": list(step.cache_names),
        "updated": list(step.updated_cache_names),
    }
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            _FRESH,
            str(tmp_path / "reference.npz"),
            version_dir,
            onnx_path,
            json.dumps(names),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={"TF_CPP_MIN_LOG_LEVEL": "3", "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    errors = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(errors) == 6
    for key, (step_err, full_err, steps) in errors.items():
        assert step_err < 1e-5 and full_err < 1e-5, (key, step_err, full_err)
        assert steps == MAX_LENGTH - {"a": 3, "b": 1, "c": 4}[key[-1]] + 1


@pytest.mark.slow  # the same CLI export
def test_cli_exports_three_formats_and_refuses_in_one_line(
    cli_export, tmp_path, capsys
):
    assert cli_export["status"] == 0, cli_export["err"]
    folder = cli_export["folder"]
    assert (folder / "serving" / "lm" / "1" / "saved_model.pb").is_file()
    assert sorted(os.listdir(folder / "out")) == ["lm.onnx", "lm.tflite"]
    rows = [line.split() for line in cli_export["out"].splitlines() if "prompt" in line]
    runtimes = {row[0] for row in rows}
    assert runtimes == {"keras_cache", "saved_model", "onnx", "litert"}, cli_export
    assert len(rows) == 12 and all(row[-1] == "yes" for row in rows)
    path = str(folder / "lm.keras")

    plain = keras.Sequential(
        [
            keras.Input((None, 8), name="features"),
            SelfAttention(num_heads=2, key_dim=4, name="bidirectional"),
        ]
    )
    plain.save(tmp_path / "plain.keras")
    status = cli.main(
        [
            "export-decode-step",
            str(tmp_path / "plain.keras"),
            "--max-length",
            "4",
            "--onnx",
            str(tmp_path / "plain.onnx"),
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 1
    assert err[-1].startswith("keras-selfattn: error: Cannot export a decoding step")
    assert "causal=False" in err[-1]
    assert not (tmp_path / "plain.onnx").exists()
    assert cli.main(["export-decode-step", path, "--max-length", "4"]) == 1
    assert "export needs at least one of" in capsys.readouterr().err
    assert cli.main(["export", path, "--decode-step", "--onnx", "x.onnx"]) == 1
    assert "--decode-step needs --max-length" in capsys.readouterr().err


def test_sequential_float_model_decodes():
    model = keras.Sequential(
        [
            keras.Input((None, 6), name="features"),
            keras.layers.Dense(8),
            SelfAttention(num_heads=2, key_dim=4, causal=True, sliding_window=3),
            keras.layers.Dense(5, name="out"),
        ]
    )
    report = ds.verify_decode_step(model, max_length=7)
    assert len(report.rows) == 3 and report.ok


def _functional(*layers, inputs=None):
    if inputs is None:
        inputs = keras.Input((None, 8), name="features")
    x = inputs
    for layer in layers:
        x = layer(x)
    return keras.Model(inputs, x)


def test_unsupported_models_are_refused():
    causal = dict(num_heads=2, key_dim=4, causal=True)
    with pytest.raises(ValueError, match="no SelfAttention"):
        ds.build_decode_step(_functional(keras.layers.Dense(4)), 4)
    with pytest.raises(ValueError, match="causal=False"):
        ds.build_decode_step(_functional(SelfAttention(num_heads=2, key_dim=4)), 4)
    shared = SelfAttention(**causal)
    with pytest.raises(ValueError, match="called more than once"):
        ds.build_decode_step(_functional(shared, shared), 4)
    tokens = keras.Input((None,), dtype="int32", name="tokens")
    masked = _functional(
        keras.layers.Embedding(9, 8, mask_zero=True),
        SelfAttention(**causal),
        inputs=tokens,
    )
    with pytest.raises(ValueError, match="padding masks"):
        ds.build_decode_step(masked, 4)
    inner = _functional(SelfAttention(**causal))
    nested = ds.build_decode_step(_functional(keras.layers.Dense(8), inner), 4)
    assert nested.layers == tuple(  # nested layers decode now
        layer for layer in inner.layers if isinstance(layer, SelfAttention)
    )
    a, b = keras.Input((None, 8), name="a"), keras.Input((None, 8), name="b")
    two = keras.Model([a, b], SelfAttention(**causal)(keras.layers.Add()([a, b])))
    with pytest.raises(ValueError, match="2 inputs"):
        ds.build_decode_step(two, 4)
    with pytest.raises(ValueError, match="max_length"):
        ds.build_decode_step(_functional(SelfAttention(**causal)), 0)


def test_a_layer_mixing_positions_fails_the_keras_check():
    model = _functional(
        SelfAttention(num_heads=2, key_dim=4, causal=True),
        keras.layers.Conv1D(4, 3, padding="same", name="mixes"),
    )
    with pytest.raises(ValueError, match=r"'mixes' \(Conv1D\) mixes positions"):
        ds.verify_decode_step(model, max_length=6)


def test_formats_a_backend_cannot_export_are_refused_in_one_line(monkeypatch):
    monkeypatch.setattr(keras.backend, "backend", lambda: "jax")
    with pytest.raises(ValueError, match="KERAS_BACKEND=tensorflow") as info:
        ds.export_decode_step(
            _functional(SelfAttention(num_heads=2, key_dim=4, causal=True)),
            "unused.tflite",
            "litert",
            max_length=4,
        )
    assert "\n" not in str(info.value)
    assert "LiteRT export does not run on the jax backend" in str(info.value)
