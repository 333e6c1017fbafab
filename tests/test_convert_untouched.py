"""`convert` only reads the user's model: its layers' classes, bound `call`s
and weights are the same after, and another thread calling the model
during `convert` gets the outputs it got before."""

from __future__ import annotations

import threading

import keras
import numpy as np
import pytest
from keras import layers

import keras_selfattn
from tests import user_blocks


def _model() -> keras.Model:
    """A top-level MultiHeadAttention and one inside a user's block."""
    tokens = keras.Input((None,), dtype="int32")
    x = layers.Embedding(user_blocks.VOCABULARY, user_blocks.D)(tokens)
    x = layers.MultiHeadAttention(2, 8)(x, x, use_causal_mask=True)
    x = user_blocks.TransformerBlock(user_blocks.D, 2, 32, causal=True)(x)
    return user_blocks.randomized(keras.Model(tokens, x), scale=1.0)


def _held(model: keras.Model) -> list:
    """Each layer's (nested ones too) class and own `call`."""
    return [
        (type(layer), vars(layer).get("call"))
        for layer in model._flatten_layers(include_self=True)
    ]


def _state(model: keras.Model) -> list:
    """Each layer (nested ones too) with its class, own `call` and weights."""
    return [
        (
            layer,
            type(layer),
            vars(layer).get("call"),
            [np.array(w) for w in layer.get_weights()],
        )
        for layer in model._flatten_layers(include_self=True)
    ]


@pytest.mark.slow_on("jax", "JAX compiles every eager op of both threads' calls")
def test_convert_leaves_the_model_as_it_was_while_another_thread_calls_it():
    model = _model()
    tokens = np.random.default_rng(0).integers(1, user_blocks.VOCABULARY, (2, 6))
    expected = keras.ops.convert_to_numpy(model(tokens))
    before = _state(model)
    assert {type(layer) for layer, *_ in before} >= {
        layers.MultiHeadAttention,
        user_blocks.TransformerBlock,
    }

    started, done = threading.Event(), threading.Event()
    held = _held(model)
    outputs, seen, errors = [], [], []

    def call_repeatedly():
        try:
            started.set()
            while not done.wait(0.01):
                seen.append(_held(model))
                outputs.append(keras.ops.convert_to_numpy(model(tokens)))
        except Exception as error:  # reported below
            errors.append(error)

    thread = threading.Thread(target=call_repeatedly)
    thread.start()
    started.wait()
    try:
        converted = keras_selfattn.convert(model)
    finally:
        done.set()
        thread.join()

    assert errors == []
    assert outputs, "the other thread made no call during convert"
    assert all(classes_and_calls == held for classes_and_calls in seen)
    for output in outputs:
        np.testing.assert_allclose(output, expected, rtol=1e-5, atol=1e-5)
    after = _state(model)
    assert len(after) == len(before)
    for (layer, cls, call, weights), (same, cls_after, call_after, w_after) in zip(
        before, after, strict=True
    ):
        assert same is layer
        assert cls_after is cls, layer.name
        assert call_after is call, layer.name
        for w, w2 in zip(weights, w_after, strict=True):
            np.testing.assert_array_equal(w, w2)
    assert len(converted.conversion_report.converted) == 2
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(converted(tokens)), expected, atol=1e-4
    )
