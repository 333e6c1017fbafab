"""`generate` on PyTorch: each step recorded once as a graph of PyTorch's ops
and replayed (`generation.torch_steps`), against the uncached forward
(tests/generation_reference.py) and the layers' own calls."""

from __future__ import annotations

import keras
import numpy as np
import pytest

from keras_selfattn import SelfAttention, generate
from tests import generation_reference as reference
from tests.test_generation import PROMPTS, VOCABULARY

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "torch", reason="PyTorch's recorded steps"
)


class Counting(keras.layers.Layer):
    """The identity, counting the calls Keras makes to it in Python."""

    calls = 0

    def call(self, x):
        Counting.calls += 1
        return x


class ReadsAValue(keras.layers.Layer):
    """The identity, reading a tensor's value in Python: a step a graph of
    fake tensors cannot record."""

    def call(self, x):
        if keras.ops.convert_to_numpy(keras.ops.max(keras.ops.abs(x))) > 1e30:
            return keras.ops.zeros_like(x)
        return x


class CountsInAVariable(keras.layers.Layer):
    """The identity, counting its calls in a variable: a step whose replay
    would drop the count."""

    def build(self, input_shape):
        self.count = self.add_weight(shape=(), initializer="zeros", trainable=False)

    def call(self, x):
        self.count.assign(self.count + 1.0)
        return x


def _model(extra: keras.layers.Layer, seed: int = 5) -> keras.Model:
    keras.utils.set_random_seed(seed)
    wide = keras.initializers.RandomNormal(stddev=1.0, seed=seed)
    tokens = keras.Input((None,), dtype="int32", name="tokens")
    h = keras.layers.Embedding(VOCABULARY, 16, embeddings_initializer=wide)(tokens)
    a = SelfAttention(
        num_heads=4, num_key_value_heads=2, causal=True, rope_max_wavelength=100
    )(h)
    h = extra(keras.layers.Add()([h, a]))
    logits = keras.layers.Dense(VOCABULARY, kernel_initializer=wide)(h)
    return keras.Model(tokens, logits)


def _calls(model, steps: int, jit_compile) -> tuple[int, np.ndarray]:
    before = Counting.calls
    result = generate(model, PROMPTS, steps, jit_compile=jit_compile)
    return Counting.calls - before, result


def test_recorded_steps_replay_without_calling_the_layers():
    model = _model(Counting())
    generate(model, PROMPTS, 1)  # the decode check, once per model
    # "auto": the prompt and the step's one recording, no call per step;
    # True: the same compiled loops, their recordings replayed.
    for jit_compile, calls in (("auto", 2), (True, 1)):
        few, short = _calls(model, 2, jit_compile)
        many, long = _calls(model, 9, jit_compile)
        assert few == many == calls, (jit_compile, few, many)
        tokens, lengths = reference.uncached(model, PROMPTS, 9)
        np.testing.assert_array_equal(long.tokens, tokens)
        np.testing.assert_array_equal(long.lengths, lengths)
        np.testing.assert_array_equal(short.tokens, tokens[:, :2])
    # jit_compile=False: every step calls the layers.
    few, _ = _calls(model, 2, False)
    many, eager = _calls(model, 9, False)
    assert many - few == 7
    np.testing.assert_array_equal(eager.tokens, tokens)
    assert len({tuple(row) for row in tokens}) > 1  # rows differ: a real check


def test_a_recording_is_kept_per_shape_and_replayed():
    model = _model(Counting())
    generate(model, PROMPTS, 4)
    # Same shapes: the recording is replayed, only the prompt calls layers.
    again, result = _calls(model, 4, "auto")
    assert again == 1
    # Another batch: recorded anew for its shapes.
    before = Counting.calls
    other = generate(model, PROMPTS[:2], 4)
    assert Counting.calls - before == 2
    tokens, _ = reference.uncached(model, PROMPTS, 4)
    np.testing.assert_array_equal(result.tokens, tokens)
    np.testing.assert_array_equal(other.tokens, tokens[:2])


def test_sampled_steps_equal_the_reference_sampler():
    model = _model(Counting())
    controls = dict(temperature=0.9, top_k=5, top_p=0.9)
    result = generate(model, PROMPTS, 7, seed=11, end_token=3, **controls)
    tokens, lengths = reference.uncached(
        model, PROMPTS, 7, seed=11, end_token=3, **controls
    )
    np.testing.assert_array_equal(result.tokens, tokens)
    np.testing.assert_array_equal(result.lengths, lengths)


def test_recorded_steps_read_the_weights_as_they_are_now():
    model = _model(Counting())
    first = generate(model, PROMPTS, 6).tokens
    dense = model.layers[-1]
    kernel, bias = dense.get_weights()
    dense.set_weights([kernel[:, ::-1].copy(), bias])
    before = Counting.calls
    result = generate(model, PROMPTS, 6)
    assert Counting.calls - before == 1  # the same recording, replayed
    tokens, lengths = reference.uncached(model, PROMPTS, 6)
    np.testing.assert_array_equal(result.tokens, tokens)
    assert not np.array_equal(tokens, first)


def test_a_step_that_cannot_be_recorded_runs_eagerly_with_a_warning():
    model = _model(ReadsAValue())
    with pytest.warns(UserWarning, match=r"steps eagerly on PyTorch.*could not be"):
        result = generate(model, PROMPTS, 5)
    tokens, lengths = reference.uncached(model, PROMPTS, 5)
    np.testing.assert_array_equal(result.tokens, tokens)
    np.testing.assert_array_equal(result.lengths, lengths)


def test_a_step_that_assigns_a_variable_runs_eagerly_with_a_warning():
    counting = CountsInAVariable()
    model = _model(counting)
    generate(model, PROMPTS, 1, jit_compile=False)
    before = float(keras.ops.convert_to_numpy(counting.count))
    with pytest.warns(UserWarning, match=r"could not be recorded.*assigns variables"):
        result = generate(model, PROMPTS, 5)
    # The prompt and four eager steps, each counted as the layers ran.
    assert float(keras.ops.convert_to_numpy(counting.count)) - before == 5
    tokens, lengths = reference.uncached(model, PROMPTS, 5)
    np.testing.assert_array_equal(result.tokens, tokens)
    np.testing.assert_array_equal(result.lengths, lengths)
