"""`convert_causal_lm`: a keras-hub causal language model (`GPT2CausalLM`,
...) converted, as the token model `generate` and `export_generator` take.

keras-hub's task models take `{"token_ids", "padding_mask"}`; a token model
takes int32 ids alone. A causal model's real positions never read the
positions after them, so the right padding of a batch of mixed-length
prompts changes none of them: the converted model is called with a padding
mask of ones.

A task model holds its backbone as a nested model. The token model calls
their layers directly (`_inlined`): through the nested models, each
decoding step would run Keras's call of both graphs, markedly slower on
PyTorch (benchmarks.keras_hub measures it); the layers, weights and outputs
are the same.
"""

from __future__ import annotations

import keras

from keras_selfattn._keras_private import is_functional, run_through_graph
from keras_selfattn.migration import hub_families
from keras_selfattn.migration.model import convert

_INPUTS = ("padding_mask", "token_ids")


def convert_causal_lm(
    causal_lm: keras.Model, share_weights: bool = True
) -> keras.Model:
    """A keras-hub causal LM with SelfAttention in place of its attention,
    taking token ids.

    Args:
        causal_lm: A keras-hub `CausalLM` (or any Functional model) whose
            inputs are `token_ids` and `padding_mask` and whose output is
            the logits `(batch, time, vocabulary)`. Its preprocessor and
            tokenizer are not part of it: tokenize with keras-hub's.
        share_weights: `convert`'s: whether the new model holds the
            layers of `causal_lm` it does not convert (its embeddings,
            feed-forward layers, norms), weights held once, rather than
            copies. Quantizing, training or `enable_lora` on either model
            then changes both.

    Returns:
        A Functional model from int32 `tokens` `(batch, time)` to the
        logits, holding the converted model (`convert`'s, whose report is
        its `conversion_report`). Use it with `keras_selfattn.generate` and
        `export_generator`.

    Raises:
        ValueError: one line, for a model without those two inputs, one
            holding an attention class of keras-hub's with no mapping (named
            with why: `hub_families`), or one where `convert` keeps an
            attention layer or converts none, and whatever `convert` refuses.

    Example:

    >>> import keras_hub, keras_selfattn
    >>> backbone = keras_hub.models.GPT2Backbone(
    ...     vocabulary_size=50, num_layers=1, num_heads=2, hidden_dim=8,
    ...     intermediate_dim=16, max_sequence_length=16)
    >>> lm = keras_hub.models.GPT2CausalLM(backbone, preprocessor=None)
    >>> tokens_model = keras_selfattn.convert_causal_lm(lm)
    >>> keras_selfattn.generate(tokens_model, [[3, 7, 1]], 2).tokens.shape
    (1, 2)
    """
    names = tuple(sorted(getattr(x, "name", None) for x in causal_lm.inputs or ()))
    if names != _INPUTS:
        raise ValueError(
            "convert_causal_lm takes a keras-hub causal LM, inputs token_ids "
            f"and padding_mask. Received: inputs={list(names)}"
        )
    hub_families.refuse_unmapped(causal_lm)
    converted = convert(causal_lm, share_weights)
    hub_families.refuse_unconverted(causal_lm, converted.conversion_report)
    tokens = keras.Input((None,), dtype="int32", name="tokens")
    logits = _inlined(
        converted,
        {"token_ids": tokens, "padding_mask": keras.ops.ones_like(tokens, "bool")},
    )
    model = keras.Model(tokens, logits, name=f"{causal_lm.name}_tokens")
    model.conversion_report = converted.conversion_report
    return model


def _inlined(model: keras.Model, inputs):
    """`model(inputs)` on symbolic `inputs` as the calls of its layers, the
    Functional models it holds inlined the same way (one called with
    arguments besides its inputs stays a call of the model)."""

    def call(operation, *args, **kwargs):
        if is_functional(operation) and len(args) == 1 and not kwargs:
            return _inlined(operation, args[0])
        return operation(*args, **kwargs)

    return run_through_graph(model, inputs, call)
