"""The fused path: the backend's own attention kernel.

- JAX: `jax.nn.dot_product_attention`, which is cuDNN's flash attention on
  a GPU (in half precision) and XLA's attention elsewhere. A Keras padding
  mask is passed as sequence lengths, which cuDNN takes without building a
  (T, T) mask, when the batch is right-padded; a batch that is not takes the
  same function with a boolean key mask (`lax.cond`, decided per batch at
  run time, so every batch gets exact masking). `sliding_window` is
  `local_window_size`.
- PyTorch: `torch.nn.functional.scaled_dot_product_attention`, whose flash
  and memory-efficient kernels run on a GPU, and a flash kernel on the CPU.
  An eager right-padded batch on a GPU runs without a mask, one call per
  row length (`sdpa_lengths`), where a mask would take it off flash.

Traced with a time of unknown size (an exporter's symbolic dimension), the
JAX kernel is given the whole mask as a boolean mask (`block`): its own
sequence-length and causal masks are built with `arange` of the length, which
jax2onnx cannot convert. Every argument a kernel needs as a Python value
(`enable_gqa`, `is_causal`) comes from static facts, never from a tensor.

Query, key and value stay in the compute dtype: the kernels accumulate in
float32. Masked keys get weight exactly 0. No row handed to a kernel has all
its keys masked (such rows are padded queries, which the layer zeroes; they
are given every key instead), so no kernel produces NaN, in the forward or
the backward pass.

Shapes use B = batch, T = time, H = heads, K = key_dim, V = value_dim.
"""

from __future__ import annotations

import functools

import keras
from keras import ops

from keras_selfattn.attention import masks as masks_lib
from keras_selfattn.attention import score_mods
from keras_selfattn.attention.call_facts import CallFacts, Limit, allowed, first
from keras_selfattn.attention.explicit import MASK_VALUE
from keras_selfattn.attention.masks import Masks

# The kernel's own masks (a padding mask as lengths, `is_causal`, the
# window) cannot describe these calls: they take the whole mask instead.
_OWN_MASKS: tuple[Limit, ...] = (
    (
        lambda f: f.decoding,
        "decoding with a cache: its queries do not start at key 0, which "
        "is_causal would misplace",
    ),
    (lambda f: f.segments, "the kernels' own masks take no segment_ids"),
)
# PyTorch's kernel takes a bias as its float mask.
_NO_BIAS: Limit = (
    lambda f: bool(set(f.score_mods) & set(score_mods.BIASES)),
    "PyTorch's kernel takes the bias as its mask",
)

# How the fused path computes a call, in the order `fused_attention` prefers
# them: the first that nothing rules out (as `dispatch.IMPLEMENTATIONS`).
# Where a variant also needs what only the tensors tell (`sdpa_lengths`: a
# GPU tensor, no tracer, and a batch whose rows are right-padded), the call
# falls back to the next one that nothing rules out.
VARIANTS: dict[str, tuple[Limit, ...]] = {
    # `jax.nn.dot_product_attention` with its own masks.
    "jax": (
        (lambda f: f.backend != "jax", "JAX's kernel runs on the JAX backend"),
        *_OWN_MASKS,
        (
            lambda f: f.time is None,
            "a time of unknown size: the kernel's own masks are built with "
            "`arange` of the length, which jax2onnx cannot convert",
        ),
    ),
    # `scaled_dot_product_attention` with no mask (the band as `is_causal`).
    "sdpa": (
        (lambda f: f.backend != "torch", "PyTorch's kernel runs on PyTorch"),
        *_OWN_MASKS,
        _NO_BIAS,
        (lambda f: f.key_padding, "a padding mask is a mask"),
    ),
    # One call without a mask per row length (`sdpa_lengths`).
    "sdpa_lengths": (
        (lambda f: f.backend != "torch", "PyTorch's kernel runs on PyTorch"),
        *_OWN_MASKS,
        _NO_BIAS,
        (lambda f: not f.key_padding, "no padding mask to take out"),
    ),
    # The call's whole mask, boolean (with a bias: PyTorch's float mask).
    "whole_mask": (),
}
_HALF = ("float16", "bfloat16")
# JAX's kernels, tried in this order where nothing rules them out (cuDNN may
# still refuse a shape or dtype: then XLA's).
JAX_KERNELS: dict[str, tuple[Limit, ...]] = {
    "cudnn": (
        (lambda f: f.dtype not in _HALF, "cuDNN's kernel is for half precision"),
        (lambda f: not f.on_gpu, "cuDNN's kernel runs on a GPU"),
    ),
    "xla": (),
}


