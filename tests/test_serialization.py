"""Save and load like a built-in layer: no custom_objects, fresh process."""

import json
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest

from keras_selfattn import SelfAttention
from tests.backend import BACKEND


def _run_python(script: str) -> subprocess.CompletedProcess:
    """Runs `script` in a fresh interpreter that has imported nothing, on
    this process's Keras backend."""
    return subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        env={
            "TF_CPP_MIN_LOG_LEVEL": "3",
            "PATH": "/usr/bin:/bin",
            "KERAS_BACKEND": BACKEND,
        },
    )


def _masked_model():
    keras.utils.set_random_seed(4)
    tokens = keras.Input((None,), dtype="int32", name="tokens")
    x = keras.layers.Embedding(30, 8, mask_zero=True)(tokens)
    x = SelfAttention(
        num_heads=2,
        key_dim=3,
        value_dim=5,
        output_dim=8,
        use_bias=True,
        causal=True,
        sliding_window=3,
        dropout=0.1,
        seed=7,
        scale=0.4,
        kernel_regularizer="l2",
    )(x)
    x = SelfAttention(num_heads=4)(x)
    x = keras.layers.GlobalAveragePooling1D()(x)
    return keras.Model(tokens, keras.layers.Dense(3)(x))


@pytest.mark.slow  # a fresh interpreter: 10-20 s
def test_load_in_fresh_process_with_only_the_package_import(tmp_path):
    model = _masked_model()
    tokens = np.array([[3, 9, 4, 0, 0], [5, 0, 0, 0, 0], [1, 2, 3, 4, 5]])
    expected = model.predict(tokens, verbose=0)
    path = tmp_path / "model.keras"
    model.save(path)
    np.save(tmp_path / "tokens.npy", tokens)

    script = textwrap.dedent(
        f"""
        import json, sys
        import numpy as np
        import keras
        import keras_selfattn  # registers the layer; nothing else is passed
        model = keras.models.load_model({str(path)!r}, safe_mode=True)
        out = model.predict(np.load({str(tmp_path / "tokens.npy")!r}), verbose=0)
        configs = [l.get_config() for l in model.layers
                   if type(l).__name__ == "SelfAttention"]
        json.dump({{"out": out.tolist(), "configs": configs}}, sys.stdout)
        """
    )
    result = _run_python(script)
    assert result.returncode == 0, result.stderr[-3000:]
    loaded = json.loads(result.stdout.strip().splitlines()[-1])
    np.testing.assert_allclose(np.array(loaded["out"]), expected, atol=1e-6)
    originals = [
        json.loads(json.dumps(layer.get_config()))
        for layer in model.layers
        if isinstance(layer, SelfAttention)
    ]
    assert loaded["configs"] == originals


# Keras's deserialization, the same on every backend: checked in `make test`
# where a fresh interpreter costs least (Keras on JAX imports in about half
# the CPU of TensorFlow or PyTorch), on the other two in `make test-slow`.
@pytest.mark.slow_on(
    "tensorflow", "torch", "a fresh interpreter; the JAX suite checks it"
)
def test_loading_without_the_package_import_names_the_layer(tmp_path):
    """Documents why `import keras_selfattn` is the one requirement."""
    path = tmp_path / "model.keras"
    keras.Sequential([keras.Input((None, 4), name="x"), SelfAttention()]).save(path)
    script = f"import keras; keras.models.load_model({str(path)!r})"
    result = _run_python(script)
    assert result.returncode != 0
    assert "keras_selfattn>SelfAttention" in result.stderr


def test_unbuilt_layer_config_round_trip_keeps_defaults_as_none():
    layer = SelfAttention(num_heads=2)
    layer.build((None, None, 6))
    config = layer.get_config()
    assert config["key_dim"] is None and config["value_dim"] is None
    revived = SelfAttention.from_config(config)
    revived.build((None, None, 10))  # defaults resolve again from the new input
    assert tuple(revived.query_kernel.shape) == (10, 10)
