"""Serving-side robustness of one loaded SavedModel.

- 8 threads calling the same `serving_default` signature at once (each with
  its own input shape and values, many times) get exactly the results of
  serial calls, which themselves match the Keras model.
- Calls with a wrong dtype, rank or feature size raise an error instead of
  returning something. NumPy inputs are converted to the signature's dtype
  by value (float64, float16, int32 arrays): that gives the right answer for
  those values, which the test checks too.
- Empty inputs (time 0, batch 0) give empty outputs through the signature;
  onnxruntime refuses time 0 with an error rather than a wrong shape.
"""

from __future__ import annotations

import threading

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_selfattn import SelfAttention
from keras_selfattn.export import export_saved_model

pytestmark = pytest.mark.tensorflow_only(
    "a loaded SavedModel signature, called from threads"
)

THREADS = 8
CALLS_PER_THREAD = 10
FEATURES = 8
# The errors TensorFlow raises for inputs a signature cannot take.
SIGNATURE_ERRORS = (TypeError, ValueError, tf.errors.InvalidArgumentError)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(Keras model, loaded serving_default signature)."""
    inputs = keras.Input((None, FEATURES), name="features")
    x = SelfAttention(num_heads=2, output_dim=6, use_bias=True, causal=True)(inputs)
    model = keras.Model(inputs, keras.layers.Dense(3, name="score")(x))
    rng = np.random.default_rng(0)
    model.set_weights(
        [rng.normal(scale=0.4, size=w.shape).astype("float32") for w in model.weights]
    )
    base = tmp_path_factory.mktemp("serving")
    version_dir = export_saved_model(model, base, "model", check=False)
    loaded = tf.saved_model.load(version_dir)
    return model, loaded.signatures["serving_default"]


def _call(signature, x) -> np.ndarray:
    return signature(features=tf.constant(x))["score"].numpy()


def test_eight_threads_match_serial_calls(served):
    model, signature = served
    rng = np.random.default_rng(1)
    inputs = [
        rng.normal(size=(1 + i % 4, 3 + 5 * i, FEATURES)).astype("float32")
        for i in range(THREADS)
    ]
    serial = [_call(signature, x) for x in inputs]
    for x, expected in zip(inputs, serial, strict=True):
        np.testing.assert_allclose(
            expected, model.predict(x, verbose=0), rtol=1e-4, atol=1e-5
        )

    results: list[list[np.ndarray]] = [[] for _ in range(THREADS)]
    errors: list[BaseException] = []
    start = threading.Barrier(THREADS)

    def work(index: int) -> None:
        try:
            start.wait(timeout=60)
            for _ in range(CALLS_PER_THREAD):
                results[index].append(_call(signature, inputs[index]))
        except BaseException as error:  # reported below, in the main thread
            errors.append(error)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads), "a call hung"
    assert not errors, errors
    for index in range(THREADS):
        assert len(results[index]) == CALLS_PER_THREAD
        for result in results[index]:
            np.testing.assert_array_equal(result, serial[index])


@pytest.mark.parametrize(
    "value",
    [
        tf.zeros((2, 5, FEATURES), tf.float64),
        tf.zeros((2, 5, FEATURES), tf.int32),
        tf.zeros((2, 5, FEATURES), tf.float16),
        tf.fill((2, 5, FEATURES), "a"),
    ],
    ids=["float64", "int32", "float16", "string"],
)
def test_wrong_dtype_tensor_raises(served, value):
    _, signature = served
    with pytest.raises(SIGNATURE_ERRORS):
        signature(features=value)


@pytest.mark.parametrize(
    "shape",
    [(5, FEATURES), (1, 2, 5, FEATURES), (FEATURES,), ()],
    ids=["rank2", "rank4", "rank1", "scalar"],
)
@pytest.mark.parametrize("kind", ["tensor", "numpy"])
def test_wrong_rank_raises(served, shape, kind):
    _, signature = served
    value = np.ones(shape, "float32")
    with pytest.raises(SIGNATURE_ERRORS):
        signature(features=tf.constant(value) if kind == "tensor" else value)


@pytest.mark.parametrize("features", [1, FEATURES - 1, FEATURES + 1, 2 * FEATURES])
@pytest.mark.parametrize("kind", ["tensor", "numpy"])
def test_wrong_feature_size_raises(served, features, kind):
    _, signature = served
    value = np.ones((2, 5, features), "float32")
    with pytest.raises(SIGNATURE_ERRORS):
        signature(features=tf.constant(value) if kind == "tensor" else value)


def test_wrong_or_missing_input_name_raises(served):
    _, signature = served
    value = tf.zeros((2, 5, FEATURES))
    with pytest.raises(SIGNATURE_ERRORS):
        signature(feature=value)
    with pytest.raises(SIGNATURE_ERRORS):
        signature()


@pytest.mark.parametrize("dtype", ["float64", "float16", "int32"])
def test_numpy_inputs_are_converted_by_value(served, dtype):
    model, signature = served
    rng = np.random.default_rng(2)
    x = rng.integers(-3, 4, size=(2, 7, FEATURES)).astype(dtype)  # exact values
    result = signature(features=x)["score"].numpy()
    np.testing.assert_array_equal(result, _call(signature, x.astype("float32")))
    np.testing.assert_allclose(
        result, model.predict(x.astype("float32"), verbose=0), rtol=1e-4, atol=1e-5
    )


@pytest.mark.parametrize("shape", [(2, 0, FEATURES), (0, 5, FEATURES)])
def test_empty_inputs_through_the_signature(served, shape):
    """Time 0 (and batch 0) give an empty output, as in Keras."""
    _, signature = served
    result = _call(signature, np.zeros(shape, "float32"))
    assert result.shape == shape[:2] + (3,)


def test_empty_time_in_onnxruntime_is_an_error_or_empty(served, tmp_path):
    """ONNX Reshape reads a 0 in its target shape as "copy this dimension",
    so the tf2onnx graph cannot represent time 0: onnxruntime must then fail
    loudly (it does in onnxruntime 1.31), never return a wrong shape."""
    import onnxruntime

    from keras_selfattn.export import export_onnx

    model, _ = served
    session = onnxruntime.InferenceSession(export_onnx(model, tmp_path / "m.onnx"))
    try:
        (result,) = session.run(None, {"features": np.zeros((2, 0, FEATURES), "f4")})
    except onnxruntime.capi.onnxruntime_pybind11_state.Fail:
        return
    assert result.shape == (2, 0, 3)
