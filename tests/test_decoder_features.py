"""Grouped key/value heads, the output gate and rotary position embedding.

Each feature, and all three together, on every path (explicit, chunked,
fused) against the numpy reference, with masks and in mixed precision; and
against Keras's own layers with copied weights: `GroupQueryAttention` for
the grouped heads, `MultiHeadAttention(use_gate=True)` for the gate.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

from keras_selfattn import SelfAttention
from tests.backend import BACKEND, compiled, to_numpy, value_and_grad
from tests.paths import PATH_PARAMS, PATHS
from tests.reference import for_layer, output_for_call, rotary

FEATURES = {
    "gqa": {"num_heads": 4, "num_key_value_heads": 2},
    "mqa": {"num_heads": 4, "num_key_value_heads": 1},
    "gate": {"num_heads": 2, "use_gate": True},
    "rope": {"num_heads": 2, "rope_max_wavelength": 100.0},
    "rope_scaled": {
        "num_heads": 2,
        "rope_max_wavelength": 10.0,
        "rope_scaling_factor": 2.5,
    },
    "all": {
        "num_heads": 4,
        "num_key_value_heads": 2,
        "use_gate": True,
        "rope_max_wavelength": 50.0,
        "use_bias": True,
        "bias_initializer": "random_normal",
        "output_dim": 5,
    },
    "all_causal": {
        "num_heads": 4,
        "num_key_value_heads": 1,
        "use_gate": True,
        "rope_max_wavelength": 10000.0,
        "rope_scaling_factor": 0.5,
        "causal": True,
        "key_dim": 4,
    },
}
RNG = np.random.default_rng(11)
X = RNG.normal(size=(3, 8, 8)).astype("float32")
RIGHT_PADDED = np.arange(8)[None, :] < np.array([[8], [5], [1]])
LEFT_PADDED = ~RIGHT_PADDED[:, ::-1]
ATTENTION = RNG.random((3, 8, 8)) > 0.4
ATTENTION[1, 2] = False  # a row with nothing to attend
MASKS = {
    "none": {},
    "right_padded": {"mask": RIGHT_PADDED},
    "left_padded": {"mask": LEFT_PADDED},
    "attention": {"attention_mask": ATTENTION},
    "padding_and_attention": {"mask": LEFT_PADDED, "attention_mask": ATTENTION},
}


def _layer(path: str, **config) -> SelfAttention:
    layer = SelfAttention(**PATHS[path], **config)
    layer.build(X.shape)
    return layer


@pytest.mark.parametrize("path", PATH_PARAMS)
@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize(
    "mask_kind",
    [
        # JAX compiles each eager call's shapes anew: masks one at a time are
        # in its slow suite (their combination stays), in every other
        # backend's fast one.
        pytest.param(kind, marks=pytest.mark.slow_on("jax", "one mask kind"))
        if kind in ("right_padded", "attention")
        else kind
        for kind in MASKS
    ],
)
def test_features_match_reference(path, feature, mask_kind):
    masks = MASKS[mask_kind]
    if path == "fused" and "attention_mask" in masks:
        pytest.skip("the fused path takes no attention_mask")
    layer = _layer(path, **FEATURES[feature])
    assert layer.implementation(X, **masks) == path
    output = to_numpy(layer(X, **masks))
    np.testing.assert_allclose(
        output, output_for_call(layer, X, masks), atol=2e-5, rtol=1e-5
    )


@pytest.mark.parametrize("path", PATH_PARAMS)
def test_all_features_under_jit_with_gradients(path):
    layer = _layer(path, **FEATURES["all_causal"])
    run = compiled(lambda x, mask: layer(x, mask=mask))
    output = to_numpy(run(X, LEFT_PADDED))
    expected = output_for_call(layer, X, {"mask": LEFT_PADDED})
    np.testing.assert_allclose(output, expected, atol=2e-5, rtol=1e-5)

    def loss(x):
        return keras.ops.sum(keras.ops.square(layer(x, mask=LEFT_PADDED)))

    _, grads = value_and_grad(loss, layer.trainable_variables, [X])
    for grad in grads:
        assert grad is not None and np.isfinite(grad).all()


@pytest.mark.parametrize("path", PATH_PARAMS)
@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_all_features_in_mixed_precision(path, policy):
    if path == "fused" and policy == "mixed_float16" and BACKEND == "jax":
        pytest.skip("JAX's kernel takes float16 only on a GPU")
    config = FEATURES["all"]
    reference = _layer(path, **config)
    expected = output_for_call(reference, X, {"mask": RIGHT_PADDED})
    keras.mixed_precision.set_global_policy(policy)
    layer = _layer(path, **config)
    layer.set_weights(reference.get_weights())
    assert layer.implementation(X, mask=RIGHT_PADDED) == path
    output = layer(X, mask=RIGHT_PADDED)
    assert keras.backend.standardize_dtype(output.dtype) == policy.split("_")[1]
    output = to_numpy(keras.ops.cast(output, "float32"))
    assert np.isfinite(output).all()
    np.testing.assert_allclose(output, expected, atol=5e-2, rtol=5e-2)


def test_returned_scores_have_every_query_head():
    layer = _layer("explicit", **FEATURES["all"])
    _, weights = layer(X, return_attention_scores=True)
    assert tuple(weights.shape) == (3, 4, 8, 8)
    expected = for_layer(layer, X)[1]
    np.testing.assert_allclose(to_numpy(weights), expected, atol=2e-5, rtol=1e-5)


def test_weight_shapes_and_order():
    layer = SelfAttention(
        num_heads=4,
        key_dim=6,
        value_dim=3,
        num_key_value_heads=2,
        use_gate=True,
        use_bias=True,
        output_dim=7,
    )
    layer.build((None, None, 5))
    # Weight paths: NAME/{query,key,value,gate,output}_dense/{kernel,bias}.
    shapes = [(w.path.split("/", 1)[1], tuple(w.shape)) for w in layer.weights]
    assert shapes == [
        ("query_dense/kernel", (5, 24)),
        ("query_dense/bias", (24,)),
        ("key_dense/kernel", (5, 12)),
        ("key_dense/bias", (12,)),
        ("value_dense/kernel", (5, 6)),
        ("value_dense/bias", (6,)),
        ("gate_dense/kernel", (5, 12)),
        ("gate_dense/bias", (12,)),
        ("output_dense/kernel", (12, 7)),
        ("output_dense/bias", (7,)),
    ]


def _copy_dense(dense, *, flat_input: bool = False) -> list[np.ndarray]:
    """An EinsumDense's kernel (and bias) in SelfAttention's 2-D layout."""
    values = [to_numpy(w) for w in dense.weights]
    kernel = values[0]
    if flat_input:  # (heads, head_dim, out) -> (heads * head_dim, out)
        kernel = kernel.reshape(-1, kernel.shape[-1])
    else:  # (features, heads, head_dim) -> (features, heads * head_dim)
        kernel = kernel.reshape(kernel.shape[0], -1)
    return [kernel] + [b.reshape(-1) for b in values[1:]]


@pytest.mark.parametrize("use_bias", [False, True])
@pytest.mark.parametrize("use_gate", [False, True])
@pytest.mark.parametrize("kv_heads", [1, 2, 4])
@pytest.mark.parametrize("causal", [False, True])
def test_equals_keras_group_query_attention(use_bias, use_gate, kv_heads, causal):
    gqa = keras.layers.GroupQueryAttention(
        head_dim=3,
        num_query_heads=4,
        num_key_value_heads=kv_heads,
        use_bias=use_bias,
        use_gate=use_gate,
        bias_initializer="random_normal",
    )
    expected = to_numpy(gqa(X, X, use_causal_mask=causal))
    layer = SelfAttention(
        num_heads=4,
        key_dim=3,
        num_key_value_heads=kv_heads,
        use_gate=use_gate,
        use_bias=use_bias,
        output_dim=X.shape[-1],
        causal=causal,
    )
    layer.build(X.shape)
    dense = [gqa._query_dense, gqa._key_dense, gqa._value_dense]
    weights = [w for d in dense for w in _copy_dense(d)]
    if use_gate:
        weights += _copy_dense(gqa._gate_dense)
    weights += _copy_dense(gqa._output_dense, flat_input=True)
    layer.set_weights(weights)
    np.testing.assert_allclose(to_numpy(layer(X)), expected, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("use_bias", [False, True])
def test_gate_equals_keras_multi_head_attention(use_bias):
    # Keras's MultiHeadAttention fails on JAX with value_dim != key_dim (its
    # call of JAX's kernel), so the dims differ on the other backends only.
    value_dim = 3 if BACKEND == "jax" else 4
    mha = keras.layers.MultiHeadAttention(
        num_heads=2,
        key_dim=3,
        value_dim=value_dim,
        use_gate=True,
        use_bias=use_bias,
        bias_initializer="random_normal",
    )
    expected = to_numpy(mha(X, X))
    layer = SelfAttention(
        num_heads=2,
        key_dim=3,
        value_dim=value_dim,
        use_gate=True,
        use_bias=use_bias,
        output_dim=X.shape[-1],
    )
    layer.build(X.shape)
    dense = [mha._query_dense, mha._key_dense, mha._value_dense, mha._gate_dense]
    weights = [w for d in dense for w in _copy_dense(d)]
    weights += _copy_dense(mha._output_dense, flat_input=True)
    layer.set_weights(weights)
    np.testing.assert_allclose(to_numpy(layer(X)), expected, atol=2e-5, rtol=1e-5)


def test_rotary_reference_is_keras_hub_formula():
    """The loop reference equals the brief's closed form: halves, tiled
    cos/sin tables, rotate_half = concat(-x2, x1)."""
    x = RNG.normal(size=(7, 6))
    wavelength, factor = 30.0, 2.0
    inverse_freq = 1.0 / wavelength ** (np.arange(0, 6, 2) / 6)
    angles = np.outer(np.arange(7) / factor, inverse_freq)
    angles = np.concatenate([angles, angles], axis=-1)
    rotate_half = np.concatenate([-x[:, 3:], x[:, :3]], axis=-1)
    closed = x * np.cos(angles) + rotate_half * np.sin(angles)
    np.testing.assert_allclose(rotary(x, wavelength, factor), closed, atol=1e-12)


def test_keras_hub_rotary_embedding():
    keras_hub = pytest.importorskip("keras_hub")
    rope = keras_hub.layers.RotaryEmbedding(max_wavelength=30, scaling_factor=2.0)
    x = RNG.normal(size=(2, 7, 3, 6)).astype("float32")  # (B, T, H, D)
    expected = to_numpy(rope(x))
    for b in range(2):
        for h in range(3):
            np.testing.assert_allclose(
                rotary(x[b, :, h].astype(np.float64), 30.0, 2.0),
                expected[b, :, h],
                atol=1e-5,
            )


def test_rope_makes_attention_depend_on_relative_position():
    """Rotary scores depend on positions only through their difference: a
    sequence shifted by one step (same tokens, causal) gives the same
    outputs at the shifted positions."""
    layer = SelfAttention(num_heads=2, rope_max_wavelength=100.0, causal=True)
    x = X[:1]
    shifted = np.concatenate([np.zeros_like(x[:, :1]), x], axis=1)
    mask = np.ones(shifted.shape[:2], bool)
    mask[:, 0] = False
    out = to_numpy(layer(x))
    out_shifted = to_numpy(layer(shifted, mask=mask))
    np.testing.assert_allclose(out_shifted[:, 1:], out, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({"num_heads": 4, "num_key_value_heads": 3}, "num_key_value_heads=3"),
        ({"num_key_value_heads": 0}, "num_key_value_heads=0"),
        ({"num_key_value_heads": 1.5}, "num_key_value_heads=1.5"),
        ({"use_gate": 1}, "use_gate=1"),
        ({"rope_max_wavelength": 0}, "rope_max_wavelength=0"),
        ({"rope_max_wavelength": -10.0}, "rope_max_wavelength=-10.0"),
        ({"rope_max_wavelength": float("inf")}, "rope_max_wavelength=inf"),
        ({"rope_scaling_factor": 0.0}, "rope_scaling_factor=0.0"),
        ({"rope_scaling_factor": None}, "rope_scaling_factor=None"),
        ({"rope_max_wavelength": 100.0, "key_dim": 3}, "key_dim=3"),
    ],
)
def test_arguments_are_validated(config, match):
    with pytest.raises(ValueError, match=match):
        SelfAttention(**config)


def test_odd_default_key_dim_with_rope_is_rejected_at_build():
    layer = SelfAttention(num_heads=2, rope_max_wavelength=100.0)
    with pytest.raises(ValueError, match="key_dim=3"):
        layer(np.zeros((1, 4, 6), "float32"))


def test_config_round_trip():
    layer = SelfAttention(**FEATURES["all_causal"])
    config = layer.get_config()
    assert config["num_key_value_heads"] == 1
    assert config["use_gate"] is True
    assert config["rope_max_wavelength"] == 10000.0
    assert config["rope_scaling_factor"] == 0.5
    clone = SelfAttention.from_config(config)
    assert clone.get_config() == config
    layer.build(X.shape)
    clone.build(X.shape)
    clone.set_weights(layer.get_weights())
    np.testing.assert_allclose(to_numpy(clone(X)), to_numpy(layer(X)), atol=1e-6)
    defaults = SelfAttention().get_config()
    assert defaults["num_key_value_heads"] is None
    assert defaults["use_gate"] is False
    assert defaults["rope_max_wavelength"] is None
    assert defaults["rope_scaling_factor"] == 1.0
