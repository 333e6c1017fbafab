"""PyTorch's attention kernel on a right-padded batch, without a mask.

Any `attn_mask` takes `torch.nn.functional.scaled_dot_product_attention` off
its flash kernel on a GPU, and a Keras padding mask is one. When every row of
a batch is right-padded (its real positions first), a real query's output
depends on its row's first L positions only (L the row's length): `attention`
groups the rows by length and runs the kernel once per length on the rows'
first L positions, with no mask (the causal band as `is_causal`), so each
call can take the flash kernel. Padded queries and rows with no real
position get zeros (the layer zeroes padded queries anyway). The rows come
back in their order through one gather, which autograd differentiates.

Only for eager calls on a GPU (`applies`): the lengths are read on the host
(one synchronisation), which a tracer cannot do, and on the CPU the flash
kernel takes the boolean mask itself. A batch that is not right-padded
gives None, and the caller masks it.

Shapes use B = batch, T = time, H = heads, G = key/value heads, K =
key_dim, V = value_dim.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from keras_selfattn import tracing


def applies(query, key, padding) -> bool:
    """Whether `attention` may compute this call: a padding mask on
    queries and keys of one length, on a GPU, and no tracer (PyTorch's
    exporters and `torch.compile` trace the kernel itself)."""
    return (
        padding is not None
        and query.device.type == "cuda"
        and query.shape[1] == key.shape[1]
        and not tracing.torch_traced()
    )


def attention(
    query,
    key,
    value,
    padding,
    kernel: Callable,
) -> torch.Tensor | None:
    """The attention of a right-padded batch, one kernel call per length.

    Args:
        query: (B, T, H, K).
        key: (B, T, G, K).
        value: (B, T, G, V).
        padding: bool (B, T), True for real positions.
        kernel: `kernel(query, key, value)` on (b, L, ...) slices without a
            mask (the caller's own band and scale), returning (b, L, H, V).

    Returns:
        (B, T, H, V), zeros at padded queries; None if a row of `padding`
        is not right-padded.
    """
    batch, time = padding.shape
    lengths = padding.sum(dim=1)
    positions = torch.arange(time, device=padding.device)
    right_padded = torch.equal(padding, positions[None, :] < lengths[:, None])
    if not right_padded:
        return None
    order, parts = [], []
    zeros = query.new_zeros(())
    for length in sorted(set(lengths.tolist())):
        rows = torch.nonzero(lengths == length).flatten()
        order.append(rows)
        if length == 0:
            shape = (len(rows), time, query.shape[2], value.shape[3])
            parts.append(zeros.expand(shape))
            continue
        out = kernel(query[rows, :length], key[rows, :length], value[rows, :length])
        parts.append(torch.nn.functional.pad(out, (0, 0, 0, 0, 0, time - length)))
    inverse = torch.empty(batch, dtype=torch.long, device=padding.device)
    inverse[torch.cat(order)] = torch.arange(batch, device=padding.device)
    return torch.cat(parts)[inverse]
