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


def alibi_slopes(num_heads: int, alibi_bias_max: float = 8.0) -> np.ndarray:
    """keras-hub's `AlibiBias._get_alibi_slopes`, transcribed: the slopes of
    the largest power of two n <= num_heads (geometric, from
    2 ** (-alibi_bias_max / n)), then every other slope of 2n's."""

    def power_of_two(n: int) -> list[float]:
        start = 2 ** (-(2 ** -(np.log2(n) - np.log2(alibi_bias_max))))
        return [start * start**i for i in range(n)]

    n = 2 ** int(np.floor(np.log2(num_heads)))
    slopes = power_of_two(n)
    if n < num_heads:
        slopes += power_of_two(2 * n)[0::2][: num_heads - n]
    return np.array(slopes)


def t5_bucket(
    relative_position: int, bidirectional: bool, num_buckets: int, max_distance: int
) -> int:
    """T5's `_relative_position_bucket` of one `key - query` position,
    transcribed (its logarithm in float32, as T5 computes it)."""
    bucket = 0
    if bidirectional:
        num_buckets //= 2
        bucket += num_buckets if relative_position > 0 else 0
        relative_position = abs(relative_position)
    else:
        relative_position = -min(relative_position, 0)
    max_exact = num_buckets // 2
    if relative_position < max_exact:
        return bucket + relative_position
    large = max_exact + int(
        np.log(np.float32(relative_position) / np.float32(max_exact))
        / np.float32(np.log(max_distance / max_exact))
        * np.float32(num_buckets - max_exact)
    )
    return bucket + min(large, num_buckets - 1)


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
    logit_soft_cap: float | None = None,
    position_bias: np.ndarray | None = None,
    attention_bias: np.ndarray | None = None,
    sinks: np.ndarray | None = None,
    segment_ids: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Returns (output (B, T, W), attention weights (B, H, T, T)) in float64.

    `weights` has keys wq, wk, wv and optionally bq, bk, bv, wg, bg, wo, bo,
    with the layer's layout: head h uses columns [h*key_dim:(h+1)*key_dim].
    With `num_key_value_heads` G, wk and wv have G heads, and query head h
    uses key and value head h // (num_heads // G). With wg, the heads are
    multiplied by sigmoid(x wg + bg) before the output projection. With
    `rope_max_wavelength`, each head's queries and keys are rotated by
    position (`rotary`).

    Score modifications, in this order: each score becomes
    `cap * tanh(score / cap)` with `logit_soft_cap`, then adds
    `position_bias[h, i, j]` (H, T, T) and `attention_bias[b, h, i, j]`
    (broadcast from size-1 axes); a query attends only keys of its own
    `segment_ids` (B, T); with `sinks` (H,) the softmax of head h has
    `exp(sinks[h])` more in its denominator.
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
        if segment_ids is not None:
            ok &= segment_ids[b][:, None] == segment_ids[b][None, :]
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
                if logit_soft_cap is not None:
                    scores = logit_soft_cap * np.tanh(scores / logit_soft_cap)
                if position_bias is not None:
                    scores = scores + position_bias[h, i]
                if attention_bias is not None:
                    bias = np.broadcast_to(
                        attention_bias, (batch, num_heads) + (time,) * 2
                    )
                    scores = scores + bias[b, h, i]
                w = np.zeros(time)
                if sinks is None:
                    w[ok[i]] = _softmax(scores[ok[i]])
                else:
                    w[ok[i]] = _softmax(np.append(scores[ok[i]], sinks[h]))[:-1]
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


def alibi_bias(slopes: np.ndarray, time: int) -> np.ndarray:
    """(H, T, T): head h adds -slopes[h] * |i - j|."""
    distance = np.abs(np.arange(time)[:, None] - np.arange(time)[None, :])
    return -slopes[:, None, None] * distance[None]


def relative_bias(
    weight: np.ndarray,
    time: int,
    bidirectional: bool,
    num_buckets: int = 32,
    max_distance: int = 128,
) -> np.ndarray:
    """(H, T, T): T5's learned `weight[bucket(j - i), h]`."""
    out = np.zeros((weight.shape[1], time, time))
    for i in range(time):
        for j in range(time):
            bucket = t5_bucket(j - i, bidirectional, num_buckets, max_distance)
            out[:, i, j] = weight[bucket]
    return out


def _layer_position_bias(layer, weights: dict, time: int):
    if layer.position_bias == "alibi":
        slopes = alibi_slopes(layer.num_heads, layer.alibi_bias_max)
        return alibi_bias(slopes, time)
    if layer.position_bias == "relative":
        return relative_bias(
            weights["relative_attention_bias"],
            time,
            not layer.causal,
            layer.relative_attention_num_buckets,
            layer.relative_attention_max_distance,
        )
    return None


def for_layer(
    layer, x: np.ndarray, weights: dict | None = None, **masks
) -> tuple[np.ndarray, np.ndarray]:
    """`self_attention` with the layer's weights and configuration.

    Default key_dim and value_dim are resolved from `x`'s feature size as the
    layer documents; `weights` (by reference name, as `layer_weights` gives
    them) replace the layer's own where given; `masks` (padding_mask,
    attention_mask, attention_bias, segment_ids) pass through.
    """
    key_dim = layer.key_dim or x.shape[-1] // layer.num_heads
    weights = layer_weights(layer) if weights is None else weights
    return self_attention(
        x,
        weights,
        layer.num_heads,
        key_dim,
        layer.value_dim or key_dim,
        scale=layer.scale,
        causal=layer.causal,
        sliding_window=layer.sliding_window,
        num_key_value_heads=layer.num_key_value_heads,
        rope_max_wavelength=layer.rope_max_wavelength,
        rope_scaling_factor=layer.rope_scaling_factor,
        logit_soft_cap=layer.logit_soft_cap,
        position_bias=_layer_position_bias(layer, weights, x.shape[1]),
        sinks=weights.get("sinks"),
        **masks,
    )


def layer_weights(layer) -> dict[str, np.ndarray]:
    """The layer's weights by reference name, read through get_weights()."""
    # The layer's own weights come first, in the order it adds them.
    names = ["relative_attention_bias"] if layer.position_bias == "relative" else []
    names += ["sinks"] if layer.use_sinks else []
    names += ["wq"] + (["bq"] if layer.use_bias else [])
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
        attention_bias=masks.get("attention_bias"),
        segment_ids=masks.get("segment_ids"),
    )[0]
