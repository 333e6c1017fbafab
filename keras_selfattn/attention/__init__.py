"""Attention implementations behind `SelfAttention`, and how one is chosen.

Each call takes one of five paths, `fused`, `single_query`, `packed`,
`chunked` and `explicit`, all with one signature (`dispatch`'s docstring).
Its rooms (subpackages) and modules, one line each:

- `dispatch`: which path a call takes (`IMPLEMENTATIONS`, `choose`): what
  each cannot do, read against the call's static facts;
- `call_facts`: those facts (`CallFacts`), the tables of choices over them
  (`Limit`, `first`), and the tracing contexts they read;
- `fused/`: the fused path, the backend's own kernel; its variants chosen
  by `fused.VARIANTS` (`sdpa_bias`, `sdpa_lengths`: PyTorch's kernel with
  a learned float mask, and per row length);
- `single_query`: the single-query path, one new position attending a
  key/value cache in its own layout;
- `packed/`: the packed path (`segment_ids`), its strategies chosen by
  `packed.STRATEGIES` (`runs`, `pairs`, `loop`) and the loop's gradient by
  `packed.GRADIENTS` (`own_gradient`), over the blocks of `blocks`;
- `chunked`: the chunked path, exact attention one block of queries at a
  time;
- `explicit`: the explicit path, the full weights materialized;
- `cache/`: the key/value cache for decoding: its classes, one per layout
  (`layouts`), and the door to its checks (`checks`), writes (`writes`)
  and where a call runs (`environment`);
- `masks`: one description of what each query may attend (`Masks`), with
  the causal and sliding-window formulas written once, dense or per block;
- `score_mods`: the score modifications (`ScoreMods`), their formulas per
  block;
- `rotary`: rotary position embedding of projected queries and keys;
- `heads`: the `(B, T, H, D)` layout the implementations share, and
  splitting into heads and merging back;
- `dropout`: dropout from a per-call seed, the same in a recomputed block;
- `nan_safe`: selects that keep NaN and inf out of what they do not choose;
- `backend_ops`: Keras ops as the backend's own call where a PyTorch
  decoding step runs them eagerly.
"""

from keras_selfattn.attention.dispatch import IMPLEMENTATIONS, choose
from keras_selfattn.attention.dropout import SeededDropout
from keras_selfattn.attention.masks import Masks

__all__ = ["IMPLEMENTATIONS", "Masks", "SeededDropout", "choose"]
