"""Score modifications against the independent numpy reference.

ALiBi, T5's relative position bias, attention sinks, the logit soft-cap,
an additive `attention_bias` and packed sequences (`segment_ids`), alone and
all at once, on the layer's paths (the backend's default, the explicit one,
the chunked one), in cached decoding, saved and loaded, and their bad input.
"""

from __future__ import annotations

import os

import keras
import numpy as np
import pytest

from keras_selfattn import SelfAttention
from keras_selfattn.attention import score_mods
from tests import reference
from tests.backend import to_numpy, value_and_grad

RNG = np.random.default_rng(37)
B, T, D, H = 2, 7, 8, 4
X = RNG.normal(size=(B, T, D)).astype("float32")
PADDING = np.ones((B, T), bool)
PADDING[1, 5:] = False
SEGMENTS = np.array([[0, 0, 0, 1, 1, 2, 2], [3, 3, 4, 4, 4, 0, 0]], "int32")
TOLERANCE = {"rtol": 2e-5, "atol": 2e-5}

CONFIGS = {
    "alibi": {"position_bias": "alibi"},
    "relative": {
        "position_bias": "relative",
        "relative_attention_num_buckets": 8,
        "relative_attention_max_distance": 5,
    },
    "relative_causal": {
        "position_bias": "relative",
        "causal": True,
        "relative_attention_num_buckets": 6,
        "relative_attention_max_distance": 5,
    },
    "sinks": {"use_sinks": True},
    "soft_cap": {"logit_soft_cap": 0.7},
    "everything": {
        "position_bias": "relative",
        "relative_attention_num_buckets": 8,
        "relative_attention_max_distance": 6,
        "use_sinks": True,
        "logit_soft_cap": 1.5,
        "num_key_value_heads": 2,
        "causal": True,
        "rope_max_wavelength": 30.0,
        "use_bias": True,
    },
}
CALLS = {
    "plain": {},
    "padding": {"mask": PADDING},
    "bias_per_head": {"attention_bias": RNG.normal(size=(B, H, T, T))},
    "bias_shared": {"attention_bias": RNG.normal(size=(B, 1, T, T))},
    "bias_batchless": {"attention_bias": RNG.normal(size=(1, H, T, T))},
    "bias_per_key": {"attention_bias": RNG.normal(size=(B, 1, 1, T))},
    "segments": {"segment_ids": SEGMENTS, "mask": PADDING},
}
# JAX compiles every eager op anew for each shape: its `make test` runs the
# case that holds every modification, the others in its slow suite.
_JAX_SLOW = pytest.mark.slow_on("jax", "eager calls compiled op by op")


def _fast_on_jax(names, fast):
    return [n if n in fast else pytest.param(n, marks=_JAX_SLOW) for n in names]


PATHS = {
    "default": {},
    "explicit": {"flash_attention": False},
    "chunked": {"chunk_size": 3},
}


def _layer(config: dict, path: str = "default", **extra) -> SelfAttention:
    layer = SelfAttention(num_heads=H, **config, **PATHS[path], **extra)
    layer.build((None, None, D))
    for weight in layer.weights:  # the new weights start at 0: make them count
        if weight.name in ("relative_attention_bias", "sinks"):
            weight.assign(RNG.normal(size=weight.shape).astype("float32"))
    return layer


def _call(layer, x, call: dict):
    arguments = {
        k: (v.astype("float32") if k == "attention_bias" else v)
        for k, v in call.items()
    }
    return to_numpy(layer(x, **arguments))


def _expected(layer, x, call: dict) -> np.ndarray:
    return reference.for_layer(
        layer,
        x,
        padding_mask=call.get("mask"),
        attention_bias=call.get("attention_bias"),
        segment_ids=call.get("segment_ids"),
    )[0]


def test_alibi_slopes_are_keras_hubs():
    # keras-hub's slopes for 8 heads: 2^-1 ... 2^-8; for 6, those of 4 then
    # every other one of 8's.
    np.testing.assert_allclose(score_mods.alibi_slopes(8), 2.0 ** -np.arange(1, 9))
    np.testing.assert_allclose(
        score_mods.alibi_slopes(6), [2**-2, 2**-4, 2**-6, 2**-8, 2**-1, 2**-3]
    )
    for heads in (4, 6, 8, 12):
        for bias_max in (8.0, 4.0):
            np.testing.assert_allclose(
                score_mods.alibi_slopes(heads, bias_max),
                reference.alibi_slopes(heads, bias_max),
                rtol=1e-12,
            )


