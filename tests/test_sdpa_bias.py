"""PyTorch's kernel with a learned float mask (`attention.fused.sdpa_bias`): its
output and every gradient against float64 autograd through the explicit
softmax formula, and the layer's fused path against its explicit path."""

from __future__ import annotations

import numpy as np
import pytest

from tests.backend import BACKEND

pytestmark = pytest.mark.skipif(
    BACKEND != "torch", reason="PyTorch's CPU kernel only (KERAS_BACKEND=torch)"
)

RNG = np.random.default_rng(73)


def _reference(query, key, value, mask, scale):
    """float64 softmax(Q K^T * scale + mask) V, key and value repeated."""
    import torch

    groups = query.shape[1] // key.shape[1]
    key, value = (t.repeat_interleave(groups, dim=1) for t in (key, value))
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale + mask
    return torch.matmul(torch.softmax(scores, dim=-1), value)


@pytest.mark.parametrize(
    ("key_heads", "mask_shape"),
    [(4, (1, 4, 5, 6)), (2, (3, 1, 5, 6)), (1, (3, 4, 5, 6))],
)
def test_output_and_gradients_equal_float64_autograd(key_heads, mask_shape):
    import torch

    from keras_selfattn.attention.explicit import MASK_VALUE
    from keras_selfattn.attention.fused import sdpa_bias

    shapes = [(3, 4, 5, 8), (3, key_heads, 6, 8), (3, key_heads, 6, 7), mask_shape]
    arrays = [RNG.normal(size=shape) for shape in shapes]
    arrays[3][..., 0, 1:4] = MASK_VALUE  # masked keys: no weight, no gradient
    grad = RNG.normal(size=(3, 4, 5, 7))
    results = []
    for dtype in (torch.float32, torch.float64):
        tensors = [torch.tensor(a, dtype=dtype, requires_grad=True) for a in arrays]
        if dtype == torch.float32:
            assert sdpa_bias.applies(tensors[0], tensors[3])
            output = sdpa_bias.attention(*tensors, scale=0.3)
        else:
            output = _reference(*tensors, scale=0.3)
        output.backward(torch.tensor(grad, dtype=dtype))
        results.append([output] + [t.grad for t in tensors])
    for got, want in zip(*results, strict=True):
        np.testing.assert_allclose(
            got.detach().numpy(), want.detach().numpy(), rtol=2e-5, atol=2e-5
        )
    assert np.all(results[0][4].numpy()[..., 0, 1:4] == 0)


def test_not_without_gradients_nor_for_a_plain_mask():
    import torch

    from keras_selfattn.attention.fused import sdpa_bias

    query = torch.zeros((1, 1, 2, 2))
    learned = torch.zeros((1, 1, 2, 2), requires_grad=True)
    assert not sdpa_bias.applies(query, learned.detach())
    assert not sdpa_bias.applies(query, torch.ones((1, 1, 2, 2), dtype=bool))
    with torch.no_grad():
        assert not sdpa_bias.applies(query, learned)


def test_the_fused_path_learns_as_the_explicit_path_does():
    import keras

    from keras_selfattn import SelfAttention
    from tests.backend import to_numpy, value_and_grad

    x = RNG.normal(size=(2, 6, 8)).astype("float32")
    padding = np.ones((2, 6), bool)
    padding[1, 4:] = False
    bias = RNG.normal(size=(2, 1, 6, 6)).astype("float32")
    results = []
    for flash_attention in (None, False):
        keras.utils.set_random_seed(1)
        layer = SelfAttention(
            num_heads=4,
            num_key_value_heads=2,
            position_bias="relative",
            relative_attention_num_buckets=6,
            relative_attention_max_distance=4,
            flash_attention=flash_attention,
        )
        layer.build((None, None, 8))
        layer.relative_attention_bias.assign(
            np.random.default_rng(2).normal(size=(6, 4)).astype("float32")
        )
        assert layer.implementation(x, mask=padding) == (
            "fused" if flash_attention is None else "explicit"
        )

        def loss(x, bias, layer=layer):
            y = layer(x, mask=padding, attention_bias=bias)
            return keras.ops.sum(keras.ops.square(y))

        results.append(value_and_grad(loss, layer.trainable_weights, [x, bias]))
    (loss_fused, grads_fused), (loss_explicit, grads_explicit) = results
    np.testing.assert_allclose(loss_fused, loss_explicit, rtol=2e-5)
    for got, want in zip(grads_fused, grads_explicit, strict=True):
        np.testing.assert_allclose(to_numpy(got), to_numpy(want), rtol=2e-5, atol=2e-5)
