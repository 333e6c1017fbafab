"""The contract for a query with nothing to attend, on every path.

A query row that may attend no key (a padded position, or a row of
`attention_mask` that allows none after the other masks) outputs exactly
zero, after the output projection and its bias too, and its gradients are
finite. Checked against the numpy reference, which zeroes such rows itself.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

from keras_selfattn import SelfAttention
from tests.backend import BACKEND, to_numpy, value_and_grad
from tests.reference import for_layer

X = np.random.default_rng(3).normal(size=(2, 6, 4)).astype("float32")
ATTENTION = np.ones((2, 6, 6), bool)
ATTENTION[0, 1] = False  # row 1 of sequence 0 may attend nothing
ATTENTION[1, 4, :4] = False  # row 4 of sequence 1: only keys 4 and 5
CONFIGS = {
    "projection_bias": {"output_dim": 3, "use_bias": True},
    "projection_no_bias": {"output_dim": 3},
    "no_projection_bias": {"use_bias": True},
    "causal": {"causal": True, "output_dim": 3, "use_bias": True},
    "window": {"sliding_window": 2, "output_dim": 3, "use_bias": True},
    "chunked": {"chunk_size": 4, "output_dim": 3, "use_bias": True},
    "chunked_causal": {
        "chunk_size": 4,
        "causal": True,
        "output_dim": 3,
        "use_bias": True,
    },
}


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("with_padding", [False, True])
def test_rows_with_nothing_to_attend_output_zero(config, with_padding):
    layer = SelfAttention(num_heads=2, bias_initializer="ones", **CONFIGS[config])
    layer.build(X.shape)
    masks = {"attention_mask": ATTENTION}
    if with_padding:
        masks["mask"] = np.arange(6)[None, :] < np.array([[6], [3]])
    output = to_numpy(layer(X, **masks))
    expected, weights = for_layer(
        layer, X, padding_mask=masks.get("mask"), attention_mask=ATTENTION
    )
    empty = ~weights.any(axis=(1, 3))
    assert empty[0, 1]  # the reference agrees which rows are empty
    assert (output[empty] == 0).all()
    np.testing.assert_allclose(output, expected, atol=2e-5, rtol=1e-5)

    def loss(x):
        return keras.ops.sum(layer(x, **masks))

    _, grads = value_and_grad(loss, layer.trainable_variables, [X])
    for grad in grads:
        assert grad is None or np.isfinite(grad).all()


def test_returned_weights_of_empty_rows_are_zero():
    layer = SelfAttention(num_heads=2, output_dim=3, use_bias=True)
    _, weights = layer(X, attention_mask=ATTENTION, return_attention_scores=True)
    weights = to_numpy(weights)
    assert (weights[0, :, 1] == 0).all()
    np.testing.assert_allclose(weights[1, :, 4].sum(-1), 1.0, rtol=1e-6)


@pytest.mark.skipif(BACKEND == "tensorflow", reason="no fused path on TensorFlow")
def test_fused_path_padded_rows_output_zero():
    """The fused path with an output bias: padded positions are zero too."""
    mask = np.arange(6)[None, :] < np.array([[6], [0]])  # one all-padding row
    layer = SelfAttention(
        num_heads=2,
        output_dim=3,
        use_bias=True,
        bias_initializer="ones",
        causal=True,
        flash_attention=True,
    )
    output = to_numpy(layer(X, mask=mask))
    assert (output[1] == 0).all()
    np.testing.assert_allclose(
        output, for_layer(layer, X, padding_mask=mask)[0], atol=2e-5, rtol=1e-5
    )
