"""The float64 second reference of the export checks (`parity.exact`) and its
rule (`rules.float64_judged`), on every backend; and a float64 layer itself
against numpy.

The reference is the checked model computed in float64 on the backend; it is
compared here with the independent numpy reference (`tests/reference.py`, in
float64). The rule is fed outputs of known distances from it: a float32
computation as exact as Keras's passes, one off by Keras's own distance
everywhere, or by several times its largest on one element, is refused.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

from keras_selfattn import SelfAttention
from keras_selfattn.export.forward.graph import build_endpoint, keras_reference
from keras_selfattn.export.parity import exact, rules
from keras_selfattn.export.parity.rules import ParityRow
from tests.reference import for_layer

VOCAB, FEATURES = 40, 16
# JAX compiles each float64 eager op anew: about 12 s a test.
JAX_COMPILES = pytest.mark.slow_on("jax", "JAX compiles the float64 model's ops")


def _model(**config) -> tuple[keras.Model, SelfAttention]:
    """Padded tokens into a SelfAttention, weights 2 * N(0, 1): scores of
    tens, so float32 is measurably off the exact outputs."""
    keras.utils.set_random_seed(0)
    tokens = keras.Input((None,), dtype="int32", name="tokens")
    embedded = keras.layers.Embedding(VOCAB, FEATURES, mask_zero=True)(tokens)
    layer = SelfAttention(**config, name="attention")
    model = keras.Model(tokens, layer(embedded))
    rng = np.random.default_rng(0)
    for weight in model.weights:
        weight.assign(2.0 * rng.standard_normal(tuple(weight.shape)).astype("float32"))
    return model, layer


def _tokens(batch: int = 2, time: int = 24) -> np.ndarray:
    """Token ids, every row after the first padded at the end."""
    tokens = np.random.default_rng(1).integers(1, VOCAB, (batch, time))
    tokens[1:, time // 3 :] = 0
    return tokens.astype("int32")


def _dense_model() -> keras.Model:
    keras.utils.set_random_seed(0)
    tokens = keras.Input((None,), dtype="int32", name="tokens")
    x = keras.layers.Embedding(VOCAB, FEATURES)(tokens)
    x = keras.layers.Dense(32, activation="tanh")(x)
    x = keras.layers.LayerNormalization(epsilon=1e-3)(x)
    outputs = keras.layers.Dense(5, activation="softmax", name="probabilities")(x)
    return keras.Model(tokens, outputs)


def _numpy_dense_model(model: keras.Model, tokens: np.ndarray) -> np.ndarray:
    """`_dense_model` in float64 numpy, from its weights."""
    table, w1, b1, gamma, beta, w2, b2 = (
        w.astype("float64") for w in model.get_weights()
    )
    x = np.tanh(table[tokens] @ w1 + b1)
    mean, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    x = (x - mean) / np.sqrt(var + 1e-3) * gamma + beta
    logits = x @ w2 + b2
    logits = np.exp(logits - logits.max(-1, keepdims=True))
    return logits / logits.sum(-1, keepdims=True)


def _float64(model: keras.Model, tokens: np.ndarray, attention_outputs=None) -> dict:
    reference = exact.Float64Reference(
        build_endpoint(model, attention_outputs),
        attention_outputs,
        [{"tokens": tokens}],
    )
    (found,) = reference([0])[0]
    assert reference.unavailable is None and reference.note() == ()
    return found


@JAX_COMPILES
def test_the_reference_computes_in_float64():
    """Keras layers in float64 on this backend: numpy's float64 result to
    1e-12 where Keras's float32 is ~1e-7 away; JAX's x64 mode is on only for
    the reference, and the model itself still computes in float32."""
    model = _dense_model()
    tokens = _tokens()
    found = _float64(model, tokens)["probabilities"]
    want = _numpy_dense_model(model, tokens)
    assert found.dtype == np.float64 and np.abs(found - want).max() <= 1e-12
    float32 = keras.ops.convert_to_numpy(model(tokens))
    assert float32.dtype == np.float32 and np.abs(float32 - want).max() > 1e-8
    if keras.backend.backend() == "jax":
        import jax

        assert not jax.config.jax_enable_x64


@JAX_COMPILES
def test_the_reference_of_selfattention_is_closer_to_exact_than_keras():
    """SelfAttention in float64 against the numpy reference: its softmax
    computes in float32 by design (`attention.explicit`, on TensorFlow and
    JAX; PyTorch's fused kernel keeps float64), so the reference is not
    exact, but its errors are at most a fifth of Keras's float32 ones
    (root mean squares; measured 0.13x, 0.14x and 0.00x)."""
    model, layer = _model(
        num_heads=4, key_dim=6, value_dim=10, num_key_value_heads=2, use_gate=True,
        use_bias=True, causal=True,
    )  # fmt: skip
    tokens = _tokens(2, 64)
    found = _float64(model, tokens)["attention"]
    embedded = keras.ops.convert_to_numpy(model.layers[1](tokens)).astype("float64")
    want = for_layer(layer, embedded, padding_mask=tokens != 0)[0]
    real = (tokens != 0)[..., None]
    float32 = keras.ops.convert_to_numpy(model(tokens)).astype("float64")

    def rms(values):
        return np.sqrt(np.mean(np.square(values * real)))

    assert rms(float32 - want) > 1e-6  # scores of tens: float32 is off exact
    assert rms(found - want) <= 0.2 * rms(float32 - want)


@JAX_COMPILES
def test_attention_outputs_are_computed_in_float64_too():
    model, _ = _model(num_heads=2)
    tokens = _tokens(1, 9)
    found = _float64(model, tokens, "attention")
    float32 = keras_reference(build_endpoint(model, "attention"), {"tokens": tokens})
    assert sorted(found) == sorted(float32) == ["attention", "attention_weights"]
    for name, value in found.items():
        assert value.dtype == np.float64 and value.shape == float32[name].shape
        assert np.abs(value - float32[name]).max() < 1e-2


def test_an_unavailable_reference_says_why(monkeypatch):
    from keras_selfattn.export import precision

    def refuse(model):
        raise NotImplementedError("no float64 kernel\nfor this op")

    monkeypatch.setattr(precision, "float64_view", refuse)
    model, _ = _model(num_heads=2)
    reference = exact.Float64Reference(build_endpoint(model), None, [{}])
    assert reference([0]) == {}
    assert reference.note() == (
        "rows beyond the tolerance, no float64 reference: no float64 kernel for "
        "this op",
    )


# --------------------------------------------------------------- the rule
ATOL, RTOL = 1e-5, 1e-4


def _heavy_errors(rng, size: int) -> np.ndarray:
    """Float32 errors of an ill-conditioned model: most at rounding level, a
    few hundred times larger (positions whose softmax amplifies them)."""
    errors = 1e-6 * rng.standard_normal(size)
    where = rng.choice(size, size // 50, replace=False)
    errors[where] = 3e-4 * rng.standard_normal(where.size)
    return errors


def _judge(keras_out, exact_out, actual) -> ParityRow:
    """One run's row, beyond the tolerance, judged against float64."""
    row = ParityRow("onnx", "2x512", 0.0, 0.0, False)
    triples = [[(keras_out, exact_out, actual)]]
    return rules.float64_judged([row], triples, ATOL, RTOL)[0]


@pytest.fixture(scope="module")
def outputs():
    """(exact, keras): outputs of magnitude ~0.01 to 10 (so atol + rtol |x|
    is below float32's errors on many), Keras off exact by `_heavy_errors`."""
    rng = np.random.default_rng(0)
    exact_out = rng.standard_normal(4096) * 10.0 ** rng.uniform(-2, 1, 4096)
    return exact_out, exact_out + _heavy_errors(rng, 4096)


def test_as_exact_as_keras_passes(outputs):
    exact_out, keras_out = outputs
    other = exact_out + _heavy_errors(np.random.default_rng(1), exact_out.size)
    assert not rules.compare(keras_out, other, ATOL, RTOL)[2]  # beyond tolerance
    row = _judge(keras_out, exact_out, other)
    assert row.ok, row
    assert row.keras_float64_err == pytest.approx(np.abs(keras_out - exact_out).max())
    assert row.float64_err == pytest.approx(np.abs(other - exact_out).max())
    assert 0.5 < row.rms_ratio < rules.FLOAT64_MARGIN


def test_keras_own_distance_everywhere_is_refused(outputs):
    """Every element moved by Keras's own largest distance from float64:
    within the element rule, but many times Keras's root mean square."""
    exact_out, keras_out = outputs
    own = np.abs(keras_out - exact_out).max()
    row = _judge(keras_out, exact_out, keras_out + own)
    assert not row.ok and row.rms_ratio > 5 * rules.FLOAT64_MARGIN, row
    # Half of Keras's root mean square everywhere is still accepted.
    own_rms = np.sqrt(np.mean(np.square(keras_out - exact_out)))
    assert _judge(keras_out, exact_out, keras_out + own_rms / 2).ok


@pytest.mark.parametrize("times, ok", [(rules.FLOAT64_LARGEST + 0.5, False), (2, True)])
def test_one_element_beyond_the_largest_margin_is_refused(outputs, times, ok):
    exact_out, keras_out = outputs
    gaps = np.abs(keras_out - exact_out)
    where = int(np.argmin(np.abs(exact_out)))  # where the tolerance is atol alone
    actual = keras_out.copy()
    actual[where] = exact_out[where] + times * gaps.max() + 2 * ATOL
    assert _judge(keras_out, exact_out, actual).ok is ok


@pytest.mark.parametrize("broken", ["nan", "shape"])
def test_nan_or_another_shape_is_refused(outputs, broken):
    exact_out, keras_out = outputs
    actual = keras_out.copy()
    if broken == "nan":
        actual[0] = np.nan
    else:
        actual = actual[:-1]
    assert not _judge(keras_out, exact_out, actual).ok


def test_keras_exact_leaves_only_the_tolerance(outputs):
    """Where Keras is float64's own result, the rule allows atol, no more."""
    exact_out, _ = outputs
    assert _judge(exact_out, exact_out, exact_out + 0.5 * ATOL).ok
    assert not _judge(exact_out, exact_out, exact_out + 3 * ATOL).ok


def test_runs_are_pooled_and_rows_within_the_tolerance_kept(outputs):
    """A short run whose one ill-conditioned position Keras happened to get
    nearly right is judged with the long run beside it; a row within the
    tolerance keeps its verdict, unmeasured."""
    exact_out, keras_out = outputs
    rng = np.random.default_rng(2)
    other = exact_out + _heavy_errors(rng, exact_out.size)
    short_exact = rng.standard_normal(40)
    short_keras = short_exact + 1e-7 * rng.standard_normal(40)
    short_other = short_keras.copy()
    short_other[7] += np.abs(keras_out - exact_out).max()
    rows = [
        ParityRow("onnx", "2x512", 0.0, 0.0, False),
        ParityRow("onnx", "1x40", 0.0, 0.0, False),
        ParityRow("onnx", "1x1", 0.0, 0.0, True),
    ]
    runs = [
        [(keras_out, exact_out, other)],
        [(short_keras, short_exact, short_other)],
        [(short_keras[:1], short_exact[:1], short_keras[:1])],
    ]
    alone = rules.float64_judged(rows[1:2], runs[1:2], ATOL, RTOL)[0]
    assert not alone.ok and alone.rms_ratio > 100, alone
    long, short, within = rules.float64_judged(rows, runs, ATOL, RTOL)
    assert long.ok and short.ok, (long, short)
    assert long.rms_ratio == short.rms_ratio < rules.FLOAT64_MARGIN
    assert short.keras_float64_err < 1e-6 < short.float64_err
    assert within is rows[2] and within.float64_err is None


@pytest.mark.parametrize("sliding_window", [None, 3])
def test_a_float64_layer_with_an_output_projection_equals_numpy(sliding_window):
    # Keras's own matmul on PyTorch and JAX returns float32 for float64
    # operands (JAX's default, without x64): the output projection then
    # takes the heads in the dtype they come in, as Keras's Dense would.
    layer = SelfAttention(
        num_heads=2,
        key_dim=3,
        value_dim=2,
        output_dim=5,
        causal=True,
        sliding_window=sliding_window,
        dtype="float64",
    )
    x = np.random.default_rng(2).normal(size=(2, 6, 4))
    got = keras.ops.convert_to_numpy(layer(x))
    want = for_layer(layer, x)[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