def on_gpu(query) -> bool:
    """Whether `query` lives on an accelerator (where the kernels are flash)."""
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        return jax.devices()[0].platform in ("gpu", "cuda", "rocm", "tpu")
    if backend == "torch":
        return query.device.type != "cpu"
    return False


def _nonempty_rows(mask):
    """`mask` (..., Tq, Tk) with rows that allow no key allowed every key."""
    return ops.logical_or(mask, ops.logical_not(ops.any(mask, axis=-1, keepdims=True)))


@functools.cache
def _compiled_attention():
    """`jax.nn.dot_product_attention` under `jax.jit`, its options static."""
    import jax

    return jax.jit(
        jax.nn.dot_product_attention,
        static_argnames=("scale", "is_causal", "local_window_size", "implementation"),
    )


def _jax_attention(
    query, key, value, masks: Masks, scale: float, facts: CallFacts, bias=None
):
    import jax
    import jax.numpy as jnp

    window = None
    if masks.sliding_window is not None:
        window = (masks.sliding_window - 1, masks.sliding_window - 1)
    implementations = [
        None if name == "xla" else name for name in allowed(JAX_KERNELS, facts)
    ]

    kernel = jax.nn.dot_product_attention

    def attend(**extra):
        def run(implementation):
            return kernel(
                query,
                key,
                value,
                scale=scale,
                is_causal=masks.causal,
                local_window_size=window,
                implementation=implementation,
                bias=bias,
                **extra,
            )

        for implementation in implementations[:-1]:
            try:
                return run(implementation)
            except Exception:  # cuDNN refuses this shape or dtype: use XLA.
                continue
        return run(implementations[-1])

    if not facts.key_padding:
        return attend()
    padding = jnp.asarray(masks.key_padding).astype(bool)
    lengths = jnp.sum(padding, axis=1, dtype="int32")
    real = masks_lib.positions(padding.shape[1])[None, :] < lengths[:, None]
    right_padded = jnp.all(padding == real)

    def by_lengths():
        lengths_or_one = jnp.maximum(lengths, 1)
        return attend(
            query_seq_lengths=lengths_or_one, key_value_seq_lengths=lengths_or_one
        )

    def by_mask():
        return attend(mask=_nonempty_rows(padding[:, None, None, :]))

    if not isinstance(right_padded, jax.core.Tracer):
        # An eager call: its mask is known, so the branch is chosen here (a
        # `lax.cond` of this call's closures would be compiled anew each
        # call), and its kernel is compiled once per shape, not run op by op.
        kernel = _compiled_attention()
        return by_lengths() if bool(right_padded) else by_mask()
    return jax.lax.cond(right_padded, by_lengths, by_mask)


def _sdpa(query, key, value, scale: float, grouped: bool, mask=None, causal=False):
    """torch's scaled_dot_product_attention on (B, T, H, D) tensors; with
    `grouped`, key and value may have fewer heads (grouped-query attention).
    A float `mask` that requires grad goes to `sdpa_bias` on the CPU, where
    the kernel would fall back to its math kernel (what only the tensor and
    autograd tell: `sdpa_bias.applies`).
    """
    import torch

    from keras_selfattn.attention.fused import sdpa_bias  # imports torch

    query, key, value = (t.transpose(1, 2) for t in (query, key, value))
    if sdpa_bias.applies(query, mask):  # a learned bias, gradients recorded
        return sdpa_bias.attention(query, key, value, mask, scale).transpose(1, 2)
    output = torch.nn.functional.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=mask,
        is_causal=causal,
        scale=scale,
        enable_gqa=grouped and key.shape[1] != query.shape[1],
    )
    return output.transpose(1, 2)


