"""A model is read once per decoding call (issue 55): `every_layer` walks
it once per `generate`, `export_decode_step` and `export_generator` call,
and its refusal reasons are computed once (counted by wrapping the
package's functions here); keras-hub's position layers decode through
their public `positions` argument, their instances left as they were
(no `call` of their own, the same class), the tokens those of the
uncached loop (tests/generation_reference.py).
"""

from __future__ import annotations

import sys

import keras
import numpy as np
import pytest

from keras_selfattn import SelfAttention, generate
from keras_selfattn._model_layers import every_layer
from keras_selfattn.export import export_decode_step, export_generator
from keras_selfattn.generation import cached_model
from tests import generation_reference as reference

pytestmark = pytest.mark.slow_on(
    "jax", "each decoding step compiled op by op; the other suites check it"
)

keras_hub = pytest.importorskip("keras_hub")

PROMPTS = [[3, 7, 1, 9, 4], [5], [8, 2, 6]]
STEPS = 4
VOCABULARY = 23
WIDTH = 16


def _hub_model(name: str) -> keras.Model:
    """keras-hub's TokenAndPositionEmbedding at the top, its
    SinePositionEncoding inside a nested Functional model."""
    keras.utils.set_random_seed(3)
    wide = keras.initializers.RandomNormal(stddev=1.0)
    tokens = keras.Input((None,), dtype="int32", name="tokens")
    h = keras_hub.layers.TokenAndPositionEmbedding(
        VOCABULARY, 32, WIDTH, embeddings_initializer=wide
    )(tokens)
    inner = keras.Input((None, WIDTH))
    sine = keras.Model(inner, inner + keras_hub.layers.SinePositionEncoding()(inner))
    h = sine(h)
    for _ in range(2):
        h = h + SelfAttention(num_heads=2, causal=True)(h)
    logits = keras.layers.Dense(VOCABULARY, kernel_initializer=wide)(h)
    return keras.Model(tokens, logits, name=name)


def _hub_layers(model: keras.Model) -> list:
    hub = (
        keras_hub.layers.TokenAndPositionEmbedding,
        keras_hub.layers.PositionEmbedding,
        keras_hub.layers.SinePositionEncoding,
    )
    return [layer for layer in every_layer(model) if isinstance(layer, hub)]


class Counts:
    """Counts the package's walks of a model and its refusal reasons."""

    def __init__(self, monkeypatch):
        self.walks = 0
        self.reasons = 0
        original = every_layer
        reason = cached_model.refusal_reason

        def walked(model):
            self.walks += 1
            return original(model)

        def reasoned(*args):
            self.reasons += 1
            return reason(*args)

        for name, module in list(sys.modules.items()):
            if name.startswith("keras_selfattn") and (
                getattr(module, "every_layer", None) is original
            ):
                monkeypatch.setattr(module, "every_layer", walked)
        monkeypatch.setattr(cached_model, "refusal_reason", reasoned)

    def taken(self) -> tuple[int, int]:
        """(walks, reasons) since the last call."""
        taken = (self.walks, self.reasons)
        self.walks = self.reasons = 0
        return taken


@pytest.fixture(scope="module")
def generated():
    """One hub model: its keras-hub layers' state before, `generate`'s
    readings counted (a model no call has read: the decode check runs),
    and its result."""
    model = _hub_model("hub_reading")
    layers = _hub_layers(model)
    before = [(type(layer), dict(vars(layer))) for layer in layers]
    with pytest.MonkeyPatch.context() as monkeypatch:
        counts = Counts(monkeypatch)
        result = generate(model, PROMPTS, STEPS)
        taken = counts.taken()
    return model, layers, before, taken, result


def test_generate_reads_the_model_once(generated):
    _, _, _, (walks, reasons), _ = generated
    assert (walks, reasons) == (1, 1)


def test_hub_position_layers_decode_unchanged(generated):
    model, layers, before, _, result = generated
    assert len(layers) == 3  # TokenAndPositionEmbedding, its PositionEmbedding, sine
    for layer, (cls, attributes) in zip(layers, before, strict=True):
        assert "call" not in vars(layer)
        assert type(layer) is cls
        assert set(vars(layer)) == set(attributes)
    tokens, lengths = reference.uncached(model, PROMPTS, STEPS)
    np.testing.assert_array_equal(result.tokens, tokens)
    np.testing.assert_array_equal(result.lengths, lengths)
    assert len({tuple(row) for row in tokens}) > 1  # rows differ: a real check


def test_hub_position_layer_inside_a_subclassed_layer_is_refused():
    class Embedded(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.embedding = keras_hub.layers.TokenAndPositionEmbedding(
                VOCABULARY, 32, WIDTH
            )

        def call(self, tokens):
            return self.embedding(tokens)

        def compute_output_shape(self, shape):
            return (*shape, WIDTH)

    tokens = keras.Input((None,), dtype="int32")
    h = Embedded()(tokens)
    h = SelfAttention(num_heads=2, causal=True)(h)
    model = keras.Model(tokens, keras.layers.Dense(VOCABULARY)(h))
    with pytest.raises(ValueError, match="token_and_position_embedding") as error:
        generate(model, PROMPTS, STEPS)
    assert "\n" not in str(error.value)
    assert all("call" not in vars(layer) for layer in _hub_layers(model))


# The exports' counts: on TensorFlow, which writes every format.
counted_on_tensorflow = pytest.mark.skipif(
    keras.backend.backend() != "tensorflow",
    reason="counted on TensorFlow, which writes every format",
)


@counted_on_tensorflow
def test_export_decode_step_reads_the_model_once(tmp_path, monkeypatch):
    model = _hub_model("hub_step")
    counts = Counts(monkeypatch)
    export_decode_step(
        model, tmp_path / "step", "saved_model", max_length=12, name="lm", check=False
    )
    assert counts.taken() == (1, 1)


@pytest.mark.slow
@counted_on_tensorflow
def test_checked_exports_read_the_model_once(tmp_path, monkeypatch):
    """With their checks (the decode check, the runtimes' against Keras)."""
    model = _hub_model("hub_exports")
    counts = Counts(monkeypatch)
    export_decode_step(model, tmp_path / "step", "saved_model", max_length=12, name="a")
    assert counts.taken() == (1, 1)
    export_generator(model, tmp_path / "gen", "saved_model", max_length=12, name="b")
    assert counts.taken() == (1, 1)
