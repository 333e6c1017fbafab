"""Cache objects (`attention.cache.layouts`): each class writes and reads
as its layout says, checked against numpy; the caller's class reaches the
layer through the decoding scope under the layer's stable key; a call's
arguments are read by name."""

from __future__ import annotations

import keras
import numpy as np
import pytest

from keras_selfattn import SelfAttention, decoding
from keras_selfattn.attention import cache as cache_lib
from keras_selfattn.generation import cached_model
from tests.backend import BACKEND, to_numpy

pytestmark = pytest.mark.slow_on(
    "jax", "each cache write compiled op by op; the other suites check it"
)

RNG = np.random.default_rng(11)
X = RNG.normal(size=(2, 6, 8)).astype("float32")
PADDING = np.ones((2, 6), bool)
PADDING[1, :2] = False


def _layer():
    layer = SelfAttention(num_heads=2, causal=True, num_key_value_heads=1)
    layer(X)
    return layer


def _written(layer, cache, index, x):
    """numpy: `cache` (B, 2, L, G, K) with x's keys and values at `index`."""
    heads, dim = layer._kv_heads, layer._dims.key_dim
    key = to_numpy(layer.key_dense(x)).reshape(x.shape[0], x.shape[1], heads, dim)
    value = to_numpy(layer.value_dense(x)).reshape(key.shape)
    cache = cache.copy()
    cache[:, 0, index : index + x.shape[1]] = key
    cache[:, 1, index : index + x.shape[1]] = value
    return cache


@pytest.mark.parametrize(
    "cache_class",
    [cache_lib.Cache, cache_lib.ConverterCache, cache_lib.GatheredCache],
)
def test_guarded_classes_write_the_new_positions_and_return_their_class(
    cache_class,
):
    layer = _layer()
    empty = to_numpy(layer.empty_cache(2, 6))
    output, cache = layer(
        X[:, :4], cache=cache_class(empty), cache_update_index=0, mask=PADDING
    )
    assert type(cache) is cache_class
    expected = _written(layer, empty, 0, X[:, :4])
    np.testing.assert_allclose(to_numpy(cache.tensor), expected, atol=1e-5)
    # The same numbers as the raw tensor's call, which returns a tensor.
    raw_output, raw = layer(X[:, :4], cache=empty, cache_update_index=0, mask=PADDING)
    assert not isinstance(raw, cache_lib.Cache)
    np.testing.assert_allclose(to_numpy(output), to_numpy(raw_output), atol=1e-6)


def test_checked_caches_write_and_read_as_the_guarded_one():
    """A checked cache (the loop's steps), given zeros wherever no query may
    attend, decodes one position as the default class does."""
    layer = _layer()
    empty = to_numpy(layer.empty_cache(2, 6))
    _, prompt = layer(X[:, :5], cache=empty, cache_update_index=0)
    step_class = cache_lib.CheckedCache
    if BACKEND == "torch":
        step_class = cache_lib.TorchInPlaceCache
    checked_output, checked = layer(
        X[:, 5:6], cache=step_class(prompt), cache_update_index=5
    )
    output, cache = layer(X[:, 5:6], cache=prompt, cache_update_index=5)
    assert type(checked) is step_class
    np.testing.assert_allclose(to_numpy(checked_output), to_numpy(output), atol=1e-5)
    np.testing.assert_allclose(to_numpy(checked.tensor), to_numpy(cache), atol=1e-6)


def test_time_major_layout_and_shape():
    tensor = np.arange(2 * 2 * 5 * 1 * 3, dtype="float32").reshape(2, 2, 5, 1, 3)
    cache = cache_lib.TimeMajorCache.from_batch_major(tensor)
    np.testing.assert_array_equal(
        to_numpy(cache.tensor), tensor.transpose(1, 2, 0, 3, 4)
    )
    assert (cache.max_length, cache.batch_size) == (5, 2)
    assert cache.expected_shape(1, 3) == (2, None, None, 1, 3)
    assert cache_lib.Cache(tensor).expected_shape(1, 3) == (None, 2, None, 1, 3)
    assert cache.checked and not cache_lib.Cache(tensor).checked


class _Spy(keras.layers.Layer):
    """Records the active scope's cache keys and classes, then runs `inner`."""

    def __init__(self, inner, seen, **kwargs):
        super().__init__(**kwargs)
        self.inner = inner
        self.record = seen.append  # (Keras would copy a list attribute)

    def build(self, input_shape):
        self.inner.build(input_shape)

    def call(self, x):
        scope = decoding.active()
        if scope is not None:
            self.record({k: type(c) for k, c in scope.caches.items()})
        return self.inner(x)


def test_the_scope_holds_the_callers_objects_under_stable_keys():
    seen = []
    inputs = keras.Input((None, 8))
    attention = SelfAttention(num_heads=2, causal=True, name="att")
    outputs = _Spy(attention, seen, name="spy")(inputs)
    model = keras.Model(inputs, outputs)
    model(X)
    layers = (attention,)
    names = cached_model.layer_names(model, layers)
    tensor = attention.empty_cache(2, 6)
    output, (updated,) = cached_model.run_cached(
        model, layers, X[:, :3], [cache_lib.GatheredCache(tensor)], 0
    )
    assert seen == [{names[0]: cache_lib.GatheredCache}]
    assert type(updated) is cache_lib.GatheredCache
    # A raw tensor goes in as the default class and comes back a tensor.
    _, (raw,) = cached_model.run_cached(model, layers, X[:, :3], [tensor], 0)
    assert seen[-1] == {names[0]: cache_lib.Cache}
    np.testing.assert_allclose(to_numpy(raw), to_numpy(updated.tensor), atol=1e-6)


