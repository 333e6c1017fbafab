"""mixed_float16 / mixed_bfloat16: float32 softmax, no overflow, compute dtype out."""

import keras
import numpy as np
import pytest

from keras_selfattn import SelfAttention
from tests.backend import to_numpy
from tests.reference import layer_weights, self_attention


def _large_score_inputs():
    """Scores of about 1e5: more than float16 can hold (65504)."""
    rng = np.random.default_rng(0)
    x = np.abs(rng.normal(size=(2, 6, 16))).astype("float32") * 12.0
    kernels = [np.full((16, 16), 0.5, "float32") + 0.01 * rng.normal(size=(16, 16))]
    kernels = [k.astype("float32") for k in kernels * 3]
    return x, kernels


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_large_scores_do_not_overflow(policy):
    x, kernels = _large_score_inputs()
    mask = np.array([[True] * 6, [True] * 3 + [False] * 3])
    layer = SelfAttention(dtype=policy, scale=1.0)
    layer.build(x.shape)
    layer.set_weights(kernels)
    out, weights = layer(x, mask=mask, return_attention_scores=True)
    dtype = policy.split("_")[1]
    assert keras.backend.standardize_dtype(out.dtype) == dtype
    assert keras.backend.standardize_dtype(weights.dtype) == dtype
    out = to_numpy(keras.ops.cast(out, "float32"))
    weights = to_numpy(keras.ops.cast(weights, "float32"))
    assert np.all(np.isfinite(out)) and np.all(np.isfinite(weights))
    expected_out, _ = self_attention(
        x, layer_weights(layer), 1, 16, 16, scale=1.0, padding_mask=mask
    )
    # The raw scores are huge, so attention is nearly one-hot; half-precision
    # projections shift which key wins only where scores tie, hence the
    # tolerances on rows, stated relative to the output's magnitude.
    tolerance = {"mixed_float16": 2e-2, "mixed_bfloat16": 5e-2}[policy]
    scale = np.abs(expected_out).max()
    assert np.abs(out - expected_out).max() <= tolerance * scale
    np.testing.assert_allclose(weights[:, 0].sum(-1)[mask], 1.0, atol=1e-2)
    assert np.all(out[1, 3:] == 0.0) and np.all(weights[1, :, 3:] == 0.0)
    assert np.all(weights[1, :, :, 3:] == 0.0)


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
@pytest.mark.slow_on("tensorflow", "two fits: 10 s; the other suites fit")
def test_fit_under_mixed_precision(policy):
    keras.mixed_precision.set_global_policy(policy)
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 6, 8)).astype("float32")
    y = (x.mean(axis=(1, 2)) > 0).astype("float32")
    model = keras.Sequential(
        [
            keras.Input((None, 8), name="x"),
            SelfAttention(num_heads=2, output_dim=8, use_bias=True),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(1, activation="sigmoid", dtype="float32"),
        ]
    )
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="binary_crossentropy")
    history = model.fit(x, y, epochs=8, batch_size=16, verbose=0).history["loss"]
    assert np.all(np.isfinite(history))
    assert history[-1] < history[0]
    assert all(w.dtype == "float32" for w in model.layers[0].weights)
