"""Every implementation path against the numpy reference, on every backend.

The paths are forced with the layer's own arguments (`flash_attention`,
`chunk_size`), and each test checks with `layer.implementation` that the
forced path is the one taken. The fused path does not exist on TensorFlow.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

from keras_selfattn import SelfAttention
from tests.backend import BACKEND, compiled, to_numpy, value_and_grad
from tests.paths import PATH_PARAMS, PATHS
from tests.reference import output_for_call

CONFIGS = {
    "plain": {},
    "causal": {"causal": True},
    "window": {"sliding_window": 2},
    "causal_window": {"causal": True, "sliding_window": 3},
    "bias_out": {"use_bias": True, "output_dim": 5, "bias_initializer": "ones"},
    "unscaled_dims": {"scale": 1.0, "key_dim": 3, "value_dim": 2},
}
RNG = np.random.default_rng(7)
X = RNG.normal(size=(3, 8, 6)).astype("float32")
RIGHT_PADDED = np.arange(8)[None, :] < np.array([[8], [5], [1]])
LEFT_PADDED = ~RIGHT_PADDED[:, ::-1]
ATTENTION = RNG.random((3, 8, 8)) > 0.5
ATTENTION[1, 2] = False  # a row with nothing to attend


def _skip_unfusable(path: str, config: dict, policy: str = "float32") -> None:
    """Skips the configurations a backend's kernel cannot take (the layer
    raises for them with flash_attention=True: see the tests below)."""
    if path != "fused":
        return
    if "sliding_window" in config and BACKEND == "torch":
        pytest.skip("PyTorch's fused kernel takes no sliding_window")
    if config.get("value_dim", config.get("key_dim")) != config.get("key_dim"):
        if BACKEND == "jax":
            pytest.skip("JAX's kernel needs value_dim equal to key_dim")
    if policy == "mixed_float16" and BACKEND == "jax":
        pytest.skip("JAX's kernel takes float16 only on a GPU")


def _layer(path: str, heads: int = 2, **config) -> SelfAttention:
    _skip_unfusable(path, config)
    layer = SelfAttention(num_heads=heads, **PATHS[path], **config)
    layer.build(X.shape)
    return layer


def _masks(kind: str) -> dict:
    return {
        "none": {},
        "right_padded": {"mask": RIGHT_PADDED},
        "left_padded": {"mask": LEFT_PADDED},
        "attention": {"attention_mask": ATTENTION},
        "padding_and_attention": {"mask": LEFT_PADDED, "attention_mask": ATTENTION},
    }[kind]


@pytest.mark.parametrize("path", PATH_PARAMS)
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize(
    "heads",
    [
        # JAX compiles each eager call's shapes anew: the one-head half of the
        # matrix is in its slow suite, and in every other backend's fast one.
        pytest.param(1, marks=pytest.mark.slow_on("jax", "one head")),
        2,
    ],
)
@pytest.mark.parametrize(
    "mask_kind",
    ["none", "right_padded", "left_padded", "attention", "padding_and_attention"],
)
def test_path_matches_reference(path, config, heads, mask_kind):
    masks = _masks(mask_kind)
    if path == "fused" and "attention_mask" in masks:
        pytest.skip("the fused path takes no attention_mask (covered below)")
    layer = _layer(path, heads, **CONFIGS[config])
    assert layer.implementation(X, **masks) == path
    output = to_numpy(layer(X, **masks))
    np.testing.assert_allclose(
        output, output_for_call(layer, X, masks), atol=2e-5, rtol=1e-5
    )


@pytest.mark.parametrize("path", PATH_PARAMS)
@pytest.mark.parametrize("mask_kind", ["right_padded", "left_padded"])
def test_path_under_jit_with_masks(path, mask_kind):
    masks = _masks(mask_kind)
    layer = _layer(path, causal=True)
    run = compiled(lambda x, mask: layer(x, mask=mask))
    output = to_numpy(run(X, masks["mask"]))
    np.testing.assert_allclose(
        output, output_for_call(layer, X, masks), atol=2e-5, rtol=1e-5
    )


@pytest.mark.parametrize("path", PATH_PARAMS)
def test_gradients_finite_with_fully_padded_sequence(path):
    mask = RIGHT_PADDED.copy()
    mask[2] = False  # nothing real in the third sequence
    layer = _layer(path, causal=True, use_bias=True, output_dim=4)

    def loss(x):
        return keras.ops.sum(keras.ops.square(layer(x, mask=mask)))

    _, grads = value_and_grad(loss, layer.trainable_variables, [X])
    for grad in grads:
        assert grad is not None and np.isfinite(grad).all()
    output = to_numpy(layer(X, mask=mask))
    assert (output[2] == 0).all()
    np.testing.assert_allclose(
        output, output_for_call(layer, X, {"mask": mask}), atol=2e-5, rtol=1e-5
    )


@pytest.mark.parametrize("path", PATH_PARAMS)
@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_half_precision_scores_beyond_float16_range(path, policy):
    """Scores of about 4.6e7 (float16's largest is 65504) stay finite."""
    _skip_unfusable(path, {}, policy)
    keras.mixed_precision.set_global_policy(policy)
    layer = SelfAttention(kernel_initializer="ones", **PATHS[path])
    x = np.full((1, 5, 8), 300.0, "float32")
    x[0, 0] = 299.0
    assert layer.implementation(x) == path
    output = to_numpy(keras.ops.cast(layer(x), "float32"))
    assert np.isfinite(output).all()
    # Every value row is 8 * x (the kernels are ones), and so is the output.
    np.testing.assert_allclose(output[0, 1:], 2400.0, rtol=1e-2)


@pytest.mark.parametrize("path", PATH_PARAMS)
@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_half_precision_close_to_float32(path, policy):
    _skip_unfusable(path, {}, policy)
    reference = _layer(path, causal=True, use_bias=True, output_dim=6)
    expected = output_for_call(reference, X, {"mask": RIGHT_PADDED})
    keras.mixed_precision.set_global_policy(policy)
    layer = _layer(path, causal=True, use_bias=True, output_dim=6)
    layer.set_weights(reference.get_weights())
    output = layer(X, mask=RIGHT_PADDED)
    assert keras.backend.standardize_dtype(output.dtype) == policy.split("_")[1]
    output = to_numpy(keras.ops.cast(output, "float32"))
    np.testing.assert_allclose(output, expected, atol=5e-2, rtol=5e-2)


def _on_accelerator() -> bool:
    """Whether this suite's tensors live on a GPU or TPU: JAX's default
    device, or where Keras's PyTorch backend puts a new tensor."""
    if BACKEND == "jax":
        import jax

        return jax.default_backend() != "cpu"
    if BACKEND == "torch":
        return keras.ops.convert_to_tensor(X).device.type != "cpu"
    return False


def test_automatic_choice():
    """flash_attention=None takes the fused path where it can on JAX and
    PyTorch, and the explicit path whenever the call needs the weights; with
    a chunk_size, the chunked path on the CPU (bounded memory) and the fused
    one on a GPU (whose kernels bound it)."""
    layer = SelfAttention(num_heads=2, dropout=0.5)
    layer.build(X.shape)
    automatic = "explicit" if BACKEND == "tensorflow" else "fused"
    assert layer.implementation(X) == automatic
    assert layer.implementation(X, mask=RIGHT_PADDED) == automatic
    assert layer.implementation(X, return_attention_scores=True) == "explicit"
    assert layer.implementation(X, training=True) == "explicit"
    assert layer.implementation(X, attention_mask=ATTENTION) == "explicit"
    chunked = SelfAttention(chunk_size=4)
    chunked.build(X.shape)
    bounded = "fused" if automatic == "fused" and _on_accelerator() else "chunked"
    assert chunked.implementation(X) == bounded


def test_keras_flash_attention_switches():
    """disable_flash_attention() turns the automatic choice off;
    enable_flash_attention() restores it; the layer's own True wins."""
    layer = SelfAttention(num_heads=2)
    layer.build(X.shape)
    required = SelfAttention(num_heads=2, flash_attention=True)
    required.build(X.shape)
    try:
        keras.config.disable_flash_attention()
        assert layer.implementation(X) == "explicit"
        if BACKEND != "tensorflow":
            assert required.implementation(X) == "fused"
    finally:
        keras.config.enable_flash_attention()
    assert layer.implementation(X) == (
        "explicit" if BACKEND == "tensorflow" else "fused"
    )
    if BACKEND == "tensorflow":
        with pytest.raises(ValueError, match="tensorflow backend has no fused"):
            required.implementation(X)


@pytest.mark.parametrize(
    ("call", "reason"),
    [
        ({"return_attention_scores": True}, "return_attention_scores=True"),
        ({"training": True}, "dropout on the weights"),
        ({"attention_mask": ATTENTION}, "attention_mask"),
    ],
)
def test_flash_attention_true_says_why_it_cannot(call, reason):
    layer = SelfAttention(num_heads=2, dropout=0.1, flash_attention=True)
    layer.build(X.shape)
    with pytest.raises(ValueError, match="flash_attention=True") as caught:
        layer(X, **call)
    assert reason in str(caught.value)


# name -> (layer arguments, inputs, call arguments, what the error names).
BAD_CALLS = {
    "rank 2 inputs": ({}, X[0], {}, r"rank 3.*inputs.shape=\(8, 6\)"),
    "int inputs": ({}, X.astype("int32"), {}, r"inputs.dtype=int32"),
    "a list of inputs": ({}, [X, X], {}, r"inputs=a list of 2 items"),
    # Unbuilt: 5 features for 2 heads; built: not the 6 features it was built for.
    "5 features": ({}, X[..., :5], {}, r"features=(5|6)"),
    "mask shape": ({}, X, {"mask": RIGHT_PADDED[:, :5]}, r"mask.shape=\(3, 5\)"),
    "attention_mask shape": (
        {},
        X,
        {"attention_mask": ATTENTION[:, :5]},
        r"attention_mask.shape=\(3, 5, 8\)",
    ),
    "weights of a chunked layer": (
        {"chunk_size": 4},
        X,
        {"return_attention_scores": True},
        r"chunk_size=4.*return_attention_scores=True",
    ),
    # The mask is checked before the kernel is chosen, as in the call.
    "mask shape before flash_attention": (
        {"flash_attention": True},
        X,
        {"mask": RIGHT_PADDED[:, :5], "return_attention_scores": True},
        r"mask.shape=\(3, 5\)",
    ),
}


@pytest.mark.parametrize("built", [False, True], ids=["unbuilt", "built"])
@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_implementation_raises_what_the_call_raises(case, built):
    """implementation() checks its arguments as the call does: the same
    ValueError, built or not (and it builds nothing)."""
    config, inputs, call, message = BAD_CALLS[case]

    def layer():
        layer = SelfAttention(num_heads=2, name="checked", **config)
        if built:
            layer.build(X.shape)
        return layer

    keras.config.disable_traceback_filtering()  # the call's message, bare
    try:
        with pytest.raises(ValueError, match=message) as from_call:
            layer()(inputs, **call)
    finally:
        keras.config.enable_traceback_filtering()
    asked = layer()
    with pytest.raises(ValueError, match=message) as from_implementation:
        asked.implementation(inputs, **call)
    assert str(from_implementation.value) == str(from_call.value)
    assert asked.built == built


@pytest.mark.skipif(BACKEND != "jax", reason="a limit of JAX's kernel")
def test_jax_flash_attention_true_needs_equal_head_dims():
    layer = SelfAttention(key_dim=4, value_dim=3, flash_attention=True)
    with pytest.raises(ValueError, match="value_dim equal to key_dim"):
        layer(X)
    automatic = SelfAttention(key_dim=4, value_dim=3)
    assert automatic.implementation(X) == "explicit"


def test_flash_attention_argument_is_validated_and_serialized():
    with pytest.raises(ValueError, match="flash_attention"):
        SelfAttention(flash_attention="yes")
    for value in (None, True, False):
        config = SelfAttention(flash_attention=value).get_config()
        assert config["flash_attention"] is value
        assert SelfAttention.from_config(config).flash_attention is value


@pytest.mark.skipif(BACKEND != "jax", reason="checks JAX's attention function")
def test_jax_fused_path_calls_jax_attention(monkeypatch):
    import jax

    calls = []
    original = jax.nn.dot_product_attention

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return original(*args, **kwargs)

    monkeypatch.setattr(jax.nn, "dot_product_attention", spy)
    layer = _layer("fused", causal=True)
    run = jax.jit(lambda x, mask: layer(x, mask=mask))
    np.testing.assert_allclose(
        to_numpy(run(X, RIGHT_PADDED)),
        output_for_call(layer, X, {"mask": RIGHT_PADDED}),
        atol=2e-5,
    )
    # Right-padded batches pass sequence lengths (cuDNN's padding mask); the
    # other branch, for any other padding, passes a boolean mask.
    assert any("key_value_seq_lengths" in call for call in calls)
    assert any("mask" in call for call in calls)
    assert all(call["is_causal"] for call in calls)


@pytest.mark.skipif(BACKEND != "torch", reason="checks PyTorch's SDPA")
def test_torch_fused_path_calls_sdpa(monkeypatch):
    import torch

    calls = []
    original = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return original(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    layer = _layer("fused", causal=True)
    np.testing.assert_allclose(
        to_numpy(layer(X)), output_for_call(layer, X, {}), atol=2e-5
    )
    assert calls and calls[0]["is_causal"] and calls[0]["attn_mask"] is None
