"""Property tests: SelfAttention against the independent numpy reference.

Hypothesis draws whole configurations (batch 1-4, time 1-64, features, heads,
key/value dims, output_dim, biases, scale, causal, sliding_window,
chunk_size) and inputs (random padding masks, including fully padded rows,
and attention masks, including rows with nothing to attend). Every example
builds a fresh eager layer, gives it random weights (biases included, so they
are not just zeros) and compares the output, and the attention weights when
not chunked, with tests/reference.py in float64.

The runs are reproducible: `derandomize=True` and no example database, so CI
sees the same examples on every run.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from keras_selfattn import SelfAttention
from tests.backend import BACKEND, to_numpy
from tests.reference import layer_weights, self_attention

# float32 layer vs float64 reference; inputs and weights are O(1).
RTOL = 1e-4
ATOL = 1e-5

_SETTINGS = {
    "deadline": None,
    "derandomize": True,
    "database": None,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large],
}


@st.composite
def cases(draw):
    """A layer configuration and inputs, all described by plain values."""
    num_heads = draw(st.integers(1, 4))
    key_dim = draw(st.none() | st.integers(1, 8))
    if key_dim is None:
        features = num_heads * draw(st.integers(1, 4))
    else:
        features = draw(st.integers(1, 12))
    config = {
        "num_heads": num_heads,
        "key_dim": key_dim,
        "value_dim": draw(st.none() | st.integers(1, 8)),
        "output_dim": draw(st.none() | st.integers(1, 8)),
        "use_bias": draw(st.booleans()),
        "scale": draw(st.none() | st.floats(0.05, 2.0)),
        "causal": draw(st.booleans()),
        "sliding_window": draw(st.none() | st.integers(1, 70)),
        "chunk_size": draw(st.none() | st.integers(1, 70)),
    }
    batch = draw(st.integers(1, 4))
    time = draw(st.integers(1, 64))
    # Per batch row: no padding, random padding, or everything padded.
    padding = draw(
        st.none()
        | st.lists(
            st.sampled_from(["full", "random", "none"]), min_size=batch, max_size=batch
        )
    )
    attention = draw(st.sampled_from([None, "random", "sparse"]))
    seed = draw(st.integers(0, 2**32 - 1))
    return config, batch, time, features, padding, attention, seed


def _inputs(batch, time, features, padding, attention, seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(batch, time, features)).astype("float32")
    mask = None
    if padding is not None:
        mask = np.ones((batch, time), dtype=bool)
        for b, kind in enumerate(padding):
            if kind == "full":
                mask[b] = False
            elif kind == "random":
                mask[b] = rng.random(time) < 0.6
    attention_mask = None
    if attention is not None:
        keep = 0.7 if attention == "random" else 0.15
        attention_mask = rng.random((batch, time, time)) < keep
    return rng, x, mask, attention_mask


def _randomize_weights(layer, rng) -> None:
    layer.set_weights(
        [
            rng.normal(scale=0.5, size=w.shape).astype("float32")
            for w in layer.get_weights()
        ]
    )


def _check(case) -> None:
    config, batch, time, features, padding, attention, seed = case
    rng, x, mask, attention_mask = _inputs(
        batch, time, features, padding, attention, seed
    )
    layer = SelfAttention(**config)
    layer.build((None, None, features))
    _randomize_weights(layer, rng)
    key_dim = config["key_dim"] or features // config["num_heads"]
    value_dim = config["value_dim"] or key_dim
    ref_out, ref_weights = self_attention(
        x,
        layer_weights(layer),
        config["num_heads"],
        key_dim,
        value_dim,
        scale=config["scale"],
        padding_mask=mask,
        attention_mask=attention_mask,
        causal=config["causal"],
        sliding_window=config["sliding_window"],
    )
    path = layer.implementation(x, mask=mask, attention_mask=attention_mask)
    output = to_numpy(layer(x, mask=mask, attention_mask=attention_mask))
    width = config["output_dim"] or config["num_heads"] * value_dim
    assert output.shape == (batch, time, width)
    np.testing.assert_allclose(output, ref_out, rtol=RTOL, atol=ATOL)
    if config["chunk_size"] is not None:
        return  # a chunked layer never materializes the weights
    scored, weights = map(
        to_numpy,
        layer(
            x, mask=mask, attention_mask=attention_mask, return_attention_scores=True
        ),
    )
    # Asking for the scores does not change the output: bit for bit on the
    # same (explicit) path; the fused kernel (JAX, PyTorch) sums in another
    # order, so there within the reference's tolerance.
    if path == "explicit":
        np.testing.assert_array_equal(scored, output)
    else:
        np.testing.assert_allclose(scored, output, rtol=RTOL, atol=ATOL)
    assert weights.shape == (batch, config["num_heads"], time, time)
    np.testing.assert_allclose(weights, ref_weights, rtol=RTOL, atol=ATOL)
    # Rows with nothing to attend are exactly zero, not just close to it.
    empty = ref_weights.sum(-1) == 0
    assert np.all(weights[empty] == 0)


# In `make test`, 60 configurations on PyTorch and 20 on TensorFlow (60
# took 9 s of its suite, the longest); on JAX (its eager calls compile every
# new shape: seconds a configuration) 5, in its slow suite; in the slow
# suite 400, 40 on JAX.
@pytest.mark.slow_on("jax", "five cases compiled op by op: 9 s")
@settings(max_examples={"jax": 5, "tensorflow": 20}.get(BACKEND, 60), **_SETTINGS)
@given(cases())
def test_matches_reference(case):
    _check(case)


@pytest.mark.slow
@settings(max_examples=40 if BACKEND == "jax" else 400, **_SETTINGS)
@given(cases())
def test_matches_reference_long(case):
    _check(case)
