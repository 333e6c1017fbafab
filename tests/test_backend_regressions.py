"""Bugs once found on JAX or PyTorch, each with the test that shows it gone,
and chunk_size's training memory on every backend."""

from __future__ import annotations

import itertools

import keras
import numpy as np
import pytest

from keras_selfattn import SelfAttention
from tests.backend import BACKEND, compiled, to_numpy
from tests.reference import for_layer

RNG = np.random.default_rng(11)
X = RNG.normal(size=(2, 11, 4)).astype("float32")
PADDING = np.arange(11)[None, :] < np.array([[11], [7]])
ATTENTION = RNG.random((2, 11, 11)) > 0.3


@pytest.mark.parametrize(
    ("causal", "window", "padding", "attention"),
    list(itertools.product([False, True], [None, 3], [False, True], [False, True])),
)
def test_chunked_every_mask_combination_compiled(causal, window, padding, attention):
    """Was: JAX, chunk_size + causal without a window raised
    TracerBoolConversionError (a key span growing with the block)."""
    layer = SelfAttention(
        num_heads=2, chunk_size=4, causal=causal, sliding_window=window
    )
    layer.build(X.shape)
    masks = {}
    if padding:
        masks["mask"] = PADDING
    if attention:
        masks["attention_mask"] = ATTENTION
    assert layer.implementation(X, **masks) == "chunked"
    run = compiled(lambda x, kwargs: layer(x, **kwargs))
    expected, _ = for_layer(
        layer,
        X,
        padding_mask=masks.get("mask"),
        attention_mask=masks.get("attention_mask"),
    )
    np.testing.assert_allclose(to_numpy(run(X, masks)), expected, atol=2e-5)
    np.testing.assert_allclose(to_numpy(layer(X, **masks)), expected, atol=2e-5)


@pytest.mark.slow_on(
    "jax", "tensorflow", "training steps compiled one by one; 7 s on TF"
)
def test_chunked_dropout_trains_repeatedly():
    """Was: JAX, chunk_size + dropout drew the seed inside the mapped block;
    the second call and fit raised UnexpectedTracerError."""
    layer = SelfAttention(num_heads=2, chunk_size=4, dropout=0.5, seed=3, causal=True)
    first = to_numpy(layer(X, training=True))
    second = to_numpy(layer(X, training=True))
    assert not np.array_equal(first, second)  # a new mask per call
    np.testing.assert_allclose(  # and none at inference
        to_numpy(layer(X)), for_layer(layer, X)[0], atol=2e-5
    )
    model = keras.Sequential([keras.Input((None, 4)), layer, keras.layers.Dense(1)])
    model.compile("adam", "mse", jit_compile=BACKEND != "torch")
    history = model.fit(X, np.zeros((2, 11, 1)), epochs=2, batch_size=2, verbose=0)
    assert np.isfinite(history.history["loss"]).all()


def test_chunked_dropout_same_mask_as_weights_times_values():
    """Each block's dropout mask comes from the call's seed and the block: the
    same seed state gives the same output (and the recomputed backward pass
    sees the same mask)."""
    a = SelfAttention(num_heads=1, chunk_size=3, dropout=0.5, seed=5)
    b = SelfAttention(num_heads=1, chunk_size=3, dropout=0.5, seed=5)
    a.build(X.shape)
    b.build(X.shape)
    b.set_weights(a.get_weights())
    np.testing.assert_array_equal(
        to_numpy(a(X, training=True)), to_numpy(b(X, training=True))
    )


@pytest.mark.parametrize("path", ["explicit", "chunked", "fused"])
@pytest.mark.parametrize("heads", [1, 3])
def test_time_zero(path, heads):
    """Was: JAX and PyTorch, T = 0 with more than one head failed in the head
    merge reshape."""
    if path == "fused" and BACKEND == "tensorflow":
        pytest.skip("TensorFlow has no fused attention kernel")
    layer = SelfAttention(
        num_heads=heads,
        key_dim=2,
        output_dim=5,
        flash_attention=path == "fused",
        chunk_size=2 if path == "chunked" else None,
    )
    output = layer(np.zeros((2, 0, 4), "float32"), mask=np.zeros((2, 0), bool))
    assert tuple(output.shape) == (2, 0, 5)


def _training_memory(time: int, chunk_size: int | None) -> int:
    """Bytes the backward pass keeps (PyTorch: the storage of the tensors
    saved for backward) or the compiled gradient's temporary memory (JAX), at
    one sequence length."""
    layer = SelfAttention(
        num_heads=1,
        key_dim=8,
        chunk_size=chunk_size,
        causal=True,
        flash_attention=False,  # unchunked: the explicit path, (T, T) weights
    )
    x = np.random.default_rng(0).normal(size=(1, time, 8)).astype("float32")
    layer.build(x.shape)
    if BACKEND == "jax":
        import jax

        def loss(values, x):
            out, _ = layer.stateless_call(values, [], x, training=True)
            return jax.numpy.sum(out**2)

        values = [v.value for v in layer.trainable_variables]
        compiled_grad = jax.jit(jax.grad(loss)).lower(values, x).compile()
        return compiled_grad.memory_analysis().temp_size_in_bytes
    import torch

    saved = {}  # storage -> bytes: blocks share their inputs' storage

    def pack(tensor):
        storage = tensor.untyped_storage()
        saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = layer(x, training=True)
    torch.sum(out**2).backward()
    return sum(saved.values())


@pytest.mark.skipif(
    BACKEND == "tensorflow",
    reason="TensorFlow's chunked training memory is measured by the slow "
    "test_chunked_attention memory test (peak RSS)",
)
@pytest.mark.slow_on("torch", "four trainings at T=2048 (JAX measures it fast)")
def test_chunked_training_memory_is_linear_in_time():
    """Quadrupling T quadruples what the chunked backward pass keeps (each
    block is recomputed, its weights are not stored); the unchunked layer's
    grows sixteenfold, so a stored (T, T) would show."""
    small, large = 512, 2048
    chunked = _training_memory(large, 64) / _training_memory(small, 64)
    full = _training_memory(large, None) / _training_memory(small, None)
    assert chunked < 6, chunked
    assert full > 10, full
    # And in absolute terms: less than one (T, T) float32 matrix at T=2048.
    assert _training_memory(large, 64) < large * large * 4
