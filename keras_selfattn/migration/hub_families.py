"""Which keras-hub causal LMs `convert_causal_lm` takes, and a one-line
refusal for the others.

A model holding an attention class of keras-hub's that has no row in
`hub_attention.CLASSES` (and is not a Keras `MultiHeadAttention`, as GPT-2's
and OPT's `CachedMultiHeadAttention` are) is refused before any layer is
copied: the error of a decoder that does not rebuild from its own
`get_config()` would hold the whole config. An attention layer `convert`
keeps (Llama's dropout, ...) refuses the model after it, and so does
a model with none converted: a token model with an attention layer
`generate` cannot cache, or none, is never returned.
"""

from __future__ import annotations

from collections.abc import Iterator

import keras

from keras_selfattn import _from_keras
from keras_selfattn._keras_private import sublayers
from keras_selfattn.migration import hub_attention

# Why each of keras-hub 0.32's other decoder attention classes is refused.
WHY: dict[str, str] = {}


def _hub_attention_layers(layer) -> Iterator[keras.layers.Layer]:
    """keras-hub's attention layers inside `layer` (not inside them)."""
    for child in sublayers(layer):
        name = type(child).__name__
        if type(child).__module__.startswith("keras_hub.") and name.endswith(
            "Attention"
        ):
            yield child
        else:
            yield from _hub_attention_layers(child)


def refuse_unmapped(causal_lm: keras.Model) -> None:
    """Raises a one-line ValueError naming the first attention class of
    keras-hub's in `causal_lm` that does not convert, and why."""
    for layer in _hub_attention_layers(causal_lm):
        if hub_attention.row(layer) or isinstance(layer, _from_keras.CONVERTIBLE):
            continue
        name = type(layer).__name__
        why = WHY.get(name, "keras_selfattn has no mapping of it yet")
        raise ValueError(
            f"convert_causal_lm cannot convert {type(causal_lm).__name__} "
            f"'{causal_lm.name}': its {name} '{layer.name}' does not become a "
            f"SelfAttention: {why}. Received: causal_lm={causal_lm.name!r}"
        )


def refuse_unconverted(causal_lm: keras.Model, report) -> None:
    """Raises a one-line ValueError where `convert`'s `report` kept an
    attention layer (its first `kept` line names the class and why) or
    converted none (RWKV-7's recurrence, ...)."""
    if report.kept or not report.converted:
        why = report.kept[0] if report.kept else "no attention layer converted"
        raise ValueError(
            f"convert_causal_lm cannot convert {type(causal_lm).__name__} "
            f"'{causal_lm.name}': {why}. Received: causal_lm={causal_lm.name!r}"
        )
