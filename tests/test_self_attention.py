"""SelfAttention through the shared layer test, plus Keras integration."""

import keras
import numpy as np
import pytest

from keras_selfattn import SelfAttention
from tests import layer_harness
from tests.backend import to_numpy
from tests.reference import layer_weights, self_attention

# (init kwargs, input shape, output width, weight shapes)
CONFIGS = {
    "defaults": ({}, (2, 5, 6), 6, [(6, 6), (6, 6), (6, 6)]),
    "heads_bias_output": (
        {
            "num_heads": 2,
            "key_dim": 3,
            "value_dim": 4,
            "output_dim": 7,
            "use_bias": True,
        },
        (3, 4, 5),
        7,
        [(5, 6), (6,), (5, 6), (6,), (5, 8), (8,), (8, 7), (7,)],
    ),
    "causal_window_scale": (
        {"num_heads": 3, "causal": True, "sliding_window": 2, "scale": 0.5},
        (2, 7, 6),
        6,
        [(6, 6), (6, 6), (6, 6)],
    ),
    "dropout_regularized": (
        {
            "num_heads": 2,
            "dropout": 0.25,
            "seed": 3,
            "kernel_regularizer": "l2",
            "kernel_constraint": "max_norm",
        },
        (2, 4, 4),
        4,
        [(4, 4), (4, 4), (4, 4)],
    ),
}


# On JAX (every new shape compiled, 15-25 s a configuration) two of them run
# in `make test`, all four in the slow suite.
SLOW_ON_JAX = pytest.mark.slow_on("jax", "Keras's layer harness compiles each check")


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(name, marks=SLOW_ON_JAX)
        if name
        in (
            "defaults",
            "causal_window_scale",
            "heads_bias_output",
            "dropout_regularized",
        )
        else name
        for name in sorted(CONFIGS)
    ],
)
def test_layer_harness(name, tmp_path):
    init_kwargs, input_shape, width, weight_shapes = CONFIGS[name]
    layer_harness.run_layer_test(
        SelfAttention,
        init_kwargs,
        input_shape,
        input_shape[:2] + (width,),
        weight_shapes,
        tmp_path,
    )


def test_weight_attributes_and_get_weights_order():
    layer = SelfAttention(num_heads=2, key_dim=2, output_dim=3, use_bias=True)
    layer.build((None, None, 4))
    ordered = [
        layer.query_kernel,
        layer.query_bias,
        layer.key_kernel,
        layer.key_bias,
        layer.value_kernel,
        layer.value_bias,
        layer.output_kernel,
        layer.output_bias,
    ]
    assert [v.path for v in layer.weights] == [v.path for v in ordered]
    assert [w.shape for w in layer.get_weights()] == [tuple(v.shape) for v in ordered]


def test_heads_use_contiguous_columns():
    """Head h uses kernel columns [h*key_dim:(h+1)*key_dim], as documented."""
    rng = np.random.default_rng(0)
    layer = SelfAttention(num_heads=2, key_dim=3, value_dim=2)
    x = rng.normal(size=(1, 4, 5)).astype("float32")
    out, weights = map(to_numpy, layer(x, return_attention_scores=True))
    wq, wk, wv = layer.get_weights()
    for h in range(2):
        single = SelfAttention(key_dim=3, value_dim=2, scale=1 / np.sqrt(3))
        single.build(x.shape)
        single.set_weights(
            [
                wq[:, h * 3 : (h + 1) * 3],
                wk[:, h * 3 : (h + 1) * 3],
                wv[:, h * 2 : (h + 1) * 2],
            ]
        )
        head_out, head_weights = map(to_numpy, single(x, return_attention_scores=True))
        np.testing.assert_allclose(out[..., h * 2 : (h + 1) * 2], head_out, atol=1e-6)
        np.testing.assert_allclose(weights[:, h], head_weights[:, 0], atol=1e-6)


def test_sequential_model_fits_and_lowers_loss():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 6, 4)).astype("float32")
    # Target depends on interactions across time: the mean of the sequence.
    y = x.mean(axis=1, keepdims=True).repeat(6, axis=1)
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((None, 4), name="x"), SelfAttention(num_heads=2, output_dim=4)]
    )
    model.compile(optimizer=keras.optimizers.Adam(0.02), loss="mse")
    before = model.evaluate(x, y, verbose=0)
    history = model.fit(x, y, epochs=15, batch_size=16, verbose=0)
    after = model.evaluate(x, y, verbose=0)
    assert after < 0.5 * before, (before, after, history.history["loss"])


