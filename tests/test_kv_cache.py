"""Decoding with a key/value cache equals the full causal forward.

Each test decodes a sequence a few positions at a time with
`layer(x, cache=..., cache_update_index=...)` and compares with the layer's
own full causal call, which the other suites compare with the numpy
reference; the first test also compares with the reference directly.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

from keras_selfattn import SelfAttention
from tests.backend import BACKEND, compiled, to_numpy
from tests.reference import for_layer

RNG = np.random.default_rng(5)
X = RNG.normal(size=(2, 9, 8)).astype("float32")
LEFT_PADDED = np.ones((2, 9), bool)
LEFT_PADDED[1, :3] = False
CONFIGS = {
    "plain": {},
    "gqa": {"num_key_value_heads": 2},
    "mqa_rope_gate": {
        "num_key_value_heads": 1,
        "rope_max_wavelength": 50.0,
        "use_gate": True,
        "output_dim": 6,
        "use_bias": True,
    },
    "rope_scaled": {"rope_max_wavelength": 100.0, "rope_scaling_factor": 2.0},
    "window": {"sliding_window": 3, "num_key_value_heads": 2},
}
PATHS = {"explicit": False, "fused": True}


def _decode(layer, x, step, run=None, **masks):
    run = run or (
        lambda x, cache, index: layer(x, cache=cache, cache_update_index=index, **masks)
    )
    cache = layer.empty_cache(x.shape[0], x.shape[1])
    outputs = []
    for index in range(0, x.shape[1], step):
        output, cache = run(x[:, index : index + step], cache, index)
        outputs.append(to_numpy(output))
    return np.concatenate(outputs, axis=1), to_numpy(cache)


# On JAX (eager calls compile every op anew: 12 s for the first
# configuration in `make test`) the slow suite decodes them;
# test_cached_decoding_under_jit_with_a_tensor_index decodes in `make test`.
@pytest.mark.slow_on("jax", "eager decoding")
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize(
    "step",
    [
        # One token a call: nine eager calls, each compiled anew on JAX;
        # test_cached_decoding_under_jit_with_a_tensor_index decodes one token
        # a call there in `make test`.
        pytest.param(1, marks=pytest.mark.slow_on("jax", "one token a call")),
        4,
    ],
)
@pytest.mark.parametrize("padded", [False, True])
def test_cached_decoding_equals_full_forward(path, config, step, padded):
    if PATHS[path] and BACKEND == "tensorflow":
        pytest.skip("TensorFlow has no fused attention kernel")
    if PATHS[path] and BACKEND == "torch" and "sliding_window" in CONFIGS[config]:
        pytest.skip("PyTorch's fused kernel takes no sliding_window")
    layer = SelfAttention(
        num_heads=4,
        key_dim=4,
        causal=True,
        flash_attention=PATHS[path],
        **CONFIGS[config],
    )
    masks = {"mask": LEFT_PADDED} if padded else {}
    full = to_numpy(layer(X, **masks))
    decoded, cache = _decode(layer, X, step, **masks)
    np.testing.assert_allclose(decoded, full, atol=1e-5, rtol=1e-5)
    assert cache.shape == (2, 2, 9, layer.num_key_value_heads or 4, 4)
    if config == "plain" and not padded:
        np.testing.assert_allclose(full, for_layer(layer, X)[0], atol=2e-5)


def test_cached_decoding_under_jit_with_a_tensor_index():
    layer = SelfAttention(num_heads=2, key_dim=4, causal=True, rope_max_wavelength=10.0)
    full = to_numpy(layer(X))
    step = compiled(
        lambda x, cache, index: layer(x, cache=cache, cache_update_index=index)
    )

    def run(x, cache, index):
        return step(x, cache, np.int32(index))

    decoded, _ = _decode(layer, X, 1, run=run)
    np.testing.assert_allclose(decoded, full, atol=1e-5, rtol=1e-5)


def test_cache_is_grouped_query_sized():
    gqa = SelfAttention(num_heads=8, key_dim=4, num_key_value_heads=2, causal=True)
    mha = SelfAttention(num_heads=8, key_dim=4, causal=True)
    for layer in (gqa, mha):
        layer.build(X.shape)
    assert (
        to_numpy(gqa.empty_cache(2, 16)).nbytes * 4
        == to_numpy(mha.empty_cache(2, 16)).nbytes
    )


@pytest.mark.parametrize(
    ("layer_kwargs", "call_kwargs", "message"),
    [
        ({"causal": False}, {"cache_update_index": 0}, "needs causal=True"),
        ({"causal": True}, {}, "cache_update_index=None"),
        (
            {"causal": True},
            {"cache_update_index": 0, "return_attention_scores": True},
            "return_attention_scores=True",
        ),
        ({"causal": True}, {"cache_update_index": 8}, "do not fit a cache"),
        ({"causal": True, "value_dim": 2}, {"cache_update_index": 0}, "value_dim"),
    ],
)
def test_bad_cache_calls(layer_kwargs, call_kwargs, message):
    layer = SelfAttention(num_heads=2, key_dim=4, **layer_kwargs)
    layer.build(X.shape)
    cache = np.zeros((2, 2, 9, 2, 4), "float32")
    with pytest.raises(ValueError, match=message):
        layer(X[:, :3], cache=cache, **call_kwargs)


def test_bad_cache_shape_and_unbuilt_empty_cache():
    layer = SelfAttention(num_heads=2, key_dim=4, causal=True)
    with pytest.raises(ValueError, match="not built"):
        layer.empty_cache(2, 9)
    layer.build(X.shape)
    with pytest.raises(ValueError, match=r"cache.shape=\(2, 2, 9, 3, 4\)"):
        layer(
            X[:, :1], cache=np.zeros((2, 2, 9, 3, 4), "float32"), cache_update_index=0
        )
    with pytest.raises(ValueError, match="max_length"):
        layer.empty_cache(2, 0)
    with pytest.raises(
        ValueError, match="cache_update_index goes with|goes with `cache`"
    ):
        layer(X, cache_update_index=0)


def test_a_bad_decoding_mask_names_the_cache_shape_it_must_match():
    # While decoding, `mask` covers the whole cache: (batch, max_length),
    # and the error says so (not the one-token inputs' shape).
    layer = SelfAttention(num_heads=2, key_dim=4, causal=True)
    layer.build(X.shape)
    cache = layer.empty_cache(2, 9)
    expected = (
        r"`mask` must have shape \(batch, max_length\) = \(2, 9\) to match "
        r"\(inputs.shape\[0\], cache.shape\[2\]\)=\(2, 9\). "
        r"Received: mask.shape=\(2, 1\)"
    )
    with pytest.raises(ValueError, match=expected):
        layer(
            X[:, :1],
            cache=cache,
            cache_update_index=0,
            mask=np.ones((2, 1), bool),
        )


@pytest.mark.slow_on("jax", "eager decoding compiled op by op in two dtypes")
@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
@pytest.mark.parametrize("path", list(PATHS))
def test_cached_decoding_in_mixed_precision(policy, path):
    if PATHS[path] and BACKEND == "tensorflow":
        pytest.skip("TensorFlow has no fused attention kernel")
    if PATHS[path] and BACKEND == "jax" and policy == "mixed_float16":
        pytest.skip("JAX's kernel takes float16 only on a GPU")
    keras.mixed_precision.set_global_policy(policy)
    layer = SelfAttention(
        num_heads=4,
        key_dim=4,
        causal=True,
        flash_attention=PATHS[path],
        **CONFIGS["mqa_rope_gate"],
    )
    full = to_numpy(keras.ops.cast(layer(X), "float32"))
    decoded, cache = _decode(layer, X, 3)
    assert str(cache.dtype) == policy.split("_")[1]  # the compute dtype
    assert np.isfinite(decoded.astype("float32")).all()
    np.testing.assert_allclose(decoded.astype("float32"), full, atol=5e-2, rtol=5e-2)


# ------------------------------------------------------- one new token a call
def _single_query_layer(config: str) -> SelfAttention:
    layer = SelfAttention(
        num_heads=4, key_dim=4, causal=True, flash_attention=False, **CONFIGS[config]
    )
    layer.build(X.shape)
    return layer


@pytest.mark.parametrize("config", ["gqa", "window", "mqa_rope_gate", "plain"])
@pytest.mark.parametrize("padded", [False, True])
def test_one_new_token_takes_the_single_query_path_and_matches_the_reference(
    config, padded
):
    """Prefill five positions (explicit path), then decode the last four one
    call each (single-query path), traced, against the numpy reference."""
    layer = _single_query_layer(config)
    masks = {"mask": LEFT_PADDED} if padded else {}
    cache = layer.empty_cache(2, 9)
    for new, path in ((2, "explicit"), (1, "single_query")):
        x = X[:, :new]
        assert layer.implementation(x, cache=cache, cache_update_index=5, **masks) == (
            path
        )
    step = compiled(
        lambda x, cache, index: layer(x, cache=cache, cache_update_index=index, **masks)
    )
    prefix, cache = layer(X[:, :5], cache=cache, cache_update_index=0, **masks)
    outputs = [to_numpy(prefix)]
    for index in range(5, 9):
        output, cache = step(X[:, index : index + 1], cache, np.int32(index))
        outputs.append(to_numpy(output))
    reference = for_layer(layer, X, **({"padding_mask": LEFT_PADDED} if padded else {}))
    np.testing.assert_allclose(
        np.concatenate(outputs, axis=1), reference[0], atol=2e-5, rtol=2e-5
    )


def test_the_automatic_choice_for_one_new_token():
    """TensorFlow has no fused kernel: its one-token decoding calls take the
    single-query path; JAX and PyTorch keep their fused kernels."""
    layer = SelfAttention(
        num_heads=4, key_dim=4, causal=True, num_key_value_heads=2, dropout=0.5
    )
    layer.build(X.shape)
    one = {"cache": layer.empty_cache(2, 9), "cache_update_index": 3}
    assert layer.implementation(X[:, :1], **one) == (
        "single_query" if BACKEND == "tensorflow" else "fused"
    )
    # Dropout on the weights (in training) needs the weights.
    assert layer.implementation(X[:, :1], training=True, **one) == "explicit"


@pytest.mark.slow_on("jax", "eager calls compiled op by op in two dtypes")
@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_one_new_token_in_mixed_precision(policy):
    """float16 scores formed in float32: large inputs stay finite.

    float16 is compared at raw scores far past its 65504, where both paths
    form scores in float32. bfloat16 has float32's range, and the full
    forward (the explicit path) rounds its scores to bfloat16's 8 bits: at
    those scores softmax is nearly an argmax, and weights drawn at random
    gave near ties that the two paths broke differently (2 runs of this
    file in 14 failed), so bfloat16 is compared at the unscaled inputs.
    """
    keras.mixed_precision.set_global_policy(policy)
    layer = _single_query_layer("mqa_rope_gate")
    inputs = X * (300.0 if policy == "mixed_float16" else 1.0)
    full = to_numpy(keras.ops.cast(layer(inputs), "float32"))
    _, cache = layer(inputs[:, :8], cache=layer.empty_cache(2, 9), cache_update_index=0)
    assert layer.implementation(inputs[:, 8:], cache=cache, cache_update_index=8) == (
        "single_query"
    )
    output, _ = layer(inputs[:, 8:], cache=cache, cache_update_index=8)
    output = to_numpy(keras.ops.cast(output, "float32"))
    assert np.isfinite(output).all()
    np.testing.assert_allclose(output, full[:, 8:], atol=5e-2, rtol=5e-2)


@pytest.mark.skipif(
    BACKEND != "tensorflow",
    reason="caches are read time-major only in TensorFlow graphs without XLA",
)
@pytest.mark.parametrize("config", ["gqa", "window", "mqa_rope_gate"])
@pytest.mark.parametrize("padded", [False, True])
def test_time_major_caches_decode_as_the_reference(config, padded):
    """The generation loop's steps: one token a call in a `tf.function`,
    on a `TimeMajorCache` (checked by its caller) holding zeros where
    padded. Outputs match the numpy reference, and the
    cache ends as the public-layout decoding's, transposed."""
    import tensorflow as tf

    from keras_selfattn.attention import cache as cache_lib
    from keras_selfattn.generation import loop

    layer = _single_query_layer(config)
    masks = {"mask": LEFT_PADDED} if padded else {}
    public = layer.empty_cache(2, 9)
    prefix, public = layer(X[:, :5], cache=public, cache_update_index=0, **masks)
    slots = LEFT_PADDED if padded else np.ones((2, 9), bool)
    slots = slots[:, None, :, None, None].astype("float32")
    time_major = cache_lib.TimeMajorCache.from_batch_major
    cache = to_numpy(time_major(to_numpy(public) * slots).tensor)

    @tf.function
    def step(x, cache, index):
        assert loop.cache_classes().steps is cache_lib.TimeMajorCache
        cache = cache_lib.TimeMajorCache(cache)
        output, cache = layer(x, cache=cache, cache_update_index=index, **masks)
        return output, cache.tensor

    outputs = [to_numpy(prefix)]
    for index in range(5, 9):
        x = X[:, index : index + 1]
        output, cache = step(x, cache, tf.constant(index))
        _, public = layer(x, cache=public, cache_update_index=index, **masks)
        outputs.append(to_numpy(output))
    reference = for_layer(layer, X, **({"padding_mask": LEFT_PADDED} if padded else {}))
    np.testing.assert_allclose(
        np.concatenate(outputs, axis=1), reference[0], atol=2e-5, rtol=2e-5
    )
    expected = to_numpy(time_major(to_numpy(public) * slots).tensor)
    np.testing.assert_allclose(to_numpy(cache), expected, atol=1e-6)


