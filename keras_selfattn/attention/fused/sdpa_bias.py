"""PyTorch's attention kernel on the CPU with a float mask that takes a gradient.

`torch.nn.functional.scaled_dot_product_attention` on the CPU runs its flash
kernel for a float `attn_mask`, unless the mask requires grad (a learned
bias: T5's relative bias, an `attention_bias` computed from weights, called
with gradients recorded): its flash kernel has no gradient for the mask, so
it falls back to its math kernel, much slower (docs/performance.md).
`attention` runs the flash kernel forward
(inside an autograd Function, with the mask detached) and computes every
gradient by hand in the backward pass, from weights recomputed there:

    P = softmax(Q K^T * scale + M)
    dS = P * (dO V^T - rowsum(dO * O))
    dQ = dS K * scale,  dK = dS^T Q * scale,  dV = P^T dO,
    dM = dS summed over the axes M broadcasts.

Masked entries of M are `MASK_VALUE` (finite), so P and dS are 0 there.

Shapes use B = batch, H = heads, Tq, Tk = query and key time, K = key_dim,
V = value_dim.
"""

from __future__ import annotations

import torch

from keras_selfattn import tracing


def applies(query, mask) -> bool:
    """Whether `attention` should compute this call: a float mask that
    requires grad, on the CPU, gradients recorded, and no tracer (PyTorch's
    exporters and `torch.compile` trace the kernel itself)."""
    return (
        mask is not None
        and mask.is_floating_point()
        and mask.requires_grad
        and torch.is_grad_enabled()
        and query.device.type == "cpu"
        and not tracing.torch_traced()
    )


class _Attention(torch.autograd.Function):
    """The flash kernel forward; the gradients of the module docstring."""

    @staticmethod
    def forward(ctx, query, key, value, mask, scale):
        # Detached: the kernel checks the mask's `requires_grad`, which holds
        # here too (where no gradient is recorded).
        output = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=mask.detach(), scale=scale
        )
        ctx.save_for_backward(query, key, value, mask, output)
        ctx.scale = scale
        return output

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        query, key, value, mask, output = ctx.saved_tensors
        scale = ctx.scale
        need_query, need_key, need_value, need_mask, _ = ctx.needs_input_grad
        scores = torch.matmul(query, key.transpose(-1, -2)).mul_(scale).add_(mask)
        weights = torch.softmax(scores, dim=-1)
        del scores
        grad_scores = torch.matmul(grad, value.transpose(-1, -2))
        grad_scores.sub_((grad * output).sum(-1, keepdim=True)).mul_(weights)
        grad_value = (
            torch.matmul(weights.transpose(-1, -2), grad) if need_value else None
        )
        del weights
        grad_query = torch.matmul(grad_scores, key).mul_(scale) if need_query else None
        grad_key = (
            torch.matmul(grad_scores.transpose(-1, -2), query).mul_(scale)
            if need_key
            else None
        )
        grad_mask = grad_scores.sum_to_size(mask.shape) if need_mask else None
        return grad_query, grad_key, grad_value, grad_mask, None


def attention(query, key, value, mask, scale: float):
    """softmax(Q K^T * scale + mask) V through the flash kernel.

    Args:
        query: float32 (B, H, Tq, K).
        key: float32 (B, G, Tk, K), G dividing H (grouped-query heads:
            query head h uses key and value head h // (H / G)).
        value: float32 (B, G, Tk, V).
        mask: float32 broadcastable to (B, H, Tq, Tk), no row all
            `MASK_VALUE`.
        scale: Multiplier of the raw scores.

    Returns:
        (B, H, Tq, V), with gradients for every input that requires them.
    """
    groups = query.shape[1] // key.shape[1]
    if groups != 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    return _Attention.apply(query, key, value, mask, scale)
