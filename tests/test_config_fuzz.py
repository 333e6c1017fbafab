"""Fuzzing SelfAttention.from_config with hostile configs.

Hypothesis starts from a real config (`get_config()` of a built layer) and
replaces values with wrong types, negatives, zero, huge integers, floats and
bools where ints belong, NaN/inf, broken initializer/regularizer/constraint
identifiers and dtype policies; it also drops keys and adds unknown ones.

The contract checked for every config:
- `from_config` either raises ValueError or TypeError, or returns a layer;
- a returned layer either raises ValueError when built, or builds, runs on a
  small input (inference and training) with a finite output of the declared
  shape, computes what the numpy reference computes for its own settings,
  and survives a get_config/from_config round trip.
Nothing else is accepted: no other exception type, no NaN, no silently
wrong layer. Runs are reproducible (derandomized, no example database).
"""

from __future__ import annotations

import math

import keras
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from keras_selfattn import SelfAttention
from tests.backend import BACKEND, to_numpy
from tests.reference import for_layer

FEATURES = 6
NAN, INF = math.nan, math.inf

# fmt: off
# Values that are wrong somewhere (or everywhere) in a config.
HOSTILE = [
    None, True, False, 0, -1, 1, 2, 3, 6, 2**31, 2**40, 2**63, 10**30, -(2**63) - 1,
    0.0, 0.5, 1.5, 2.0, -0.5, 1e308, NAN, INF, -INF,
    np.int64(2), np.float32(0.25), np.bool_(True), np.float64(NAN),
    "", "2", "float32", "glorot_uniform", [], [1, 2], {}, (1,), {"class_name": "Foo"},
]
INITIALIZERS = [
    "zeros", "ones", "glorot_uniform", "he_normal", "orthogonal", "Lambda", "nope",
    {"class_name": "RandomNormal", "config": {"stddev": NAN}},
    {"class_name": "RandomUniform", "config": {"minval": -INF}},
    {"class_name": "RandomNormal", "config": {"mean": "x"}},
    {"class_name": "RandomNormal", "config": {"bogus": 1}},
    {"class_name": "RandomNormal", "config": 5},
    {"class_name": "Constant", "config": {"value": [1.0, 2.0]}},
    {"class_name": "Constant", "config": {"value": INF}},
    {"class_name": "Orthogonal", "config": {"gain": "a"}},
    {"class_name": "VarianceScaling", "config": {"scale": -1.0}},
    {"module": "os", "class_name": "system", "config": {"command": "true"}},
]
REGULARIZERS = [
    "l1", "l2", "nope",
    {"class_name": "L2", "config": {"l2": NAN}},
    {"class_name": "L1L2", "config": {"l1": INF, "l2": 0.1}},
    {"class_name": "L1", "config": {"l1": -1.0}},
]
CONSTRAINTS = [
    "max_norm", "non_neg", "unit_norm", "nope",
    {"class_name": "MaxNorm", "config": {"max_value": NAN}},
    {"class_name": "MinMaxNorm", "config": {"min_value": 0.0, "max_value": INF}},
]
DTYPES = [
    "float32", "float64", "mixed_float16", "mixed_bfloat16", "float16",
    "int32", "int64", "bool", "uint8", "string", "complex64", "nope",
]
OBJECT_KEYS = {
    "kernel_initializer": INITIALIZERS,
    "bias_initializer": INITIALIZERS,
    "kernel_regularizer": REGULARIZERS,
    "bias_regularizer": REGULARIZERS,
    "activity_regularizer": REGULARIZERS,
    "kernel_constraint": CONSTRAINTS,
    "bias_constraint": CONSTRAINTS,
    "dtype": DTYPES,
}
UNKNOWN_KEYS = ["heads", "units", "mask", "query", "causal_mask", "attention_axes"]
# fmt: on


def _base_config() -> dict:
    layer = SelfAttention(
        num_heads=2,
        key_dim=3,
        value_dim=2,
        output_dim=5,
        use_bias=True,
        causal=True,
        sliding_window=3,
        dropout=0.25,
        seed=1,
    )
    layer.build((None, None, FEATURES))
    return layer.get_config()


BASE = _base_config()


