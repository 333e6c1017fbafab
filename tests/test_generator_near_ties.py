"""A quantized model's generator judged on its own tokens where they are not
Keras's (`export.generator.near_ties`): a token chosen where Keras's logits
tie within the band is accepted, any other difference is not."""

from __future__ import annotations

import keras
import numpy as np
import pytest

from keras_selfattn.export.generator import near_ties

pytestmark = pytest.mark.slow_on(
    "jax", "the sampler's loops, compiled op by op; the other suites check it"
)

VOCABULARY = 6


def _table() -> np.ndarray:
    """Next-token logits of each token: token t's largest is t + 1; token
    1's are 3 (1.0) and 2 (0.96), a near tie, then 1 (0.2)."""
    logits = np.zeros((VOCABULARY, VOCABULARY), np.float32)
    for token in range(VOCABULARY):
        logits[token, (token + 1) % VOCABULARY] = 1.0
    logits[1] = [0.0, 0.2, 0.96, 1.0, 0.1, 0.0]
    return logits


@pytest.fixture(scope="module")
def model():
    tokens = keras.Input((None,), dtype="int32")
    table = keras.layers.Embedding(VOCABULARY, VOCABULARY)
    model = keras.Model(tokens, table(tokens))
    table.set_weights([_table()])
    return model


def _request(**controls) -> dict:
    values = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "seed": 7}
    values = {"end_token": -1, **values, **controls}
    return {
        "prompt_tokens": np.asarray([[1, 0]], np.int32),
        "prompt_lengths": np.asarray([1], np.int32),
        **{name: np.asarray(value) for name, value in values.items()},
    }


def _ties(model, request, tokens, length=None):
    tokens = np.asarray([tokens], np.int32)
    counted = int(np.sum(tokens != -1)) if length is None else length
    return near_ties.ties(
        model, request, "prompt_tokens", tokens, np.asarray([counted], np.int32)
    )


def test_greedy_tokens_at_a_near_tie_are_counted(model):
    greedy = _request()
    assert _ties(model, greedy, [3, 4, 5]) == 0  # Keras's own
    assert _ties(model, greedy, [2, 3, 4]) == 1  # 0.96 against 1.0
    assert _ties(model, greedy, [1, 2, 3]) is None  # 0.2: a difference
    assert _ties(model, greedy, [3, 5, 0]) is None  # after 3 comes 4
    assert _ties(model, greedy, [3, VOCABULARY, 5]) is None  # not a token


def test_rows_must_end_at_their_end_token_and_count_their_tokens(model):
    ending = _request(end_token=5)
    assert _ties(model, ending, [3, 4, 5, -1]) == 0
    assert _ties(model, ending, [3, 4, 5, 0]) is None  # a token after the end
    assert _ties(model, ending, [3, 4, 5, -1, 0]) is None  # after an empty slot
    assert _ties(model, ending, [3, 4, -1, -1]) is None  # stopped, not ended
    assert _ties(model, ending, [3, 4, 5, -1], length=4) is None


def test_a_sampled_token_must_be_one_the_sampler_keeps(model):
    # Top-2 keeps tokens 3 and 2 after token 1: either is Keras's choice
    # for some uniform; token 4 (0.1) is not, even with the band.
    sampled = _request(temperature=1.0, top_k=2)
    assert _ties(model, sampled, [3]) in (0, 1)
    assert _ties(model, sampled, [2]) in (0, 1)
    assert _ties(model, sampled, [3]) + _ties(model, sampled, [2]) == 1
    assert _ties(model, sampled, [4]) is None


def test_rows_equal_to_keras_generate_are_not_replayed(model):
    # After the prompt's 1 the logits give 3 (1.0); 1 (0.2) is no near
    # tie, so [1, 2, 3] judged on the logits is a difference. Given as
    # Keras's own tokens and length, the row is Keras's choice and is not
    # replayed.
    greedy = _request()
    tokens = np.asarray([[1, 2, 3]], np.int32)
    counted = np.asarray([3], np.int32)
    replayed = near_ties.ties(model, greedy, "prompt_tokens", tokens, counted)
    assert replayed is None
    same = (tokens.copy(), counted.copy())
    assert near_ties.ties(model, greedy, "prompt_tokens", tokens, counted, same) == 0
    other = (np.asarray([[3, 4, 5]], np.int32), counted)
    assert (
        near_ties.ties(model, greedy, "prompt_tokens", tokens, counted, other) is None
    )
    shorter = (tokens.copy(), np.asarray([2], np.int32))
    assert (
        near_ties.ties(model, greedy, "prompt_tokens", tokens, counted, shorter) is None
    )
