"""SelfAttention's score modifications: their weights, and each call's."""

from __future__ import annotations

from keras import ops

from keras_selfattn.attention import score_mods


def configured(layer) -> bool:
    """Whether the layer modifies every call's scores (its arguments)."""
    return (
        layer.position_bias is not None
        or layer.use_sinks
        or layer.logit_soft_cap is not None
    )


def add(layer) -> None:
    """Adds `relative_attention_bias` `(buckets, heads)` and `sinks`
    `(heads,)` where the layer's arguments ask for them, both starting at
    zero (no bias; each head's sink a logit of 0)."""
    if layer.position_bias == "relative":
        layer.relative_attention_bias = layer.add_weight(
            name="relative_attention_bias",
            shape=(layer.relative_attention_num_buckets, layer.num_heads),
            initializer="zeros",
        )
    if layer.use_sinks:
        layer.sinks = layer.add_weight(
            name="sinks", shape=(layer.num_heads,), initializer="zeros"
        )


def names(layer) -> tuple[str, ...]:
    """The names of the weights `add` adds, in the order it adds them."""
    added = ("relative_attention_bias",) if layer.position_bias == "relative" else ()
    return added + (("sinks",) if layer.use_sinks else ())


def for_call(layer, attention_bias=None) -> score_mods.ScoreMods | None:
    """The score modifications of one call, or None if it has none."""
    if attention_bias is None and not configured(layer):
        return None
    relative, max_distance = None, 0
    if layer.position_bias == "relative":
        max_distance = layer.relative_attention_max_distance
        relative = score_mods.relative_table(
            layer.relative_attention_bias,
            layer.relative_attention_num_buckets,
            max_distance,
            bidirectional=not layer.causal,
        )
    alibi = None
    if layer.position_bias == "alibi":
        alibi = score_mods.alibi_slopes(layer.num_heads, layer.alibi_bias_max)
        if layer.alibi_before_scale:
            alibi = tuple(slope * layer.effective_scale for slope in alibi)
    return score_mods.ScoreMods(
        soft_cap=layer.logit_soft_cap,
        alibi_slopes=alibi,
        relative_table=relative,
        max_distance=max_distance,
        bias=attention_bias,
        sinks=ops.cast(layer.sinks, "float32") if layer.use_sinks else None,
    )


def names_for_call(layer, attention_bias=None) -> tuple[str, ...]:
    """`for_call(...).names` without building the modifications' tensors."""
    names = score_mods.ScoreMods(
        soft_cap=layer.logit_soft_cap,
        alibi_slopes=() if layer.position_bias == "alibi" else None,
        relative_table=() if layer.position_bias == "relative" else None,
        bias=attention_bias,
        sinks=() if layer.use_sinks else None,
    ).names
    return names
