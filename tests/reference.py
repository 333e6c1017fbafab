"""An independent numpy reference of self-attention, written from the equations.

It loops over batch, heads and query rows and shares no code with the
package, so tests can compare the layer with it.
"""

from __future__ import annotations

import numpy as np


def _softmax(row: np.ndarray) -> np.ndarray:
    row = row - row.max()
    e = np.exp(row)
    return e / e.sum()


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def rotary(
    x: np.ndarray, max_wavelength: float, scaling_factor: float = 1.0
) -> np.ndarray:
    """(T, D) rows of one head rotated by position, pair by pair: for i < D/2
    the pair (x[t, i], x[t, i + D/2]) turns by the angle
    (t / scaling_factor) / max_wavelength ** (2i / D)."""
    time, depth = x.shape
    half = depth // 2
    out = np.zeros_like(x)
    for t in range(time):
        for i in range(half):
            angle = (t / scaling_factor) / max_wavelength ** (2 * i / depth)
            c, s = np.cos(angle), np.sin(angle)
            out[t, i] = x[t, i] * c - x[t, i + half] * s
            out[t, i + half] = x[t, i + half] * c + x[t, i] * s
    return out


def allowed(
    time: int,
    padding_mask: np.ndarray | None = None,
    attention_mask: np.ndarray | None = None,
    causal: bool = False,
    sliding_window: int | None = None,
    batch_index: int = 0,
) -> np.ndarray:
    """(T, T) bool: may query i attend key j, for one batch element."""
    ok = np.ones((time, time), dtype=bool)
    for i in range(time):
        for j in range(time):
            if padding_mask is not None and not padding_mask[batch_index, j]:
                ok[i, j] = False
            if attention_mask is not None and not attention_mask[batch_index, i, j]:
                ok[i, j] = False
            if causal and j > i:
                ok[i, j] = False
            if sliding_window is not None and abs(i - j) >= sliding_window:
                ok[i, j] = False
    return ok


def self_attention(
    x: np.ndarray,
    weights: dict[str, np.ndarray],
    num_heads: int,
    key_dim: int,
    value_dim: int,
    scale: float | None = None,
    padding_mask: np.ndarray | None = None,
    attention_mask: np.ndarray | None = None,
    causal: bool = False,
    sliding_window: int | None = None,
    num_key_value_heads: int | None = None,
    rope_max_wavelength: float | None = None,
    rope_scaling_factor: float = 1.0,
) -> tuple[np.ndarray, np.ndarray]:
    """Returns (output (B, T, W), attention weights (B, H, T, T)) in float64.

    `weights` has keys wq, wk, wv and optionally bq, bk, bv, wg, bg, wo, bo,
    with the layer's layout: head h uses columns [h*key_dim:(h+1)*key_dim].
    With `num_key_value_heads` G, wk and wv have G heads, and query head h
    uses key and value head h // (num_heads // G). With wg, the heads are
    multiplied by sigmoid(x wg + bg) before the output projection. With
    `rope_max_wavelength`, each head's queries and keys are rotated by
    position (`rotary`).
    """
    x = x.astype(np.float64)
    batch, time, _ = x.shape
    scale = 1.0 / np.sqrt(key_dim) if scale is None else scale

    def proj(name: str) -> np.ndarray:
        y = x @ weights["w" + name].astype(np.float64)
        if "b" + name in weights:
            y = y + weights["b" + name]
        return y

    q, k, v = proj("q"), proj("k"), proj("v")
    kv_heads = num_heads if num_key_value_heads is None else num_key_value_heads
    group = num_heads // kv_heads
    heads_out = np.zeros((batch, time, num_heads * value_dim))
    attn = np.zeros((batch, num_heads, time, time))
    for b in range(batch):
        ok = allowed(time, padding_mask, attention_mask, causal, sliding_window, b)
        for h in range(num_heads):
            g = h // group  # the key and value head of query head h
            qh = q[b, :, h * key_dim : (h + 1) * key_dim]
            kh = k[b, :, g * key_dim : (g + 1) * key_dim]
            vh = v[b, :, g * value_dim : (g + 1) * value_dim]
            if rope_max_wavelength is not None:
                qh = rotary(qh, rope_max_wavelength, rope_scaling_factor)
                kh = rotary(kh, rope_max_wavelength, rope_scaling_factor)
            for i in range(time):
                if padding_mask is not None and not padding_mask[b, i]:
                    continue  # padded query: zero weights, zero output
                if not ok[i].any():
                    continue  # nothing to attend: zero weights, zero output
                scores = np.array([qh[i] @ kh[j] for j in range(time)]) * scale
                w = np.zeros(time)
                w[ok[i]] = _softmax(scores[ok[i]])
                attn[b, h, i] = w
                heads_out[b, i, h * value_dim : (h + 1) * value_dim] = w @ vh
    out = heads_out
    if "wg" in weights:
        out = out * _sigmoid(proj("g"))
    if "wo" in weights:
        out = out @ weights["wo"].astype(np.float64)
        if "bo" in weights:
            out = out + weights["bo"]
    # A query with nothing to attend (padded, or no allowed key) outputs
    # zeros, after the output projection and its bias too.
    out = out * attn.any(axis=(1, 3))[:, :, None]
    return out, attn


def for_layer(layer, x: np.ndarray, **masks) -> tuple[np.ndarray, np.ndarray]:
    """`self_attention` with the layer's weights and configuration.

    Default key_dim and value_dim are resolved from `x`'s feature size as the
    layer documents; `masks` (padding_mask, attention_mask) pass through.
    """
    key_dim = layer.key_dim or x.shape[-1] // layer.num_heads
    return self_attention(
        x,
        layer_weights(layer),
        layer.num_heads,
        key_dim,
        layer.value_dim or key_dim,
        scale=layer.scale,
        causal=layer.causal,
        sliding_window=layer.sliding_window,
        num_key_value_heads=layer.num_key_value_heads,
        rope_max_wavelength=layer.rope_max_wavelength,
        rope_scaling_factor=layer.rope_scaling_factor,
        **masks,
    )


def layer_weights(layer) -> dict[str, np.ndarray]:
    """The layer's weights by reference name, read through get_weights()."""
    names = ["wq"] + (["bq"] if layer.use_bias else [])
    names += ["wk"] + (["bk"] if layer.use_bias else [])
    names += ["wv"] + (["bv"] if layer.use_bias else [])
    if layer.use_gate:
        names += ["wg"] + (["bg"] if layer.use_bias else [])
    if layer.output_dim is not None:
        names += ["wo"] + (["bo"] if layer.use_bias else [])
    values = layer.get_weights()
    assert len(values) == len(names), (len(values), names)
    return dict(zip(names, values, strict=True))


def output_for_call(layer, x: np.ndarray, masks: dict) -> np.ndarray:
    """The reference output of `layer(x, **masks)`, masks given as the call's
    keyword arguments (`mask`, `attention_mask`)."""
    return for_layer(
        layer,
        x,
        padding_mask=masks.get("mask"),
        attention_mask=masks.get("attention_mask"),
    )[0]