@pytest.mark.parametrize(
    "buckets,max_distance,bidirectional",
    [(32, 128, True), (32, 128, False), (8, 20, True), (2, 3, False), (10, 7, True)],
)
def test_relative_buckets_are_t5s(buckets, max_distance, bidirectional):
    table = score_mods.relative_buckets(buckets, max_distance, bidirectional)
    for distance in range(-3 * max_distance, 3 * max_distance + 1):
        clipped = int(np.clip(distance, -max_distance, max_distance))
        assert table[clipped + max_distance] == reference.t5_bucket(
            distance, bidirectional, buckets, max_distance
        ), distance


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("config", _fast_on_jax(CONFIGS, ("everything",)))
def test_each_modification_matches_the_reference(config, path):
    layer = _layer(CONFIGS[config], path)
    for name in ("plain", "padding"):
        np.testing.assert_allclose(
            _call(layer, X, CALLS[name]),
            _expected(layer, X, CALLS[name]),
            **TOLERANCE,
            err_msg=name,
        )


@pytest.mark.parametrize("path", _fast_on_jax(PATHS, ("default",)))
@pytest.mark.parametrize(
    "call",
    _fast_on_jax(
        [c for c in CALLS if c not in ("plain", "padding")],
        ("bias_per_key", "segments"),
    ),
)
def test_call_biases_and_segments_match_the_reference(call, path):
    for config in ({}, CONFIGS["everything"]):
        layer = _layer(config, path)
        np.testing.assert_allclose(
            _call(layer, X, CALLS[call]),
            _expected(layer, X, CALLS[call]),
            **TOLERANCE,
        )


def test_a_bias_never_unmasks_and_non_finite_bias_at_masked_keys_changes_nothing():
    layer = _layer(CONFIGS["everything"], "default")
    bias = RNG.normal(size=(B, H, T, T)).astype("float32")
    hostile = bias.copy()
    hostile[1, :, :, 5:] = np.nan  # padded keys
    hostile[0, :, 2, 5] = np.inf  # a later key of a causal layer
    hostile[0, :, 0, 3:] = -np.inf
    expected = _call(layer, X, {"mask": PADDING, "attention_bias": bias})
    hostile_out = _call(layer, X, {"mask": PADDING, "attention_bias": hostile})
    assert np.isfinite(hostile_out).all()
    # Row 0's query 0 sees key 0 only (causal): -inf on later keys is masked.
    np.testing.assert_allclose(hostile_out, expected, **TOLERANCE)


def test_sinks_take_all_the_mass_of_a_row_with_nothing_to_attend():
    layer = _layer({"use_sinks": True})
    nothing = np.zeros((B, T, T), bool)
    nothing[:, :, 0] = True
    nothing[0, 3] = False  # query 3 of row 0 attends nothing
    output, weights = layer(X, attention_mask=nothing, return_attention_scores=True)
    output, weights = to_numpy(output), to_numpy(weights)
    assert np.isfinite(output).all()
    np.testing.assert_array_equal(output[0, 3], 0.0)
    np.testing.assert_array_equal(weights[0, :, 3], 0.0)
    # Elsewhere a sink takes some mass: weights sum below 1.
    assert (weights[1, :, 2].sum(-1) < 1 - 1e-4).all()


@pytest.mark.slow_on("jax", "compiles each segment's call: 10 s")
def test_a_packed_row_equals_its_segments_run_alone():
    config = {"causal": True, "position_bias": "alibi", "rope_max_wavelength": 20.0}
    layer = _layer(config, "chunked")
    lengths = (3, 5, 4)
    x = RNG.normal(size=(1, sum(lengths), D)).astype("float32")
    segments = np.repeat(np.arange(len(lengths)), lengths)[None].astype("int32")
    packed = to_numpy(layer(x, segment_ids=segments))
    start = 0
    for length in lengths:
        alone = to_numpy(layer(x[:, start : start + length]))
        np.testing.assert_allclose(
            packed[:, start : start + length], alone, **TOLERANCE
        )
        start += length


# On JAX each one-position call compiles anew: test_kv_cache decodes under
# jit there in `make test`; these run in its slow suite.
@_JAX_SLOW
@pytest.mark.parametrize("config", ["alibi", "relative_causal", "sinks", "soft_cap"])
def test_cached_decoding_equals_the_full_forward(config):
    causal = {**CONFIGS[config], "causal": True, "num_key_value_heads": 2}
    for path in ("default", "explicit"):
        layer = _layer(causal, path)
        full = _call(layer, X, {"mask": PADDING})
        cache = layer.empty_cache(B, T)
        steps = []
        for index in range(T):
            output, cache = layer(
                X[:, index : index + 1],
                cache=cache,
                cache_update_index=index,
                mask=PADDING,
            )
            steps.append(to_numpy(output))
        np.testing.assert_allclose(
            np.concatenate(steps, axis=1), full, **TOLERANCE, err_msg=path
        )


