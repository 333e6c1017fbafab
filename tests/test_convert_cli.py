"""`keras-selfattn convert MODEL.keras OUT.keras`: the console script converts
a saved MultiHeadAttention model, prints the summary, and writes a model
that computes what the original did; bad paths are one-line errors."""

from __future__ import annotations

import os
import subprocess
import sys

import keras
import numpy as np
import pytest

import keras_selfattn  # noqa: F401  (registers SelfAttention for load_model)
from keras_selfattn_cli import main

CONSOLE = os.path.join(os.path.dirname(sys.executable), "keras-selfattn")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _console_in_ci(test):
    """Marks a test that runs the console script in a fresh interpreter
    (15-20 s) slow, in the TensorFlow slow suite, which CI runs; `make
    test` calls `main` in this process."""
    one_suite = pytest.mark.one_suite(
        "runs the console script in its own interpreter", slow_suite="tensorflow"
    )
    return pytest.mark.slow(one_suite(test))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    x = keras.Input((None, 8))
    y = keras.layers.MultiHeadAttention(2, 4, name="mha")(x, x, use_causal_mask=True)
    model = keras.Model(x, keras.layers.Dense(3)(y))
    path = tmp_path_factory.mktemp("cli") / "model.keras"
    model.save(path)
    return model, path


@_console_in_ci
def test_convert_command_writes_an_equal_model(saved, tmp_path):
    model, path = saved
    out = tmp_path / "converted.keras"
    result = subprocess.run(
        [CONSOLE, "convert", str(path), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env={"PATH": "/usr/bin:/bin", "KERAS_BACKEND": "jax", "PYTHONPATH": REPO},
    )
    assert result.returncode == 0, result.stderr
    assert "converted 1 attention layer(s)" in result.stdout
    assert "mha (MultiHeadAttention) -> SelfAttention(" in result.stdout
    assert "causal=True" in result.stdout
    assert sorted(os.listdir(tmp_path)) == ["converted.keras"]  # no temporary
    loaded = keras.models.load_model(out)
    assert type(loaded.layers[1]).__name__ == "SelfAttention"
    x = np.random.default_rng(0).normal(size=(2, 5, 8)).astype("float32")
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(loaded(x)),
        keras.ops.convert_to_numpy(model(x)),
        atol=2e-5,
    )


@pytest.mark.parametrize(
    "target, fragment",
    [("exists.keras", "exists: convert never replaces"), ("out.h5", "end in .keras")],
)
def test_bad_output_is_a_one_line_error(saved, tmp_path, capsys, target, fragment):
    _, path = saved
    (tmp_path / "exists.keras").write_bytes(b"kept")
    status = main(["convert", str(path), str(tmp_path / target)])
    err = capsys.readouterr().err
    assert status == 1
    assert err.startswith("keras-selfattn: error: ") and fragment in err
    assert len(err.splitlines()) == 1
    assert (tmp_path / "exists.keras").read_bytes() == b"kept"


@pytest.mark.slow_on("jax", "JAX compiles every eager op of a new model")
def test_convert_command_reaches_keras_hub_layers(tmp_path, capsys):
    keras_hub = pytest.importorskip("keras_hub")
    tokens = keras.Input((None,), dtype="int32")
    x = keras_hub.layers.TokenAndPositionEmbedding(40, 16, 8, mask_zero=True)(tokens)
    x = keras_hub.layers.TransformerEncoder(32, 2)(x)
    model = keras.Model(tokens, keras.layers.Dense(3)(x))
    model.save(tmp_path / "hub.keras")
    status = main(["convert", str(tmp_path / "hub.keras"), str(tmp_path / "out.keras")])
    out = capsys.readouterr().out
    assert status == 0
    assert "inside TransformerEncoder) -> SelfAttention(" in out
    loaded = keras.models.load_model(tmp_path / "out.keras")
    ids = np.array([[3, 4, 5, 0], [7, 8, 9, 1]], "int32")
    real = ids != 0
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(loaded(ids))[real],
        keras.ops.convert_to_numpy(model(ids))[real],
        atol=2e-5,
    )


@_console_in_ci
def test_convert_command_loads_and_converts_a_keras_hub_llama(tmp_path):
    """A keras-hub file loads in a fresh interpreter: the command imports
    keras-hub for it (its classes register on import)."""
    keras_hub = pytest.importorskip("keras_hub")
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=40,
        hidden_dim=16,
        intermediate_dim=32,
        num_layers=1,
        num_query_heads=4,
        num_key_value_heads=2,
    )
    backbone.save(tmp_path / "llama.keras")
    out = tmp_path / "converted.keras"
    result = subprocess.run(
        [CONSOLE, "convert", str(tmp_path / "llama.keras"), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env={"PATH": "/usr/bin:/bin", "KERAS_BACKEND": "torch", "PYTHONPATH": REPO},
    )
    assert result.returncode == 0, result.stderr
    assert "inside LlamaTransformerDecoder) -> SelfAttention(" in result.stdout
    loaded = keras.models.load_model(out)
    ids = np.array([[3, 4, 5, 0], [7, 8, 9, 1]], "int32")
    inputs = {"token_ids": ids, "padding_mask": ids != 0}
    real = ids != 0
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(loaded(inputs))[real],
        keras.ops.convert_to_numpy(backbone(inputs))[real],
        atol=2e-5,
    )
