"""Bad arguments and inputs raise ValueError naming the argument and value."""

import re

import numpy as np
import pytest

from keras_selfattn import SelfAttention


@pytest.mark.parametrize(
    "name, value",
    [
        ("num_heads", 0),
        ("num_heads", -2),
        ("num_heads", 1.5),
        ("num_heads", True),
        ("num_heads", None),
        ("key_dim", 0),
        ("value_dim", -1),
        ("output_dim", 0),
        ("output_dim", "8"),
        ("scale", 0.0),
        ("scale", -1.0),
        ("scale", float("nan")),
        ("scale", float("inf")),
        ("scale", 1e308),  # beyond float32: the scores would be inf
        ("scale", "big"),
        ("sliding_window", 0),
        ("sliding_window", -3),
        ("dropout", -0.1),
        ("dropout", 1.0),
        ("dropout", 1.5),
        ("use_bias", "yes"),
        ("causal", 1),
        ("seed", 1.5),
    ],
)
def test_bad_constructor_arguments(name, value):
    received = re.escape(f"Received: {name}={value!r}")
    with pytest.raises(ValueError, match=rf"`{name}`.*{received}"):
        SelfAttention(**{name: value})


def test_default_key_dim_must_divide_features():
    layer = SelfAttention(num_heads=3)
    with pytest.raises(ValueError, match=r"features=4.*num_heads=3.*key_dim=None"):
        layer.build((None, None, 4))
    # An explicit key_dim lifts the constraint.
    layer = SelfAttention(num_heads=3, key_dim=2)
    assert layer(np.ones((1, 2, 4), "float32")).shape == (1, 2, 6)


@pytest.mark.parametrize("shape", [(2, 4), (2, 3, 4, 5), (4,)])
def test_wrong_input_rank(shape):
    with pytest.raises(ValueError, match=r"rank 3.*Received: inputs.shape="):
        SelfAttention()(np.ones(shape, "float32"))


def test_unknown_feature_size():
    with pytest.raises(
        ValueError, match=r"features.*inputs.shape=\(None, None, None\)"
    ):
        SelfAttention().build((None, None, None))


def test_feature_size_must_match_built_weights():
    layer = SelfAttention()
    layer(np.ones((1, 3, 4), "float32"))
    with pytest.raises(ValueError, match=r"built for features=4.*\(1, 3, 5\)"):
        layer(np.ones((1, 3, 5), "float32"))


def test_none_initializers_take_keras_defaults():
    """`initializers.get(None)` is None: the weights take Keras's defaults
    (found by the slow config fuzz: the projections failed on None)."""
    layer = SelfAttention(
        num_heads=2,
        output_dim=3,
        use_bias=True,
        bias_initializer=None,
        kernel_initializer=None,
    )
    out = layer(np.ones((1, 4, 6), "float32"))
    assert tuple(out.shape) == (1, 4, 3)
    assert len(layer.get_weights()) == 8