def test_saved_and_loaded_without_custom_objects(tmp_path):
    layer = _layer(CONFIGS["everything"])
    model = keras.Sequential([keras.Input((None, D)), layer])
    path = os.path.join(tmp_path, "model.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    np.testing.assert_allclose(
        to_numpy(loaded(X)), to_numpy(model(X)), rtol=1e-6, atol=1e-6
    )
    assert loaded.layers[0].get_config() == layer.get_config()


@pytest.mark.parametrize("path", ["default", "chunked"])
def test_the_new_weights_learn(path):
    layer = _layer(CONFIGS["everything"], path)
    weights = [layer.relative_attention_bias, layer.sinks]

    def loss():
        return keras.ops.sum(keras.ops.square(layer(X, mask=PADDING)))

    _, grads = value_and_grad(loss, weights)
    for grad in grads:
        assert grad is not None and np.abs(to_numpy(grad)).max() > 0


@pytest.mark.parametrize(
    "arguments,named",
    [
        ({"position_bias": "rotary"}, "position_bias='rotary'"),
        ({"logit_soft_cap": 0.0}, "logit_soft_cap=0.0"),
        ({"logit_soft_cap": -1}, "logit_soft_cap=-1"),
        ({"alibi_bias_max": 0}, "alibi_bias_max=0"),
        ({"relative_attention_num_buckets": 1}, "relative_attention_num_buckets=1"),
        (
            {"position_bias": "relative", "relative_attention_num_buckets": 3},
            "relative_attention_num_buckets=3",
        ),
        (
            {"position_bias": "relative", "relative_attention_max_distance": 8},
            "relative_attention_max_distance=8",
        ),
        ({"use_sinks": 1}, "use_sinks=1"),
    ],
)
def test_bad_arguments_are_named(arguments, named):
    with pytest.raises(ValueError, match=named.replace("(", r"\(")):
        SelfAttention(num_heads=H, **arguments)


@pytest.mark.parametrize(
    "call,named",
    [
        ({"attention_bias": np.zeros((B, 3, T, T), "float32")}, "attention_bias.shape"),
        ({"attention_bias": np.zeros((B, T, T), "float32")}, "attention_bias.shape"),
        ({"attention_bias": np.zeros((B, H, T, T), "int32")}, "attention_bias.dtype"),
        ({"segment_ids": np.zeros((B, T), "float32")}, "segment_ids.dtype"),
        ({"segment_ids": np.zeros((B, T + 1), "int32")}, "segment_ids.shape"),
    ],
)
def test_bad_call_inputs_are_named(call, named):
    layer = _layer({})
    with pytest.raises(ValueError, match=named):
        layer(X, **call)


def test_decoding_refuses_segment_ids():
    layer = _layer({"causal": True})
    with pytest.raises(ValueError, match="segment_ids"):
        layer(
            X[:, :1],
            cache=layer.empty_cache(B, T),
            cache_update_index=0,
            segment_ids=np.zeros((B, 1), "int32"),
        )


# Ids of one run per sequence, and ids that come back later in their row
# (which the packed path takes pair by pair where sizes may vary).
PACKINGS = {
    "runs": SEGMENTS,
    "interleaved": np.array([[1, 1, 2, 2, 1, 1, 3], [0, 2, 0, 2, 0, 2, 0]], "int32"),
}


@_JAX_SLOW
@pytest.mark.parametrize("segments", list(PACKINGS))
@pytest.mark.parametrize(
    "config",
    [
        # Learned modifications: off JAX, the runs or pairs differentiated as
        # they are; on JAX, the loop over key blocks.
        {"position_bias": "relative", "use_sinks": True, "causal": True},
        # None learned: on JAX, the packed path's own (FlashAttention's)
        # gradient.
        {
            "position_bias": "alibi",
            "logit_soft_cap": 1.5,
            "causal": True,
            "num_key_value_heads": 2,
        },
    ],
    ids=["learned", "soft_cap"],
)
def test_the_packed_path_and_its_gradients_equal_the_explicit_paths(config, segments):
    packed = _layer(config, "chunked")
    explicit = _layer(config, "explicit")
    explicit.set_weights(packed.get_weights())
    call = {"mask": PADDING, "segment_ids": PACKINGS[segments]}
    assert packed.implementation(X, **call) == "packed"
    np.testing.assert_allclose(
        _call(packed, X, call), _expected(packed, X, call), **TOLERANCE
    )
    results = []
    for layer in (packed, explicit):

        def loss(x, layer=layer):
            return keras.ops.sum(keras.ops.square(layer(x, **call)))

        results.append(value_and_grad(loss, layer.trainable_weights, [X]))
    (loss_packed, grads_packed), (loss_explicit, grads_explicit) = results
    np.testing.assert_allclose(loss_packed, loss_explicit, rtol=1e-5)
    for got, want in zip(grads_packed, grads_explicit, strict=True):
        np.testing.assert_allclose(to_numpy(got), to_numpy(want), rtol=1e-4, atol=1e-5)


