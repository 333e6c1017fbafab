"""Keras attention models converted to SelfAttention compute what they did.

Each model is built with Keras's own `MultiHeadAttention` or
`GroupedQueryAttention`, given random weights (biases too), converted, and
its outputs compared with the original model's: the reference is Keras's
layer, never SelfAttention. Padded inputs are compared at real positions.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

import keras_selfattn
from keras_selfattn import SelfAttention

ATOL = 2e-5
D = 16
# JAX compiles each eager op for every new shape: 2-4 s per model here.
jax_slow = pytest.mark.slow_on("jax", "JAX compiles every eager op of a new model")


def _randomized(model: keras.Model, seed: int = 0) -> keras.Model:
    """`model` with random weights (zero biases would hide their mapping)."""
    rng = np.random.default_rng(seed)
    model.set_weights(
        [rng.normal(0, 0.3, w.shape).astype(w.dtype) for w in model.get_weights()]
    )
    return model


def _x(batch=2, time=6, seed=1):
    return np.random.default_rng(seed).normal(size=(batch, time, D)).astype("float32")


def _equal(a, b, atol=ATOL):
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(a), keras.ops.convert_to_numpy(b), atol=atol, rtol=0
    )


def _attention_layers(model):
    return [
        layer
        for layer in model._flatten_layers()
        if isinstance(layer, (SelfAttention, keras.layers.MultiHeadAttention))
        or isinstance(layer, keras.layers.GroupQueryAttention)
    ]


def encoder_block() -> keras.Model:
    x = keras.Input((None, D))
    a = keras.layers.MultiHeadAttention(4, 4, name="mha")(x, x)
    h = keras.layers.LayerNormalization()(keras.layers.Add()([x, a]))
    f = keras.layers.Dense(D)(keras.layers.Dense(32, activation="relu")(h))
    y = keras.layers.LayerNormalization()(keras.layers.Add()([h, f]))
    return _randomized(keras.Model(x, y, name="encoder"))


@pytest.fixture(scope="module")
def encoder():
    model = encoder_block()
    return model, keras_selfattn.convert(model)


def test_encoder_block_converts_with_its_outputs(encoder):
    model, new = encoder
    x = _x()
    _equal(new(x), model(x))
    assert [type(layer).__name__ for layer in _attention_layers(new)] == [
        "SelfAttention"
    ]
    assert "mha (MultiHeadAttention) -> SelfAttention" in str(new.conversion_report)
    assert [x._keras_history.operation.name for x in new.inputs] == [
        x._keras_history.operation.name for x in model.inputs
    ]


@jax_slow
def test_causal_grouped_query_model_converts():
    x = keras.Input((None, D))
    gqa = keras.layers.GroupQueryAttention(
        head_dim=4, num_query_heads=8, num_key_value_heads=2, use_bias=False
    )
    y = keras.layers.Dense(3)(gqa(x, x, use_causal_mask=True))
    model = _randomized(keras.Model(x, y))
    new = keras_selfattn.convert(model)
    sa = new.layers[1]
    assert (sa.num_heads, sa.num_key_value_heads, sa.causal) == (8, 2, True)
    assert sa.query_bias is None
    inputs = _x(time=7)
    _equal(new(inputs), model(inputs))


def _padded_classifier(with_attention_mask: bool):
    tokens = keras.Input((None,), dtype="int32")
    e = keras.layers.Embedding(50, D, mask_zero=True)(tokens)
    inputs = [tokens]
    kwargs = {"return_attention_scores": True}
    if with_attention_mask:
        inputs.append(keras.Input((None, None), dtype="bool"))
        kwargs["attention_mask"] = inputs[1]
    a, scores = keras.layers.MultiHeadAttention(2, 8, name="mha")(e, e, **kwargs)
    pooled = keras.layers.GlobalAveragePooling1D()(a)
    y = keras.layers.Dense(2, activation="softmax")(pooled)
    return _randomized(keras.Model(inputs, [y, a, scores]))


TOKENS = np.array([[5, 8, 2, 0, 0], [7, 1, 3, 9, 4]], "int32")
REAL = TOKENS != 0


@jax_slow
@pytest.mark.parametrize("with_attention_mask", [False, True])
def test_padded_classifier_equal_at_real_positions(with_attention_mask):
    model = _padded_classifier(with_attention_mask)
    new = keras_selfattn.convert(model)
    inputs = [TOKENS]
    if with_attention_mask:
        attend = np.tril(np.ones((5, 5), bool)) | np.eye(5, k=1, dtype=bool)
        inputs.append(np.broadcast_to(attend, (2, 5, 5)))
    y, a, scores = map(keras.ops.convert_to_numpy, model(inputs))
    new_y, new_a, new_scores = map(keras.ops.convert_to_numpy, new(inputs))
    _equal(new_y, y)  # a masked mean: real positions only
    real = REAL[:, :, None]
    _equal(np.where(real, new_a, 0), np.where(real, a, 0))
    np.testing.assert_array_equal(np.where(real, 0, new_a), 0)
    rows = REAL[:, None, :, None]
    _equal(np.where(rows, new_scores, 0), np.where(rows, scores, 0))
    assert new.conversion_report.padded
    assert "padded positions" in str(new.conversion_report)


@jax_slow
def test_self_and_cross_attention_model():
    x, memory = keras.Input((None, D)), keras.Input((None, 8))
    h = keras.layers.MultiHeadAttention(2, 4, name="self_attn")(
        x, x, use_causal_mask=True
    )
    y = keras.layers.MultiHeadAttention(2, 4, name="cross_attn")(h, memory)
    model = _randomized(keras.Model([x, memory], y))
    new = keras_selfattn.convert(model)
    kinds = {layer.name: type(layer).__name__ for layer in _attention_layers(new)}
    assert kinds == {"self_attn": "SelfAttention", "cross_attn": "MultiHeadAttention"}
    assert "cross_attn: a cross-attention call" in str(new.conversion_report)
    inputs = [_x(), np.random.default_rng(2).normal(size=(2, 4, 8)).astype("float32")]
    _equal(new(inputs), model(inputs))


@jax_slow
def test_nested_models_and_sequential_convert():
    x = keras.Input((None, D))
    inner = keras.Model(x, keras.layers.MultiHeadAttention(2, 8)(x, x), name="inner")
    model = keras.Sequential(
        [keras.Input((None, D)), keras.layers.Dense(D), inner, keras.layers.Dense(2)]
    )
    outer_x = keras.Input((None, D))
    outer = _randomized(keras.Model(outer_x, model(outer_x)))
    new = keras_selfattn.convert(outer)
    assert isinstance(new.layers[1], keras.Sequential)
    assert isinstance(new.layers[1].layers[1].layers[1], SelfAttention)
    inputs = _x()
    _equal(new(inputs), outer(inputs))


@jax_slow
@pytest.mark.parametrize(
    "options", [{}, {"use_gate": True, "sliding_window": 3}], ids=["plain", "gated"]
)
def test_from_multi_head_attention_value_dim_and_output_shape(options):
    mha = keras.layers.MultiHeadAttention(
        3, 4, value_dim=6, output_shape=10, dropout=0.1, seed=3, **options
    )
    x = _x()
    mha(x, x)
    _randomized(mha, seed=4)
    sa = SelfAttention.from_multi_head_attention(mha)
    assert (sa.value_dim, sa.output_dim, sa.dropout, sa.seed) == (6, 10, 0.1, 3)
    assert (sa.use_gate, sa.sliding_window) == (
        options.get("use_gate", False),
        options.get("sliding_window"),
    )
    _equal(sa(x), mha(x, x))
    mask = np.random.default_rng(5).random((2, 6, 6)) < 0.7
    mask |= np.eye(6, dtype=bool)  # every query attends something
    _equal(sa(x, attention_mask=mask), mha(x, x, attention_mask=mask))


def test_saved_converted_model_loads_and_trains(encoder, tmp_path):
    _, new = encoder
    path = str(tmp_path / "converted.keras")
    new.save(path)
    loaded = keras.models.load_model(path)  # no custom_objects
    x = _x()
    _equal(loaded(x), new(x), atol=0)
    loaded.compile("sgd", "mse")
    before = loaded.layers[1].query_kernel.numpy().copy()
    loaded.fit(x, np.zeros((2, 6, D), "float32"), epochs=1, verbose=0)
    assert not np.allclose(loaded.layers[1].query_kernel.numpy(), before)


class _Holder(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.mha = keras.layers.MultiHeadAttention(2, 4)

    def call(self, x):
        return self.mha(x, x[:, :2])


def test_what_is_not_converted_is_named():
    x = keras.Input((None, D))
    model = keras.Model(x, _Holder(name="holder")(x))
    report = keras_selfattn.convert(model).conversion_report
    assert report.converted == []
    assert len(report.kept) == 1
    assert "holder/multi_head_attention" in report.kept[0]
    assert "cross-attention" in report.kept[0]


class _CachedLike(keras.layers.MultiHeadAttention):
    """Overrides `call` only, as keras-hub's CachedMultiHeadAttention does."""

    def call(self, query, value, key=None, **kwargs):
        return super().call(query, value, key, **kwargs)


