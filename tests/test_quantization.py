"""`model.quantize(mode)` quantizes SelfAttention's projections.

The reference is `keras.layers.MultiHeadAttention` holding the same weights
and quantized with the same mode: SelfAttention's output error (quantized
against float) must be at most 1.5 times MultiHeadAttention's. Then every
attention path and decoding run on quantized weights, quantized models save
and load, and (TensorFlow) export to SavedModel and ONNX and verify.
"""

from __future__ import annotations

import warnings

import keras
import numpy as np
import pytest

from keras_selfattn import SelfAttention
from tests.backend import to_numpy
from tests.paths import PATH_PARAMS, PATHS

HEADS, KEY_DIM, FEATURES, TIME = 2, 8, 16, 6
MODES = ("int8", "int4", "float8")
X = np.random.default_rng(2).normal(size=(3, TIME, FEATURES)).astype("float32")


def _quantize(model: keras.Model, mode: str, **kwargs) -> None:
    # Keras warns for each layer without weights (InputLayer, Dropout, ...).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        model.quantize(mode, **kwargs)


def _weights(layer: SelfAttention) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [
        rng.normal(size=w.shape, scale=0.3).astype("float32") for w in layer.weights
    ]


def _pair() -> tuple[keras.Model, keras.Model]:
    """SelfAttention and MultiHeadAttention models with the same weights."""
    inputs = keras.Input((TIME, FEATURES))
    ours = SelfAttention(
        num_heads=HEADS, key_dim=KEY_DIM, output_dim=FEATURES, use_bias=True
    )
    mha = keras.layers.MultiHeadAttention(HEADS, KEY_DIM)
    models = keras.Model(inputs, ours(inputs)), keras.Model(inputs, mha(inputs, inputs))
    q, qb, k, kb, v, vb, o, ob = values = _weights(ours)
    ours.set_weights(values)
    heads = (HEADS, KEY_DIM)
    mha.set_weights(
        [
            *(
                w.reshape((FEATURES, *heads)) if w.ndim == 2 else w.reshape(heads)
                for w in (q, qb, k, kb, v, vb)
            ),
            o.reshape((*heads, FEATURES)),
            ob,
        ]
    )
    return models


# JAX compiles every eager call's shapes anew: int4 and the per-path runs
# on quantized weights are in its slow suite, in the others' fast ones.
SLOW_ON_JAX = pytest.mark.slow_on("jax", "more quantized eager calls")


# On JAX only float8 in `make test` (tens of seconds a mode there).
@pytest.mark.parametrize(
    "mode", [pytest.param(m, marks=SLOW_ON_JAX) if m != "float8" else m for m in MODES]
)
def test_error_at_most_1_5x_multi_head_attention(mode):
    ours, mha = _pair()
    float_ours, float_mha = to_numpy(ours(X)), to_numpy(mha(X))
    np.testing.assert_allclose(float_ours, float_mha, atol=1e-5)
    _quantize(ours, mode)
    _quantize(mha, mode)
    layer = ours.layers[-1]
    assert {p.quantization_mode for p in layer._projections().values()} == {mode}
    error = np.abs(to_numpy(ours(X)) - float_ours).max()
    reference = np.abs(to_numpy(mha(X)) - float_mha).max()
    assert 0 < error <= 1.5 * reference, (error, reference)


def test_int8_kernels_are_int8_with_scales():
    ours, _ = _pair()
    _quantize(ours, "int8")
    paths = {w.path.split("/", 1)[1]: w for w in ours.layers[-1].weights}
    for name in ("query", "key", "value", "output"):
        assert (
            keras.backend.standardize_dtype(paths[f"{name}_dense/kernel"].dtype)
            == "int8"
        )
        assert f"{name}_dense/kernel_scale" in paths


def _causal_layers(mode: str) -> dict[str, SelfAttention]:
    """One int8-quantized causal layer per attention path, same weights."""
    layers = {}
    for name in PATHS:
        layer = SelfAttention(
            num_heads=2,
            num_key_value_heads=1,
            causal=True,
            use_gate=True,
            output_dim=5,
            use_bias=True,
            rope_max_wavelength=50.0,
            **PATHS[name],
        )
        layer.build((None, None, FEATURES))
        layer.set_weights(_weights(layer))
        layer.quantize(mode)
        layers[name] = layer
    return layers


@pytest.fixture(scope="module")
def int8_causal() -> tuple[dict[str, SelfAttention], np.ndarray]:
    """The int8 causal layers, built once, and the explicit path's output."""
    layers = _causal_layers("int8")
    return layers, to_numpy(layers["explicit"](X))


@SLOW_ON_JAX
@pytest.mark.parametrize("path", PATH_PARAMS)
def test_every_path_runs_on_quantized_weights(int8_causal, path):
    layers, expected = int8_causal
    np.testing.assert_allclose(to_numpy(layers[path](X)), expected, atol=1e-5)