@pytest.mark.tensorflow_only("jit_compile=True: the packed loop's own gradient")
@pytest.mark.parametrize("xla", [True, False], ids=["xla", "graph"])
def test_packed_training_gradients_in_tensorflow_functions(xla):
    import tensorflow as tf

    config = {"position_bias": "alibi", "logit_soft_cap": 1.5, "causal": True}
    packed = _layer(config, "chunked")
    explicit = _layer(config, "explicit")
    explicit.set_weights(packed.get_weights())
    call = {"mask": PADDING, "segment_ids": SEGMENTS, "training": True}
    assert packed.implementation(X, **call) == "packed"
    results = []
    for layer in (packed, explicit):

        @tf.function(jit_compile=xla)
        def gradients(x, layer=layer):
            with tf.GradientTape() as tape:
                tape.watch(x)
                loss = tf.reduce_sum(tf.square(layer(x, **call)))
            return tape.gradient(loss, [x, *layer.trainable_variables])

        results.append(gradients(tf.constant(X)))
    for got, want in zip(*results, strict=True):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "argument", ["attention_mask", "attention_bias", "segment_ids"]
)
def test_an_embeddings_keras_mask_holds_beside_other_tensor_arguments(argument):
    # Keras fills `mask` by itself only for a call with one tensor argument.
    tokens = np.array([[3, 1, 4, 1, 5, 9, 2], [6, 5, 3, 5, 0, 0, 0]], "int32")
    extra = {
        "attention_mask": np.tril(np.ones((B, T, T), bool)),
        "attention_bias": RNG.normal(size=(B, H, T, T)).astype("float32"),
        "segment_ids": SEGMENTS,
    }[argument]
    embedding = keras.layers.Embedding(10, D, mask_zero=True)
    layer = _layer({})
    token_input = keras.Input((None,), dtype="int32", name="tokens")
    extra_input = keras.Input(extra.shape[1:], dtype=extra.dtype.name, name="extra")
    outputs = layer(embedding(token_input), **{argument: extra_input})
    model = keras.Model([token_input, extra_input], outputs)
    got = to_numpy(model([tokens, extra]))
    x = to_numpy(embedding(tokens))
    want = reference.for_layer(layer, x, padding_mask=tokens != 0, **{argument: extra})[
        0
    ]
    np.testing.assert_allclose(got, want, **TOLERANCE)
    assert not got[1, 4:].any()  # padded positions output zeros


@pytest.mark.parametrize(
    "config,learned",
    [
        ({"position_bias": "alibi", "logit_soft_cap": 2.0}, False),
        ({"use_sinks": True}, True),
    ],
    ids=["alibi_cap", "sinks"],
)
def test_training_takes_the_packed_path_where_its_own_gradient_applies(config, learned):
    layer = _layer(config, "chunked")
    call = {"mask": PADDING, "segment_ids": SEGMENTS}
    # JAX needs static sizes: the loop over key blocks, with its own gradient
    # unless a modification is learned; elsewhere every run at once.
    own_gradient = not learned or keras.backend.backend() != "jax"
    assert layer.implementation(X, training=True, **call) == (
        "packed" if own_gradient else "chunked"
    )
    assert layer.implementation(X, training=False, **call) == "packed"


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_mixed_precision_keeps_biases_sinks_and_the_cap_in_float32(policy):
    # Long distances make ALiBi's bias large next to the scores, where a
    # half-precision bias would round visibly.
    time = 300
    x = RNG.normal(size=(1, time, D)).astype("float32")
    config = {"position_bias": "alibi", "use_sinks": True, "logit_soft_cap": 5.0}
    full = _layer(config)
    half = _layer(config, dtype=policy)
    half.set_weights(full.get_weights())
    assert half.sinks.dtype == "float32"
    expected = reference.for_layer(full, x)[0]
    got = to_numpy(keras.ops.cast(half(x), "float32"))
    assert np.isfinite(got).all()
    tolerance = {"mixed_float16": 5e-3, "mixed_bfloat16": 3e-2}[policy]
    assert np.abs(got - expected).max() <= tolerance * np.abs(expected).max()


def test_quantize_and_lora_leave_the_new_weights_as_they_are():
    layer = _layer(CONFIGS["everything"])
    before = [to_numpy(layer.relative_attention_bias), to_numpy(layer.sinks)]
    layer.quantize("int8")
    after = [to_numpy(layer.relative_attention_bias), to_numpy(layer.sinks)]
    for old, new in zip(before, after, strict=True):
        np.testing.assert_array_equal(old, new)
    assert layer.sinks.dtype == "float32"
    lora = _layer(CONFIGS["everything"])
    lora.enable_lora(2)
    assert not lora.relative_attention_bias.trainable and not lora.sinks.trainable
    assert all("lora" in w.name for w in lora.trainable_weights)