def _per_length_attention(query, key, value, masks: Masks, scale, grouped):
    """`sdpa_lengths`'s one call per row length, or None where the tensors
    rule it out (`sdpa_lengths.applies`) or a row is not right-padded."""
    from keras_selfattn.attention.fused import sdpa_lengths  # imports torch

    if not sdpa_lengths.applies(query, key, masks.key_padding):
        return None
    return sdpa_lengths.attention(
        query,
        key,
        value,
        masks.key_padding,
        lambda q, k, v: _sdpa(q, k, v, scale, grouped, causal=masks.causal),
    )


def _dense_mask_attention(
    query, key, value, masks: Masks, scale, grouped, facts: CallFacts, bias=None
):
    """The kernel with the call's whole mask as a boolean (B, 1, Tq, Tk) mask:
    for queries that do not start at key 0 (decoding with a cache, where Tq
    is a few new positions), which `is_causal` would misplace, for a time
    of unknown size on JAX (see the module docstring), for segments, and
    with a `bias` (float32 `(B or 1, H or 1, Tq, Tk)`), which PyTorch's
    kernel takes as a float mask: the bias where allowed, `MASK_VALUE`
    elsewhere (selected, so a non-finite bias there changes nothing)."""
    query_len, key_len = ops.shape(query)[1], ops.shape(key)[1]
    mask = masks_lib.block(masks, query_len=query_len, key_len=key_len)
    if mask is not None:  # None: nothing is masked
        mask = _nonempty_rows(mask)
    if facts.backend == "jax":
        import jax

        return jax.nn.dot_product_attention(
            query, key, value, bias=bias, mask=mask, scale=scale
        )
    if bias is not None and mask is not None:
        mask = ops.where(mask, bias, MASK_VALUE)
    elif bias is not None:
        mask = bias
    return _sdpa(query, key, value, scale, grouped, mask)


def fused_attention(
    query,
    key,
    value,
    masks,
    *,
    scale,
    dropout=None,
    return_weights=False,
    grouped_key_value=True,
    mods=None,
    facts: CallFacts,
):
    """Attention through the backend's fused kernel (JAX or PyTorch).

    Called only for what `dispatch.IMPLEMENTATIONS["fused"]` does not rule
    out: no dropout, no returned weights, no `attention_mask`.

    Args:
        query: (B, Tq, H, K).
        key: (B, Tk, G, K), G dividing H: query head h uses key and value
            head h // (H / G) (JAX's kernel takes fewer key heads as they
            are; PyTorch's with `enable_gqa`).
        value: (B, Tk, G, V).
        masks: A `Masks` with no `attention` mask (and, on PyTorch, no
            `sliding_window`).
        scale: Multiplier of the raw scores.
        dropout: None: the kernels do not expose their weights.
        return_weights: False, likewise.
        grouped_key_value: False when key and value have as many heads as
            query (the caller repeated them): PyTorch's kernel is then
            called with `enable_gqa=False`, which its exporters require.
        mods: None or a `score_mods.ScoreMods` that only adds a bias (the
            kernels take no soft-cap and no sinks).
        facts: The call's `CallFacts`, which choose its `VARIANTS`.

    Returns:
        Tuple (output (B, Tq, H, V) in the inputs' dtype, None).
    """
    grouped = grouped_key_value
    bias = None
    if mods is not None:
        query_len, key_len = ops.shape(query)[1], ops.shape(key)[1]
        bias = score_mods.bias_block(mods, masks, query_len=query_len, key_len=key_len)
    variant = first(VARIANTS, facts)
    if variant == "jax":
        return _jax_attention(query, key, value, masks, scale, facts, bias), None
    if variant == "sdpa":
        return _sdpa(query, key, value, scale, grouped, causal=masks.causal), None
    if variant == "sdpa_lengths":
        output = _per_length_attention(query, key, value, masks, scale, grouped)
        if output is not None:
            return output, None
    # SDPA takes a mask or is_causal, not both: the band joins the mask.
    output = _dense_mask_attention(
        query, key, value, masks, scale, grouped, facts, bias
    )
    return output, None
