"""Models with score modifications export and pass their default checks.

Each export is loaded by its own runtime and compared with Keras on several
shapes by the exporters' default check (a failed check raises): a padded
classifier with T5's relative bias, sinks and a soft-cap in every format the
backend writes, and a causal ALiBi language model's decoding step and
generator.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

from keras_selfattn import SelfAttention
from keras_selfattn import export as E
from tests.backend import BACKEND

pytestmark = pytest.mark.slow

FORWARD_FORMATS = {
    "tensorflow": ("saved_model", "onnx", "litert", "openvino"),
    "jax": ("saved_model", "onnx"),
    "torch": ("onnx", "openvino", "torch"),
}
STEP_FORMATS = {
    "tensorflow": ("saved_model", "onnx", "litert", "openvino"),
    "jax": ("saved_model", "onnx"),
    "torch": ("onnx", "torch"),
}
GENERATOR_FORMATS = {
    "tensorflow": ("saved_model", "onnx", "litert"),
    "jax": ("saved_model",),
    "torch": ("onnx",),
}
SUFFIX = {"onnx": ".onnx", "litert": ".tflite", "openvino": ".xml", "torch": ".pt2"}


def _randomize_new_weights(model) -> None:
    rng = np.random.default_rng(3)
    for weight in model.weights:
        if weight.name in ("relative_attention_bias", "sinks"):
            weight.assign(rng.normal(size=weight.shape).astype("float32"))


def _path(tmp_path, fmt: str, stem: str):
    return tmp_path if fmt == "saved_model" else tmp_path / f"{stem}{SUFFIX[fmt]}"


def _name(fmt: str, name: str) -> dict:
    return {"name": name} if fmt == "saved_model" else {}


@pytest.mark.parametrize("fmt", FORWARD_FORMATS[BACKEND])
def test_a_padded_classifier_with_relative_bias_sinks_and_a_soft_cap(tmp_path, fmt):
    tokens = keras.Input((None,), dtype="int32", name="tokens")
    x = keras.layers.Embedding(50, 16, mask_zero=True)(tokens)
    x = SelfAttention(
        num_heads=4,
        position_bias="relative",
        relative_attention_num_buckets=8,
        relative_attention_max_distance=12,
        use_sinks=True,
        logit_soft_cap=2.0,
    )(x)
    model = keras.Model(tokens, keras.layers.Dense(3)(x))
    _randomize_new_weights(model)
    writers = {
        "saved_model": lambda: E.export_saved_model(model, tmp_path, "classifier"),
        "onnx": lambda: E.export_onnx(model, _path(tmp_path, fmt, "m")),
        "litert": lambda: E.export_litert(model, _path(tmp_path, fmt, "m")),
        "openvino": lambda: E.export_openvino(model, _path(tmp_path, fmt, "m")),
        "torch": lambda: E.export_torch(model, _path(tmp_path, fmt, "m")),
    }
    assert writers[fmt]()  # the default check passed


@pytest.fixture(scope="module")
def alibi_lm():
    keras.utils.set_random_seed(7)
    tokens = keras.Input((None,), dtype="int32", name="tokens")
    x = keras.layers.Embedding(40, 16)(tokens)
    x = SelfAttention(
        num_heads=4, causal=True, position_bias="alibi", num_key_value_heads=2
    )(x)
    return keras.Model(tokens, keras.layers.Dense(40)(x))


@pytest.mark.parametrize("fmt", STEP_FORMATS[BACKEND])
def test_an_alibi_language_models_decoding_step(alibi_lm, tmp_path, fmt):
    path = _path(tmp_path, fmt, "step")
    assert E.export_decode_step(
        alibi_lm, path, fmt, max_length=16, **_name(fmt, "step")
    )


@pytest.mark.parametrize("fmt", GENERATOR_FORMATS[BACKEND])
def test_an_alibi_language_models_generator(alibi_lm, tmp_path, fmt):
    path = _path(tmp_path, fmt, "generator")
    assert E.export_generator(alibi_lm, path, fmt, max_length=16, **_name(fmt, "lm"))