def test_call_arguments_are_read_by_name():
    layer = _layer()
    arguments = decoding.call_arguments(
        layer, (X, None, None, True), {"cache": "c", "segment_ids": None}
    )
    assert arguments.pop("inputs") is X
    assert arguments == {
        "mask": None,
        "attention_mask": None,
        "training": True,
        "cache": "c",
        "segment_ids": None,
    }


def traced_loop(model: keras.Model, caches=None):
    """The concrete function of `model`'s greedy generation loop (4 steps,
    8 positions) as a `tf.function` traces it, with `caches` (the loop's
    default where None)."""
    import tensorflow as tf

    from keras_selfattn.generation import loop

    layers = cached_model.read(model, "generate with").layers

    @tf.function
    def generate(prompts, lengths):
        return loop.run(
            model,
            layers,
            prompts,
            lengths,
            max_length=8,
            capacity=4,
            steps=4,
            controls=loop.Controls(),
            tokens=True,
            greedy=True,
            caches=caches,
        )

    return generate.get_concrete_function(
        tf.TensorSpec((None, None), "int32"), tf.TensorSpec((None,), "int32")
    )


def _op_types(concrete) -> set[str]:
    """The op types of a concrete function, its loop bodies included."""
    graph = concrete.graph.as_graph_def()
    types = {node.op for node in graph.node}
    for function in graph.library.function:
        types |= {node.op for node in function.node_def}
    return types


WRITE_OPS = {"TensorStridedSliceUpdate", "XlaDynamicUpdateSlice", "InplaceUpdate"}


@pytest.mark.slow
@pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow graphs' ops")
def test_each_caller_gets_the_write_it_needs():
    """A decoding step's graph writes with TensorStridedSliceUpdate (TF
    Serving without XLA), XlaDynamicUpdateSlice for a converter, a gather
    for OpenVINO; the loop's steps without XLA with InplaceUpdate, for a
    converter with XlaDynamicUpdateSlice."""
    from keras_selfattn.export.decode_step.graph import build_decode_step
    from keras_selfattn.generation import loop

    tokens = keras.Input((None,), dtype="int32", name="tokens")
    hidden = keras.layers.Embedding(11, 8)(tokens)
    hidden = SelfAttention(num_heads=2, causal=True)(hidden)
    model = keras.Model(tokens, keras.layers.Dense(11)(hidden))
    target = build_decode_step(model, 8).target()

    def step_ops(target):
        return _op_types(target.tf_function().get_concrete_function()) & WRITE_OPS

    assert step_ops(target) == {"TensorStridedSliceUpdate"}
    converter = target.with_caches(cache_lib.ConverterCache)
    assert step_ops(converter) == {"XlaDynamicUpdateSlice"}
    assert step_ops(target.with_caches(cache_lib.GatheredCache)) == set()

    def loop_ops(caches=None):
        return _op_types(traced_loop(model, caches)) & WRITE_OPS

    assert loop_ops() == {"TensorStridedSliceUpdate", "InplaceUpdate"}
    converter = loop.CacheClasses(cache_lib.ConverterCache, cache_lib.CheckedCache)
    assert loop_ops(converter) == {"XlaDynamicUpdateSlice"}


@pytest.mark.parametrize("cache_class", [cache_lib.Cache, cache_lib.CheckedCache])
@pytest.mark.parametrize("index", [0, 3, 5])
def test_attended_length_is_the_number_of_keys_the_update_returns(cache_class, index):
    """The key mask's length (`Masks.key_length`) is the keys' own: the
    cache's attended length where it cuts them, else their shape's."""
    tensor = RNG.normal(size=(2, 2, 6, 1, 4)).astype("float32")
    key = keras.ops.convert_to_tensor(RNG.normal(size=(2, 1, 1, 4)).astype("float32"))
    cache = cache_class(keras.ops.convert_to_tensor(tensor))
    length = cache.attended_length(key, index)
    _, keys, _ = cache.update(key, key, index)
    assert keys.shape[1] == (length if length is not None else 6)
    if BACKEND != "tensorflow":
        return
    import tensorflow as tf

    # In a graph (as the generators are converted), at a tensor index.
    @tf.function
    def lengths(at):
        _, graph_keys, _ = cache.update(key, key, at)
        return tf.shape(graph_keys)[1], cache.attended_length(key, at)

    found, given = lengths(tf.constant(index))
    assert int(found) == int(given)
    # The time-major cache attends up to its index.
    major = cache_lib.TimeMajorCache.from_batch_major(
        keras.ops.convert_to_tensor(tensor)
    )
    _, major_keys, _ = major.update(key, key, index)
    assert major_keys.shape[0] == int(major.attended_length(key, index))