def test_functional_model_matches_reference_and_returns_scores_symbolically():
    inputs = keras.Input((None, 6), name="x")
    layer = SelfAttention(num_heads=2, use_bias=True, output_dim=5, name="attention")
    outputs, scores = layer(inputs, return_attention_scores=True)
    assert tuple(scores.shape) == (None, 2, None, None)
    model = keras.Model(inputs, {"y": outputs, "scores": scores})
    x = np.random.default_rng(1).normal(size=(3, 7, 6)).astype("float32")
    result = model.predict(x, verbose=0)
    expected_out, expected_scores = self_attention(
        x, layer_weights(layer), num_heads=2, key_dim=3, value_dim=3
    )
    np.testing.assert_allclose(result["y"], expected_out, atol=1e-5)
    np.testing.assert_allclose(result["scores"], expected_scores, atol=1e-6)


def test_stacked_in_sequential_with_other_layers():
    model = keras.Sequential(
        [
            keras.Input((None,), dtype="int32", name="tokens"),
            keras.layers.Embedding(20, 8, mask_zero=True),
            SelfAttention(num_heads=2),
            SelfAttention(num_heads=4, causal=True, output_dim=8),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(3),
        ]
    )
    tokens = np.array([[3, 4, 5, 0, 0], [7, 0, 0, 0, 0]])
    assert model.predict(tokens, verbose=0).shape == (2, 3)


def test_dynamic_batch_and_time_through_compiled_predict():
    layer = SelfAttention(num_heads=2)
    model = keras.Sequential([keras.Input((None, 4), name="x"), layer])
    for batch, time in ((1, 1), (3, 33), (2, 128)):
        x = np.random.default_rng(time).normal(size=(batch, time, 4)).astype("float32")
        expected, _ = self_attention(
            x, layer_weights(layer), num_heads=2, key_dim=2, value_dim=2
        )
        np.testing.assert_allclose(model.predict(x, verbose=0), expected, atol=1e-5)


def test_dropout_only_in_training():
    # One-hot inputs and an identity value kernel make the output equal to the
    # (dropped) attention weights, so dropout can be checked entry by entry.
    x = np.eye(6, dtype="float32")[None]
    layer = SelfAttention(dropout=0.5, seed=1)
    plain = SelfAttention()
    layer.build(x.shape)
    wq, wk, _ = layer.get_weights()
    layer.set_weights([wq, wk, np.eye(6, dtype="float32")])
    plain.build(x.shape)
    plain.set_weights(layer.get_weights())
    _, weights = plain(x, return_attention_scores=True)
    weights = to_numpy(weights)[0, 0]

    inference = to_numpy(layer(x, training=False))[0]
    np.testing.assert_allclose(inference, weights, atol=1e-6)
    default = to_numpy(layer(x))[0]  # default: inference
    np.testing.assert_allclose(default, weights, atol=1e-6)
    trained = to_numpy(layer(x, training=True))[0]
    kept = trained != 0
    assert kept.any() and (~kept).any(), trained
    # Kept weights are rescaled by 1 / (1 - rate); dropped ones are exactly 0.
    np.testing.assert_allclose(trained[kept], 2 * weights[kept], rtol=1e-5)


@pytest.mark.parametrize(
    "initializer",
    ["glorot_uniform", keras.initializers.GlorotUniform(seed=5)],
    ids=["unseeded", "seeded"],
)
def test_kernels_are_initialized_independently(initializer):
    """One stateless initializer must not give Q, K, V and output equal kernels."""
    x_shape = (None, None, 4)
    kernels = []
    for _ in range(2):
        layer = SelfAttention(num_heads=2, output_dim=4, kernel_initializer=initializer)
        layer.build(x_shape)
        kernels.append(layer.get_weights())
    first = kernels[0]
    for i in range(len(first)):
        for j in range(i + 1, len(first)):
            assert not np.array_equal(first[i], first[j]), (i, j)
    if not isinstance(initializer, str):  # a seeded layer is reproducible
        for a, b in zip(kernels[0], kernels[1], strict=True):
            np.testing.assert_array_equal(a, b)
