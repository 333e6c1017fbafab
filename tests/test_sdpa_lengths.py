"""PyTorch's kernel on a right-padded batch without a mask
(`attention.fused.sdpa_lengths`), run here on the CPU: its output and gradients
against float64 autograd through the masked softmax formula, a batch that is
not right-padded handed back, and the layer's fused path through it against
the numpy reference."""

from __future__ import annotations

import numpy as np
import pytest

from tests import reference
from tests.backend import BACKEND

pytestmark = pytest.mark.skipif(
    BACKEND != "torch", reason="PyTorch's kernel only (KERAS_BACKEND=torch)"
)

RNG = np.random.default_rng(29)
LENGTHS = [5, 0, 3, 5, 3, 1]  # full, empty, repeated and single lengths


def _masked_reference(query, key, value, padding, causal, scale):
    """float64 softmax(Q K^T * scale, masked) V over (B, T, H, D) tensors,
    key and value repeated to the query's heads; zeros at padded queries."""
    import torch

    groups = query.shape[2] // key.shape[2]
    query, key, value = (t.transpose(1, 2) for t in (query, key, value))
    key, value = (t.repeat_interleave(groups, dim=1) for t in (key, value))
    time = padding.shape[1]
    allowed = padding[:, None, None, :] & padding[:, None, :, None]
    if causal:
        allowed = allowed & torch.ones(time, time, dtype=bool).tril()
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    weights = torch.nan_to_num(torch.softmax(scores, dim=-1))  # empty rows: 0
    return torch.matmul(weights, value).transpose(1, 2)


def _padding(lengths, time):
    return np.arange(time)[None, :] < np.asarray(lengths)[:, None]


@pytest.mark.parametrize(("causal", "key_heads"), [(False, 4), (True, 2)])
def test_output_and_gradients_equal_float64_autograd(causal, key_heads):
    import torch

    from keras_selfattn.attention.fused import sdpa_lengths

    batch, time = len(LENGTHS), 5
    shapes = [(batch, time, 4, 8), (batch, time, key_heads, 8)]
    shapes.append((batch, time, key_heads, 6))
    arrays = [RNG.normal(size=shape) for shape in shapes]
    padding = torch.tensor(_padding(LENGTHS, time))
    grad = RNG.normal(size=(batch, time, 4, 6)) * padding.numpy()[:, :, None, None]

    def kernel(q, k, v):
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=causal, scale=0.3, enable_gqa=key_heads != 4
        )
        return out.transpose(1, 2)

    results = []
    for dtype in (torch.float32, torch.float64):
        tensors = [torch.tensor(a, dtype=dtype, requires_grad=True) for a in arrays]
        if dtype == torch.float32:
            output = sdpa_lengths.attention(*tensors, padding, kernel)
        else:
            output = _masked_reference(*tensors, padding, causal, 0.3)
        output.backward(torch.tensor(grad, dtype=dtype))
        results.append([output] + [t.grad for t in tensors])
    for got, want in zip(*results, strict=True):
        np.testing.assert_allclose(
            got.detach().numpy(), want.detach().numpy(), rtol=2e-5, atol=2e-5
        )
    assert np.all(results[0][0].detach().numpy()[1] == 0)  # the empty row


def test_a_batch_that_is_not_right_padded_is_handed_back():
    import torch

    from keras_selfattn.attention.fused import sdpa_lengths

    padding = torch.tensor(_padding([3, 2], 4))
    padding[1] = torch.tensor([False, True, True, False])
    query = torch.zeros((2, 4, 1, 2))
    assert sdpa_lengths.attention(query, query, query, padding, None) is None
    assert not sdpa_lengths.applies(query, query, padding)  # on the CPU


@pytest.mark.parametrize("causal", [False, True])
def test_the_layer_through_it_matches_the_reference(monkeypatch, causal):
    """The fused path with the per-length kernel calls (let in on the CPU
    here; on a GPU it takes them by itself), against numpy."""
    from keras_selfattn import SelfAttention
    from keras_selfattn.attention.fused import sdpa_lengths
    from tests.backend import to_numpy

    calls = []

    def applies(query, key, padding):
        calls.append(padding is not None)
        return padding is not None

    monkeypatch.setattr(sdpa_lengths, "applies", applies)
    x = RNG.normal(size=(len(LENGTHS), 5, 8)).astype("float32")
    padding = _padding(LENGTHS, 5)
    layer = SelfAttention(num_heads=4, num_key_value_heads=2, causal=causal)
    layer.build(x.shape)
    assert layer.implementation(x, mask=padding) == "fused"
    got = to_numpy(layer(x, mask=padding))
    want = reference.output_for_call(layer, x, {"mask": padding})
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert calls == [True]