class _OtherSoftmax(keras.layers.MultiHeadAttention):
    def _masked_softmax(self, scores, attention_mask=None):
        return super()._masked_softmax(scores * 2.0, attention_mask)


def test_subclasses_overriding_only_call_convert_alone():
    x = keras.Input((None, D))
    layer = _CachedLike(2, 4, name="cached")
    model = _randomized(keras.Model(x, layer(x, x)))
    report = keras_selfattn.convert(model).conversion_report
    assert (
        report.converted == [] and "cached: a subclass, _CachedLike" in report.kept[0]
    )
    inputs = _x()
    _equal(SelfAttention.from_multi_head_attention(layer)(inputs), model(inputs))
    other = _OtherSoftmax(2, 4)
    other(inputs, inputs)
    with pytest.raises(ValueError, match="overrides _masked_softmax"):
        SelfAttention.from_multi_head_attention(other)


def test_refusals_are_one_line():
    class Sub(keras.Model):
        def call(self, x):
            return x

    with pytest.raises(ValueError, match="from_multi_head_attention") as error:
        keras_selfattn.convert(Sub())
    assert "\n" not in str(error.value)
    mha = keras.layers.MultiHeadAttention(2, 4)
    with pytest.raises(ValueError, match="not built"):
        SelfAttention.from_multi_head_attention(mha)
    mha(np.zeros((1, 3, D)), np.zeros((1, 4, 8)))
    with pytest.raises(ValueError, match="cross-attention"):
        SelfAttention.from_multi_head_attention(mha)
