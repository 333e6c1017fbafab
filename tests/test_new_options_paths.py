"""The query and key norms, partial rotary, Llama 3 and YaRN frequencies and
ALiBi before the scale give the same output on the explicit path, the
chunked path (`chunk_size`) and the default (fused where the backend
allows), with the same weights. The references of their formulas are in
test_hub_families_qk_norm.py and test_hub_families_rotary.py; this checks
that every attention path reaches them."""

from __future__ import annotations

import keras
import numpy as np
import pytest

from keras_selfattn import SelfAttention

pytestmark = pytest.mark.slow_on(
    "jax", "each path compiled op by op; the other suites check it"
)

BASE = dict(num_heads=4, num_key_value_heads=2, key_dim=8, causal=True)
OPTIONS = {
    "query and key norms": dict(rope_max_wavelength=100.0, use_query_key_norm=True),
    "partial rotary, Llama 3 frequencies": dict(
        rope_max_wavelength=500.0,
        rope_partial_fraction=0.5,
        rope_frequency_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ),
    "YaRN frequencies": dict(
        rope_max_wavelength=500.0,
        rope_frequency_scaling={
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "ALiBi before the scale": dict(position_bias="alibi", alibi_before_scale=True),
}
X = np.random.default_rng(0).normal(size=(2, 24, 16)).astype("float32")


@pytest.mark.parametrize("option", OPTIONS)
def test_every_attention_path_computes_the_same(option):
    arguments = {**BASE, **OPTIONS[option]}
    explicit = SelfAttention(**arguments, flash_attention=False)
    explicit.build(X.shape)
    weights = [
        np.random.default_rng(1).normal(0, 0.5, w.shape).astype("float32")
        for w in explicit.get_weights()
    ]
    explicit.set_weights(weights)
    expected = keras.ops.convert_to_numpy(explicit(X))
    for variant in ({"chunk_size": 8, "flash_attention": False}, {}):
        layer = SelfAttention(**arguments, **variant)
        layer.build(X.shape)
        layer.set_weights(weights)
        np.testing.assert_allclose(
            keras.ops.convert_to_numpy(layer(X)),
            expected,
            atol=1e-5,
            err_msg=str(variant),
        )