@pytest.mark.skipif(
    BACKEND != "torch", reason="caches are written in place only in eager PyTorch"
)
@pytest.mark.parametrize("padded", [False, True])
def test_eager_torch_steps_write_their_caches_in_place(padded):
    """The generation loop's steps on PyTorch: on a `TorchInPlaceCache`,
    one token a call writes into the cache it is given (the same tensor
    comes back, no copy of the cache per step), outputs match the numpy
    reference and the cache ends as the copying calls' do; outside that
    mode the cache passed in is left as it was."""
    import torch

    from keras_selfattn.attention import cache as cache_lib

    layer = _single_query_layer("gqa")
    masks = {"mask": LEFT_PADDED} if padded else {}
    public = layer.empty_cache(2, 9)
    prefix, public = layer(X[:, :5], cache=public, cache_update_index=0, **masks)
    before = to_numpy(public).copy()
    _, written = layer(X[:, 5:6], cache=public, cache_update_index=5, **masks)
    assert written is not public
    np.testing.assert_array_equal(to_numpy(public), before)

    slots = LEFT_PADDED if padded else np.ones((2, 9), bool)
    cache = public * torch.as_tensor(
        slots[:, None, :, None, None], device=public.device
    )
    outputs = [to_numpy(prefix)]
    with torch.no_grad():
        for index in range(5, 9):
            x = X[:, index : index + 1]
            in_place = cache_lib.TorchInPlaceCache(cache)
            output, returned = layer(
                x, cache=in_place, cache_update_index=index, **masks
            )
            returned = returned.tensor
            assert returned is cache
            _, public = layer(x, cache=public, cache_update_index=index, **masks)
            outputs.append(to_numpy(output))
    reference = for_layer(layer, X, **({"padding_mask": LEFT_PADDED} if padded else {}))
    np.testing.assert_allclose(
        np.concatenate(outputs, axis=1), reference[0], atol=2e-5, rtol=2e-5
    )
    np.testing.assert_allclose(
        to_numpy(cache), to_numpy(public) * slots[:, None, :, None, None], atol=1e-6
    )
