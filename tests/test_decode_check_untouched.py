"""The decode check names the layer that mixes positions by recording a
copy of the model it owns: the user's layers never run with their `call`
replaced, and keep their classes and `call`s."""

from __future__ import annotations

import keras
import pytest

import keras_selfattn
from tests import decoder_zoo


@keras.saving.register_keras_serializable(package="test_decode_check_untouched")
class Spy(keras.layers.Layer):
    """An identity that notes, on each call, whether its instance's `call`
    was replaced (`call` among the instance's own attributes)."""

    replaced: dict = {}

    def call(self, x):
        Spy.replaced.setdefault(id(self), []).append("call" in vars(self))
        return x


@pytest.mark.slow_on("jax", "the decode check's loops, compiled op by op")
def test_the_culprit_is_named_without_replacing_the_users_calls():
    tokens = keras.Input((None,), dtype="int32")
    x = decoder_zoo.ArangePositions(
        decoder_zoo.MAX_POSITIONS, decoder_zoo.VOCABULARY, decoder_zoo.WIDTH
    )(tokens)
    spy = Spy()
    x = spy(x)
    x = keras_selfattn.SelfAttention(num_heads=2, causal=True)(x)
    model = keras.Model(tokens, keras.layers.Dense(decoder_zoo.VOCABULARY)(x))
    held = [(type(layer), vars(layer).get("call")) for layer in model.layers]
    Spy.replaced.clear()
    with pytest.raises(ValueError, match=r"\(ArangePositions\) mixes positions"):
        keras_selfattn.generate(model, [[3, 7, 1]], 2)
    assert Spy.replaced[id(spy)] and not any(Spy.replaced[id(spy)])
    # The copy's spy ran recorded: the check did record.
    assert any(any(calls) for key, calls in Spy.replaced.items() if key != id(spy))
    assert [(type(layer), vars(layer).get("call")) for layer in model.layers] == held
