"""Numerics: large magnitudes, half precision, fully masked rows, time 1 and 0.

Tolerances (measured on a 2-core CPU; the bounds keep a margin of about 4x):
- float32 with scores around 1e4, integer inputs (exact products): output
  within rtol 1e-5 / atol 1e-4, weights within atol 1e-6 of float64.
- mixed_float16 vs float32, same weights: max |difference| of the output at
  most 5e-3 of max |float32 output| (measured 1.0e-3); attention weights
  within 5e-3 absolute (measured 1.3e-3).
- mixed_bfloat16 vs float32: output within 3e-2 of max |float32 output|
  (measured 7.7e-3); attention weights within 3e-2 absolute (measured 6.3e-3).

Decisions tested here:
- time 0 works: the output has shape (batch, 0, width) and the weights
  (batch, heads, 0, 0), eagerly, in a compiled function (tf.function, also
  with unknown time; jax.jit) and in a model.
- return_attention_scores under a mixed policy returns the weights in the
  compute dtype (float16 / bfloat16), like the output; softmax itself runs in
  float32.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

from keras_selfattn import SelfAttention
from tests.backend import compiled, to_numpy, value_and_grad
from tests.reference import for_layer

# The whole module runs once per attention path (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("every_path")

HALF_TOLERANCE = {"mixed_float16": 5e-3, "mixed_bfloat16": 3e-2}
HALF_DTYPE = {"mixed_float16": "float16", "mixed_bfloat16": "bfloat16"}

CONFIGS = [
    {"num_heads": 2, "output_dim": 8, "use_bias": True},
    {"num_heads": 4, "key_dim": 8, "causal": True},
    {"num_heads": 1, "sliding_window": 5},
]


def _random_layer(config, features, rng, dtype=None, scale=0.3):
    layer = SelfAttention(dtype=dtype, **config)
    layer.build((None, None, features))
    layer.set_weights(
        [
            rng.normal(scale=scale, size=w.shape).astype("float32")
            for w in layer.get_weights()
        ]
    )
    return layer


def _identity_layer(features, **config):
    """scale=1 and identity projections: the scores are exactly x x^T."""
    layer = SelfAttention(key_dim=features, scale=1.0, **config)
    layer.build((None, None, features))
    layer.set_weights([np.eye(features, dtype="float32")] * 3)
    return layer


def test_large_scores_exact_in_float32():
    rng = np.random.default_rng(0)
    features = 4
    # Integers up to 60: every product and sum is exact in float32 and the
    # scores reach about 1.4e4, so any overflow or loss would show.
    x = rng.integers(-60, 61, size=(3, 17, features)).astype("float32")
    mask = rng.random((3, 17)) < 0.7
    mask[2] = False
    layer = _identity_layer(features, causal=True)
    scores = np.einsum("btf,bsf->bts", x, x)
    assert np.abs(scores).max() > 1e4
    output, weights = map(to_numpy, layer(x, mask=mask, return_attention_scores=True))
    ref_out, ref_weights = for_layer(layer, x, padding_mask=mask)
    assert np.isfinite(output).all()
    np.testing.assert_allclose(output, ref_out, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(weights, ref_weights, rtol=0, atol=1e-6)


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_half_precision_scores_beyond_float16_range_stay_finite(policy):
    rng = np.random.default_rng(1)
    features = 4
    # Scores up to 4 * 250^2 = 2.5e5, far above float16's maximum 65504.
    x = rng.uniform(-250, 250, size=(2, 9, features)).astype("float32")
    reference = _identity_layer(features)
    half = SelfAttention(key_dim=features, scale=1.0, dtype=policy)
    half.build((None, None, features))
    half.set_weights(reference.get_weights())
    assert np.abs(np.einsum("btf,bsf->bts", x, x)).max() > 65504
    output, weights = half(x, return_attention_scores=True)
    output = to_numpy(keras.ops.cast(output, "float32"))
    weights = to_numpy(keras.ops.cast(weights, "float32"))
    assert np.isfinite(output).all() and np.isfinite(weights).all()
    ref_out, ref_weights = for_layer(reference, x)
    # Relative to the values (|x| <= 250) the output error stays tiny.
    tolerance = HALF_TOLERANCE[policy]
    assert np.abs(output - ref_out).max() <= tolerance * np.abs(ref_out).max()
    assert np.abs(weights - ref_weights).max() <= tolerance


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
@pytest.mark.parametrize("config", CONFIGS, ids=["bias_out", "causal", "window"])
def test_half_precision_close_to_float32(policy, config):
    rng = np.random.default_rng(2)
    features = 16
    x = rng.normal(size=(4, 33, features)).astype("float32")
    mask = rng.random((4, 33)) < 0.7
    mask[1] = False
    full = _random_layer(config, features, rng)
    half = SelfAttention(dtype=policy, **config)
    half.build((None, None, features))
    half.set_weights(full.get_weights())
    out32, w32 = full(x, mask=mask, return_attention_scores=True)
    out, weights = half(x, mask=mask, return_attention_scores=True)
    # Decision: output and attention weights come back in the compute dtype.
    assert keras.backend.standardize_dtype(out.dtype) == HALF_DTYPE[policy]
    assert keras.backend.standardize_dtype(weights.dtype) == HALF_DTYPE[policy]
    out = to_numpy(keras.ops.cast(out, "float32"))
    weights = to_numpy(keras.ops.cast(weights, "float32"))
    assert np.isfinite(out).all() and np.isfinite(weights).all()
    tolerance = HALF_TOLERANCE[policy]
    out32, w32 = to_numpy(out32), to_numpy(w32)
    assert np.abs(out - out32).max() <= tolerance * np.abs(out32).max()
    assert np.abs(weights - w32).max() <= tolerance
    # Padded rows stay exactly zero in half precision too.
    assert np.all(out[~mask] == 0) and np.all(weights[1] == 0)


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_half_precision_symbolic_scores_dtype(policy):
    keras.mixed_precision.set_global_policy(policy)
    inputs = keras.Input((None, 8), name="tokens")
    outputs = SelfAttention(num_heads=2)(inputs, return_attention_scores=True)
    model = keras.Model(inputs, outputs)
    assert outputs[0].dtype == outputs[1].dtype == HALF_DTYPE[policy]
    out, weights = model(np.ones((2, 3, 8), "float32"))
    dtypes = {keras.backend.standardize_dtype(t.dtype) for t in (out, weights)}
    assert dtypes == {HALF_DTYPE[policy]}
    sums = to_numpy(keras.ops.cast(weights, "float32")).sum(-1)
    np.testing.assert_allclose(sums, 1.0, atol=HALF_TOLERANCE[policy])


@pytest.mark.parametrize(
    "policy",
    [
        "float32",
        # JAX compiles every eager call anew: the half policies of this
        # gradient check are in its slow suite, in the others' fast ones.
        *(
            pytest.param(p, marks=pytest.mark.slow_on("jax", "half policies"))
            for p in ("mixed_float16", "mixed_bfloat16")
        ),
    ],
)
def test_fully_masked_rows_are_zero_with_finite_gradients(policy):
    rng = np.random.default_rng(3)
    features = 6
    layer = _random_layer(
        {"num_heads": 2, "output_dim": 5, "use_bias": True}, features, rng, policy
    )
    x = rng.normal(size=(3, 7, features)).astype("float32")
    mask = np.ones((3, 7), dtype=bool)
    mask[0] = False  # a sequence that is all padding
    mask[1, 4:] = False  # a padded tail
    attention_mask = np.ones((3, 7, 7), dtype=bool)
    attention_mask[2, 3] = False  # a real query that may attend nothing
    output, weights = layer(
        x, mask=mask, attention_mask=attention_mask, return_attention_scores=True
    )

    def loss(x):
        output, weights = layer(
            x, mask=mask, attention_mask=attention_mask, return_attention_scores=True
        )
        return keras.ops.sum(keras.ops.cast(output, "float32") ** 2) + keras.ops.sum(
            keras.ops.cast(weights, "float32")
        )

    _, grads = value_and_grad(loss, layer.trainable_weights, [x])
    output = to_numpy(keras.ops.cast(output, "float32"))
    weights = to_numpy(keras.ops.cast(weights, "float32"))
    assert np.all(output[0] == 0) and np.all(weights[0] == 0)
    assert np.all(output[1, 4:] == 0) and np.all(weights[1, :, 4:] == 0)
    assert np.all(weights[1, :, :, 4:] == 0)
    # A real query that may attend nothing outputs exactly zero, after the
    # output projection and its bias too.
    assert np.all(output[2, 3] == 0) and np.all(weights[2, :, 3] == 0)
    assert len(grads) == 1 + len(layer.trainable_weights)
    for grad in grads:
        assert grad is not None
        assert np.isfinite(grad.astype("float32")).all()
    # Padding carries no gradient back to the padded inputs.
    assert np.all(grads[-1][0] == 0)


@pytest.mark.parametrize(
    "config",
    [{}, {"causal": True}, {"sliding_window": 1}, {"num_heads": 2, "output_dim": 3}],
)
def test_time_one_matches_reference(config):
    rng = np.random.default_rng(4)
    features = 4
    layer = _random_layer(config, features, rng)
    x = rng.normal(size=(3, 1, features)).astype("float32")
    mask = np.array([[True], [False], [True]])
    output, weights = map(to_numpy, layer(x, mask=mask, return_attention_scores=True))
    ref_out, ref_weights = for_layer(layer, x, padding_mask=mask)
    np.testing.assert_allclose(output, ref_out, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(weights, ref_weights)  # 1 or 0


def _time_zero_layer() -> SelfAttention:
    return SelfAttention(num_heads=2, output_dim=3, causal=True, sliding_window=2)


def test_time_zero_returns_empty_output():
    """Decision: an empty sequence is valid input and gives an empty output."""
    layer = _time_zero_layer()
    x = np.zeros((2, 0, 4), "float32")
    output, weights = layer(
        x, mask=np.zeros((2, 0), bool), return_attention_scores=True
    )
    assert tuple(output.shape) == (2, 0, 3)
    assert tuple(weights.shape) == (2, 2, 0, 0)
    assert tuple(compiled(lambda t: layer(t))(x).shape) == (2, 0, 3)

    inputs = keras.Input((None, 4), name="tokens")
    model = keras.Model(inputs, layer(inputs))
    assert model.predict(x, verbose=0).shape == (2, 0, 3)
    # A batch with no rows at all works as well.
    assert tuple(layer(np.zeros((0, 5, 4), "float32")).shape) == (0, 5, 3)


@pytest.mark.tensorflow_only("tf.function traced with unknown batch and time")
def test_time_zero_in_a_graph_of_unknown_shape():
    import tensorflow as tf

    layer = _time_zero_layer()
    run = tf.function(
        lambda t: layer(t),
        input_signature=[tf.TensorSpec((None, None, 4), tf.float32)],
    )
    assert tuple(run(np.zeros((2, 0, 4), "float32")).shape) == (2, 0, 3)
    assert tuple(run(np.zeros((1, 3, 4), "float32")).shape) == (1, 3, 3)
