"""keras-hub's Bloom (ALiBi over six heads, not a power of two; biases),
Falcon (ALiBi added before the scale) and GPT-OSS (sinks, grouped heads,
alternating sliding windows, its MoE feed-forward kept; with YaRN rope
scaling too) convert: their attention classes become SelfAttention behind
`KerasHubAttentionAdapter`. GPT-OSS with dropout (on its attention output)
is refused by `convert_causal_lm` in one line. The references are the
original keras-hub models: their outputs and their own greedy `generate`."""

from __future__ import annotations

import keras
import numpy as np
import pytest

import keras_selfattn
from tests.test_convert_blocks import PROMPTS, STEPS, _keras_hub_greedy
from tests.test_convert_keras_hub_models import (
    ATOL,
    TOKENS,
    _adapters,
    exports_keras_hub_s_tokens,
    generator_export,
    refused_in_one_line,
)

keras_hub = pytest.importorskip("keras_hub")

GPT_OSS = dict(
    vocabulary_size=40,
    hidden_dim=16,
    intermediate_dim=32,
    num_layers=2,
    num_query_heads=4,
    num_key_value_heads=2,
    num_experts=4,
    top_k=2,
    sliding_window=2,  # the odd layers'; shorter than the prompts
    rope_max_wavelength=500,
)
# keras-hub's GPT-OSS YaRN is fitted to 4096 positions: over 256 instead, the
# ramp of a head of 4 keeps the first pair's frequency and divides the
# second's by 1 / (0.17 + 0.83 / 4) (module doc of `rope_frequencies`).
YARN_LENGTH = 256
FAMILIES = {
    # name: (backbone class, causal LM class, backbone arguments)
    "Bloom": (
        "BloomBackbone",
        "BloomCausalLM",
        dict(
            vocabulary_size=40,
            num_layers=2,
            num_heads=6,
            hidden_dim=24,
            intermediate_dim=64,
        ),
    ),
    "Falcon": (
        "FalconBackbone",
        "FalconCausalLM",
        dict(
            vocabulary_size=40,
            num_layers=2,
            num_attention_heads=6,
            hidden_dim=24,
            intermediate_dim=64,
        ),
    ),
    "GPT-OSS": ("GptOssBackbone", "GptOssCausalLM", GPT_OSS),
    "GPT-OSS YaRN": (
        "GptOssBackbone",
        "GptOssCausalLM",
        {**GPT_OSS, "rope_scaling_factor": 4.0},
    ),
}
# Random weights whose greedy tokens vary (at least 4 distinct in each row):
# (seed, spread of the vectors, of the kernels). Bloom's tied embedding
# repeats its input token unless its biases and norms stay near their initial
# values; Falcon's unless its kernels are large.
RANDOM = {"Bloom": (1, 0.03, 1.0), "Falcon": (4, 0.5, 3.0), "GPT-OSS": (1, 0.1, 1.0)}
RANDOM["GPT-OSS YaRN"] = RANDOM["GPT-OSS"]


def _randomized(model, family: str):
    """Kernels and embeddings drawn anew, the vectors (biases, normalization
    scales, sinks) moved off their initial values."""
    seed, spread, scale = RANDOM[family]
    rng = np.random.default_rng(seed)
    model.set_weights(
        [
            (
                rng.normal(0, scale, w.shape)
                if w.ndim > 1
                else w + rng.normal(0, spread, w.shape)
            ).astype(w.dtype)
            for w in model.get_weights()
        ]
    )
    return model


def _backbone(family: str, **changes):
    backbone, _, arguments = FAMILIES[family]
    model = getattr(keras_hub.models, backbone)(**{**arguments, **changes})
    if family == "GPT-OSS YaRN":
        for decoder in model.transformer_layers:
            rope = decoder.self_attention_layer.rotary_embedding_layer
            rope.original_max_position_embeddings = YARN_LENGTH
    return model


