"""Every keras-hub family that converts, checked where its other test files
do not: OPT (greedy tokens, generators), seeded sampling on each backend and
the SavedModel generator of each family, loaded by TensorFlow's own
SavedModel loader. The reference is keras-hub's own forward pass, one call
per new token, with the package-independent numpy sampler of
`tests.generation_reference` (keras-hub's greedy `generate` is checked
against the converted models in the families' own files)."""

from __future__ import annotations

import keras
import numpy as np
import pytest

import keras_selfattn
from tests import generation_reference as reference
from tests import (
    test_convert_blocks,
    test_convert_keras_hub_models,
    test_hub_families_alibi,
    test_hub_families_qk_norm,
    test_hub_families_rotary,
)
from tests.test_convert_blocks import PROMPTS, STEPS, _keras_hub_greedy
from tests.test_convert_keras_hub_models import exports_keras_hub_s_tokens

keras_hub = pytest.importorskip("keras_hub")

SAMPLING = {"temperature": 1.5, "top_k": 8, "top_p": 0.95}
SEED = 7
# The most tokens a generator here is exported for.
MAX_LENGTH = 16


def _opt_causal_lm():
    backbone = keras_hub.models.OPTBackbone(
        vocabulary_size=40,
        num_layers=2,
        num_heads=2,
        hidden_dim=16,
        intermediate_dim=32,
        max_sequence_length=32,
    )
    lm = keras_hub.models.OPTCausalLM(backbone=backbone, preprocessor=None)
    return test_convert_keras_hub_models._randomized(lm, seed=1)


def _builder(module, family: str):
    return lambda: module._causal_lm(family)


# Family name: a function building its tiny causal LM (random weights whose
# greedy tokens vary), as the family's own test file builds it.
FAMILIES = {
    "GPT-2": test_convert_blocks._gpt2_causal_lm,
    "OPT": _opt_causal_lm,
    **{
        family: _builder(module, family)
        for module in (
            test_convert_keras_hub_models,
            test_hub_families_qk_norm,
            test_hub_families_rotary,
            test_hub_families_alibi,
        )
        for family in module.FAMILIES
    },
}


# Slow on every backend, and out of CI's TensorFlow slow suite.
RELEASE = (pytest.mark.slow, pytest.mark.release)


class _KerasHubLogits:
    """keras-hub's causal LM as `reference.uncached` calls a token model:
    its logits for right-padded token rows (causal: a position does not
    see the padding after it)."""

    def __init__(self, lm):
        self.lm = lm

    def predict_on_batch(self, tokens: np.ndarray):
        return self.lm(
            {"token_ids": tokens, "padding_mask": np.ones_like(tokens, bool)}
        )


def _varied(tokens: np.ndarray) -> np.ndarray:
    assert len(np.unique(tokens)) >= 4, f"a test of varied tokens: {tokens}"
    return tokens


@pytest.mark.slow_on("tensorflow", "jax", "keras-hub's generate compiles its loop")
def test_converted_opt_causal_lm_generates_keras_hub_s_greedy_tokens():
    lm = _opt_causal_lm()
    tokens_model = keras_selfattn.convert_causal_lm(lm)
    assert len(tokens_model.conversion_report.converted) == 2
    expected = _varied(_keras_hub_greedy(lm, PROMPTS, STEPS))
    result = keras_selfattn.generate(tokens_model, PROMPTS, STEPS)
    np.testing.assert_array_equal(result.tokens, expected)


@pytest.mark.slow
@pytest.mark.parametrize(
    "export_format", ["onnx", pytest.param("litert", marks=pytest.mark.release)]
)
def test_converted_opt_causal_lm_exports_its_generator(export_format, tmp_path):
    exports_keras_hub_s_tokens(
        _opt_causal_lm,
        export_format,
        tmp_path,
        lambda lm: _keras_hub_greedy(lm, PROMPTS, STEPS),
    )


# Families whose seeded sampling `make test` checks on PyTorch (one per
# kind of attention mapping: MultiHeadAttention, grouped rotary, query/key
# norms, ALiBi); the others in `make test-slow` on every backend.
SAMPLED_FAST = ("GPT-2", "Llama", "Qwen 3", "Bloom")


@pytest.mark.release
@pytest.mark.slow_on("tensorflow", "jax", "a sampling loop traced per family")
@pytest.mark.parametrize(
    "family",
    [
        family if family in SAMPLED_FAST else pytest.param(family, marks=RELEASE)
        for family in FAMILIES
    ],
)
def test_converted_family_samples_keras_hub_s_tokens_with_its_seed(family):
    """`generate(seed=...)` draws what the numpy sampler draws from
    keras-hub's own logits, on each backend; another seed differs."""
    lm = FAMILIES[family]()
    tokens_model = keras_selfattn.convert_causal_lm(lm)
    expected, _ = reference.uncached(
        _KerasHubLogits(lm), PROMPTS, STEPS, seed=SEED, **SAMPLING
    )
    result = keras_selfattn.generate(
        tokens_model, PROMPTS, STEPS, seed=SEED, **SAMPLING
    )
    np.testing.assert_array_equal(result.tokens, _varied(expected))
    other = keras_selfattn.generate(
        tokens_model, PROMPTS, STEPS, seed=SEED + 1, **SAMPLING
    )
    assert (other.tokens != result.tokens).any()


@pytest.mark.release
@pytest.mark.slow
@pytest.mark.tensorflow_only("SavedModel generators are written on TensorFlow")
@pytest.mark.parametrize("family", FAMILIES)
def test_converted_family_exports_its_saved_model_generator(family, tmp_path):
    """The exporter's own check runs the SavedModel in a fresh process
    against `generate`; loaded here by TensorFlow, its greedy and seeded
    tokens are those of keras-hub's own forward pass."""
    import tensorflow as tf

    from keras_selfattn.export import export_generator

    lm = FAMILIES[family]()
    tokens_model = keras_selfattn.convert_causal_lm(lm)
    saved = export_generator(
        tokens_model, tmp_path, "saved_model", max_length=MAX_LENGTH, name="lm"
    )
    generate = tf.saved_model.load(saved).signatures["generate"]
    logits = _KerasHubLogits(lm)
    vocabulary = int(keras.ops.shape(tokens_model.output)[-1])
    checked = []
    for controls, seed in (({}, 0), (SAMPLING, SEED)):
        request = reference.generator_request(
            PROMPTS, STEPS, vocabulary, {**controls, "seed": seed}
        )
        out = generate(**{key: tf.constant(value) for key, value in request.items()})
        expected, _ = reference.uncached(logits, PROMPTS, STEPS, seed=seed, **controls)
        np.testing.assert_array_equal(out["tokens"].numpy(), expected)
        checked.append(expected)
    _varied(np.concatenate(checked))