@SLOW_ON_JAX
def test_decoding_on_quantized_weights_equals_the_full_call(int8_causal):
    layers, expected = int8_causal
    layer = layers["explicit"]
    cache = layer.empty_cache(X.shape[0], TIME)
    steps = []
    for start in range(0, TIME, 2):
        out, cache = layer(
            X[:, start : start + 2], cache=cache, cache_update_index=start
        )
        steps.append(to_numpy(out))
    np.testing.assert_allclose(np.concatenate(steps, axis=1), expected, atol=1e-5)


@pytest.mark.parametrize("mode", MODES)
def test_quantized_model_saves_and_loads(mode, tmp_path):
    ours, _ = _pair()
    _quantize(ours, mode)
    expected = to_numpy(ours(X))
    ours.save(tmp_path / "q.keras")
    loaded = keras.models.load_model(tmp_path / "q.keras")
    layer = loaded.layers[-1]
    assert {p.quantization_mode for p in layer._projections().values()} == {mode}
    np.testing.assert_array_equal(to_numpy(loaded(X)), expected)


def test_layer_quantize_and_its_errors():
    layer = SelfAttention(num_heads=2)
    with pytest.raises(ValueError, match="not built"):
        layer.quantize("int8")
    layer.build((None, None, FEATURES))
    config = keras.quantizers.GPTQConfig(dataset=[[1, 2]], tokenizer=lambda s: s)
    with pytest.raises(ValueError, match="calibrates on data"):
        layer.quantize("gptq", config=config)
    layer.quantize("int8")
    assert layer.query_dense.quantization_mode == "int8"
    with pytest.raises(ValueError, match="already quantized"):
        layer.quantize("int8")


def _token_model() -> tuple[keras.Model, np.ndarray]:
    keras.utils.set_random_seed(1)
    tokens = keras.Input((None,), dtype="int32")
    attention = SelfAttention(num_heads=2, output_dim=16, use_bias=True, causal=True)
    model = keras.Model(tokens, attention(keras.layers.Embedding(50, 16)(tokens)))
    return model, np.random.default_rng(0).integers(0, 50, (8, 12)).astype("int32")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["gptq", "awq"])
def test_calibrated_modes_with_kerass_arguments(mode):
    """GPTQ (8 bits) and AWQ (4 bits) with Keras's configs on an Embedding +
    SelfAttention block quantize every projection. GPTQ's error is at most
    1.5 times dynamic int8's; AWQ's (8 calibration samples of 12 tokens, no
    groups) at most 3 times per-channel int4's (measured 0.9 to 2.5 times).
    MultiHeadAttention cannot be the reference: Keras's calibration calls each
    block on one input."""
    model, data = _token_model()
    expected = to_numpy(model(data))
    structure = {
        "pre_block_layers": [model.layers[1]],
        "sequential_blocks": [model.layers[2]],
    }
    common = dict(
        dataset=list(data),
        tokenizer=lambda s: s,
        num_samples=8,
        sequence_length=12,
        group_size=-1,
        quantization_layer_structure=structure,
    )
    if mode == "gptq":
        config = keras.quantizers.GPTQConfig(weight_bits=8, **common)
    else:
        config = keras.quantizers.AWQConfig(**common)
    _quantize(model, mode, config=config)
    projections = model.layers[2]._projections().values()
    assert {p.quantization_mode for p in projections} == {mode}
    error = np.abs(to_numpy(model(data)) - expected).max()
    plain_mode, factor = ("int8", 1.5) if mode == "gptq" else ("int4", 3.0)
    plain, _ = _token_model()
    _quantize(plain, plain_mode)
    plain_error = np.abs(to_numpy(plain(data)) - expected).max()
    assert 0 < error <= factor * plain_error, (error, plain_error)


def test_float8_training_updates_the_scales():
    """float8 training as in `Dense`: `fit` records the inputs' amax history
    (all zeros before) and keeps the loss finite."""
    ours, _ = _pair()
    _quantize(ours, "float8")
    query = ours.layers[-1].query_dense
    assert not np.any(to_numpy(query.inputs_amax_history))
    ours.compile(keras.optimizers.SGD(0.01), "mse")
    loss = ours.fit(X, np.zeros((3, TIME, FEATURES)), epochs=2, verbose=0)
    assert np.all(np.isfinite(loss.history["loss"]))
    assert np.any(to_numpy(query.inputs_amax_history))


def test_exports_hold_each_dequantized_kernel_once():
    """An export's description of an int8 `Dense`: its kernel is Keras's
    integers divided by the column scales (numpy's float32 quotient), and
    on TensorFlow and PyTorch the numpy kernel is a view of the tensor that
    traced calls capture (one copy of the float kernels for the whole
    export, not one each)."""
    from keras_selfattn.export import quantization

    layer = keras.layers.Dense(16)
    layer.build((None, 32))
    layer.quantize("int8")
    described = quantization.describe(layer)
    integers = keras.ops.convert_to_numpy(layer._kernel).astype(np.float32)
    scale = keras.ops.convert_to_numpy(layer.kernel_scale).astype(np.float32)
    np.testing.assert_array_equal(described.kernel, integers / scale)
    assert quantization.kernel_tensor(described) is described.tensor
    shared = np.shares_memory(described.kernel, np.asarray(described.tensor))
    assert shared == (keras.backend.backend() != "jax")