def _causal_lm(family: str):
    lm = getattr(keras_hub.models, FAMILIES[family][1])
    return _randomized(lm(_backbone(family), preprocessor=None), family)


@pytest.mark.parametrize(
    "family",
    [
        pytest.param(
            "Bloom",
            marks=pytest.mark.slow_on("tensorflow", "jax", "PyTorch checks it"),
        ),
        pytest.param("Falcon", marks=pytest.mark.slow),
        pytest.param("GPT-OSS", marks=pytest.mark.slow),  # 9 s: its experts
        pytest.param("GPT-OSS YaRN", marks=pytest.mark.slow),
    ],
)
def test_keras_hub_backbone_converts_with_its_outputs(family):
    model = _randomized(_backbone(family), family)
    new = keras_selfattn.convert(model)
    report = new.conversion_report
    assert len(report.converted) == 2 and report.kept == [], str(report)
    first, second = (adapter.attention for adapter in _adapters(new))
    if family in ("Bloom", "Falcon"):
        assert first.position_bias == "alibi" and first.use_bias
        assert (first.num_heads, first.key_dim) == (6, 4)
        assert first.alibi_before_scale == (family == "Falcon")
    else:
        # keras-hub's window of 2 earlier keys is SelfAttention's 3.
        assert (first.sliding_window, second.sliding_window) == (None, 3)
        assert first.use_sinks and first.num_key_value_heads == 2
        assert first.rope_scaling_factor == 1.0
        # keras-hub's GPT-OSS rotary is always YaRN's (plain at factor 1).
        yarn = first.rope_frequency_scaling
        factor = 4.0 if "YaRN" in family else 1.0
        assert (yarn["rope_type"], yarn["factor"]) == ("yarn", factor)
    inputs = {"token_ids": TOKENS, "padding_mask": TOKENS != 0}
    real = TOKENS != 0
    expected = keras.ops.convert_to_numpy(model(inputs))
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(new(inputs))[real], expected[real], atol=ATOL
    )


@pytest.mark.slow  # keras-hub's generate: 4 s or more on every backend
@pytest.mark.parametrize("family", FAMILIES)
def test_converted_causal_lm_generates_keras_hub_s_greedy_tokens(family):
    lm = _causal_lm(family)
    tokens_model = keras_selfattn.convert_causal_lm(lm)
    assert len(tokens_model.conversion_report.converted) == 2
    expected = _keras_hub_greedy(lm, PROMPTS, STEPS)
    assert min(len(np.unique(row)) for row in expected) >= 4, expected
    result = keras_selfattn.generate(tokens_model, PROMPTS, STEPS)
    np.testing.assert_array_equal(result.tokens, expected)


REFUSED = {
    # name: (family, backbone changes, what the one line says)
    "GPT-OSS dropout": (
        "GPT-OSS",
        {"dropout": 0.1},
        "Cannot convert GptOssAttention 'self_attention' to SelfAttention: its "
        "dropout (0.1) applies to the attention output",
    ),
}


@pytest.mark.slow  # run once: 10 s
@pytest.mark.parametrize("case", REFUSED)
def test_convert_causal_lm_refuses_what_does_not_convert_in_one_line(case):
    family, changes, why = REFUSED[case]
    lm = getattr(keras_hub.models, FAMILIES[family][1])(
        _backbone(family, **changes), preprocessor=None
    )
    refused_in_one_line(lm, why)


EXPORTS = [
    generator_export(family, form)
    for family in ("Bloom", "Falcon", "GPT-OSS")
    for form in ("onnx", "litert")
]


@pytest.mark.slow
@pytest.mark.parametrize("family, export_format", EXPORTS)
def test_converted_causal_lm_exports_its_generator(family, export_format, tmp_path):
    exports_keras_hub_s_tokens(
        lambda: _causal_lm(family),
        export_format,
        tmp_path,
        lambda lm: _keras_hub_greedy(lm, PROMPTS, STEPS),
    )