@st.composite
def configs(draw) -> dict:
    config = dict(BASE)
    for key in draw(st.lists(st.sampled_from(sorted(BASE)), max_size=5, unique=True)):
        pool = OBJECT_KEYS.get(key, [])
        config[key] = draw(st.sampled_from(pool + HOSTILE))
    for key in draw(st.lists(st.sampled_from(sorted(config)), max_size=3, unique=True)):
        del config[key]
    for key in draw(st.lists(st.sampled_from(UNKNOWN_KEYS), max_size=1)):
        config[key] = draw(st.sampled_from(HOSTILE))
    return config


def _check_contract(config) -> None:
    try:
        layer = SelfAttention.from_config(config)
    except (ValueError, TypeError):
        return
    try:
        layer.build((None, None, FEATURES))
    except ValueError:
        return
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 3, FEATURES)).astype("float32")
    output = layer(x, training=False)
    trained = layer(x, training=True)
    width = layer.compute_output_shape((2, 3, FEATURES))[-1]
    for result in (output, trained):
        assert tuple(result.shape) == (2, 3, width)
        assert keras.backend.is_float_dtype(result.dtype)
        assert np.isfinite(to_numpy(keras.ops.cast(result, "float32"))).all()
    if layer.compute_dtype in ("float32", "float64"):
        np.testing.assert_allclose(
            to_numpy(output), for_layer(layer, x)[0], rtol=1e-4, atol=1e-5
        )
    clone = SelfAttention.from_config(layer.get_config())
    assert clone.get_config() == layer.get_config()


_SETTINGS = {
    "deadline": None,
    "derandomize": True,
    "database": None,
    "suppress_health_check": [HealthCheck.too_slow],
}


# 300 configurations in `make test` on PyTorch, 40 on JAX (its eager calls
# compile every new shape), TensorFlow's in its slow suite; in the slow
# suite 1000, 200 on JAX.
@pytest.mark.slow_on("tensorflow", "300 configurations: 9 s; the other suites run it")
@settings(max_examples=40 if BACKEND == "jax" else 300, **_SETTINGS)
@given(configs())
def test_from_config_contract(config):
    _check_contract(config)


@pytest.mark.slow
@settings(max_examples=200 if BACKEND == "jax" else 1000, **_SETTINGS)
@given(configs())
def test_from_config_contract_long(config):
    _check_contract(config)


@pytest.mark.parametrize(
    "key, value",
    [
        ("key_dim", 2**31),
        ("value_dim", 2**40),
        ("output_dim", 2**62),
        ("num_heads", 10**30),
        ("sliding_window", 2**63),
        ("chunk_size", 2**63),
        ("seed", 2**64),
        ("dtype", "int32"),
        ("dtype", "string"),
        ("dtype", {"class_name": "Foo"}),
        (
            "kernel_initializer",
            {"class_name": "RandomNormal", "config": {"stddev": NAN}},
        ),
        ("bias_initializer", {"class_name": "Constant", "config": {"value": INF}}),
    ],
)
def test_values_rejected_at_construction(key, value):
    """The holes the fuzzing found: each is now a ValueError naming the key.

    (`from_config` mostly re-raises it as Keras's TypeError "Error when
    deserializing class ...", which quotes the ValueError's message.)
    """
    config = {**BASE, key: value}
    with pytest.raises(ValueError, match=f"`{key}`"):
        SelfAttention(**config)
    with pytest.raises((TypeError, ValueError), match=f"`{key}`"):
        SelfAttention.from_config(config)


@pytest.mark.parametrize(
    "config",
    [
        {"num_heads": 2**16, "key_dim": 2**16},  # 6 * 2**32 elements
        {"num_heads": 1, "output_dim": 2**30, "value_dim": 2**2},
        {
            "kernel_initializer": {
                "class_name": "Constant",
                "config": {"value": [1.0, 2.0]},
            }
        },
        {"kernel_initializer": {"class_name": "RandomNormal", "config": {"mean": "x"}}},
    ],
)
def test_unbuildable_configs_raise_value_error_at_build(config):
    layer = SelfAttention.from_config(config)
    with pytest.raises(ValueError, match="SelfAttention"):
        layer.build((None, None, FEATURES))


@pytest.mark.parametrize("config", [None, 5, "num_heads=2", [("num_heads", 2)]])
def test_non_dict_config_raises_type_error(config):
    with pytest.raises(TypeError):
        SelfAttention.from_config(config)
