"""`rotary.rotate` turns each pair (x[i], x[i + R/2]) of the first R
features by its position's angle and passes the other D - R features as
they are, in both layouts (the pairs written out one by one in numpy)."""

from __future__ import annotations

import numpy as np
import pytest
from keras import ops

from keras_selfattn.attention import heads, rotary

B, T, H, D = 2, 5, 3, 8


def _pairs_turned(x: np.ndarray, rotary_dim: int, offset: int) -> np.ndarray:
    """(B, T, H, D) `x` with each position's pairs turned, one by one."""
    half = rotary_dim // 2
    out = x.astype(np.float64)
    for t in range(T):
        for i in range(half):
            angle = (offset + t) / 10000.0 ** (2 * i / rotary_dim)
            c, s = np.cos(angle), np.sin(angle)
            first, second = x[:, t, :, i], x[:, t, :, i + half]
            out[:, t, :, i] = first * c - second * s
            out[:, t, :, i + half] = second * c + first * s
    return out


@pytest.mark.parametrize("rotary_dim", [D, D // 2], ids=["all", "partial"])
@pytest.mark.parametrize("layout", [heads.TIME_FIRST, heads.HEADS_FIRST])
def test_rotate_turns_each_pair_and_passes_the_rest(rotary_dim, layout):
    x = np.random.default_rng(3).standard_normal((B, T, H, D)).astype(np.float32)
    offset = 4
    table = rotary.table(T, D, 10000.0, offset=offset, rotary_dim=rotary_dim)
    given = x if layout == heads.TIME_FIRST else x.transpose(0, 2, 1, 3)
    turned = ops.convert_to_numpy(
        rotary.rotate(ops.convert_to_tensor(given), layout, table, rotary_dim)
    )
    if layout == heads.HEADS_FIRST:
        turned = turned.transpose(0, 2, 1, 3)
    np.testing.assert_allclose(
        turned, _pairs_turned(x, rotary_dim, offset), rtol=2e-6, atol=2e-6
    )
    # The passing features are x's own, bit for bit.
    np.testing.assert_array_equal(turned[..., rotary_dim:], x[..., rotary_dim:])
