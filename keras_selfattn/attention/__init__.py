"""Attention implementations behind `SelfAttention`, and how one is chosen.

- `masks`: one description of what each query may attend (`Masks`), with the
  causal and sliding-window formulas written once, dense or per block;
- `heads`: the `(B, T, H, D)` layout the implementations share;
- `explicit`, `chunked`, `fused`: the implementations, one signature;
- `dispatch`: which one a call takes: what each cannot do, read against the
  call's static facts;
- `dropout`: dropout from a per-call seed, the same in a recomputed block.
"""

from keras_selfattn.attention.dispatch import IMPLEMENTATIONS, choose
from keras_selfattn.attention.dropout import SeededDropout
from keras_selfattn.attention.masks import Masks

__all__ = ["IMPLEMENTATIONS", "Masks", "SeededDropout", "choose"]
