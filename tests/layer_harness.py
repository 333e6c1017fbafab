"""A shared layer test, after the ideas of Keras's `run_layer_test`.

For one constructor configuration it checks: config round trip (also through
Keras's serializer, without custom_objects), build and weight shapes,
symbolic and eager calls that agree, compute_output_shape, a training step
in which every trainable weight gets a nonzero gradient, mixed precision
policies, and a .keras save/load round trip.
"""

from __future__ import annotations

import keras
import numpy as np

from tests.backend import to_numpy, value_and_grad


def _random_inputs(input_shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=input_shape).astype("float32")


def check_config_round_trip(layer_cls, init_kwargs: dict) -> None:
    layer = layer_cls(**init_kwargs)
    config = layer.get_config()
    for key, value in init_kwargs.items():
        if key.endswith(("_initializer", "_regularizer", "_constraint")):
            # Serialized as Keras objects: checked through the revived layer.
            assert config[key] is not None, key
        else:
            assert config[key] == value, (key, config[key], value)
    revived = layer_cls.from_config(config)
    assert revived.get_config() == config
    # Through Keras's registry, as `load_model` does: no custom_objects.
    serialized = keras.saving.serialize_keras_object(layer)
    assert serialized["registered_name"] == "keras_selfattn>SelfAttention"
    deserialized = keras.saving.deserialize_keras_object(serialized)
    assert type(deserialized) is layer_cls
    assert deserialized.get_config() == config


def check_build_and_calls(
    layer_cls,
    init_kwargs: dict,
    input_shape: tuple[int, ...],
    expected_output_shape: tuple[int, ...],
    expected_weight_shapes: list[tuple[int, ...]],
) -> keras.layers.Layer:
    layer = layer_cls(**init_kwargs)
    layer.build((None, None, input_shape[-1]))
    assert [tuple(w.shape) for w in layer.weights] == expected_weight_shapes
    assert tuple(layer.compute_output_shape(input_shape)) == expected_output_shape

    # Symbolic call, with dynamic batch and time.
    inputs = keras.Input((None, input_shape[-1]), name="x")
    symbolic = layer(inputs)
    assert tuple(symbolic.shape) == (None, None, expected_output_shape[-1])
    model = keras.Model(inputs, symbolic)

    # Eager call agrees with the functional model built from the symbolic one.
    x = _random_inputs(input_shape)
    eager = to_numpy(layer(x))
    assert eager.shape == expected_output_shape
    assert eager.dtype == np.float32
    assert np.all(np.isfinite(eager))
    np.testing.assert_allclose(model.predict(x, verbose=0), eager, atol=1e-5)
    return layer


def check_training(layer_cls, init_kwargs: dict, input_shape: tuple[int, ...]) -> None:
    layer = layer_cls(**init_kwargs)
    x = _random_inputs(input_shape, seed=1)
    layer.build(x.shape)
    variables = layer.trainable_variables
    assert variables, "the layer has no trainable weights"
    _, grads = value_and_grad(
        lambda: keras.ops.sum(keras.ops.square(layer(x, training=True))), variables
    )
    for variable, grad in zip(variables, grads, strict=True):
        assert grad is not None, f"no gradient for {variable.path}"
        assert np.any(np.asarray(grad) != 0), f"zero gradient for {variable.path}"
        assert np.all(np.isfinite(grad)), f"non-finite gradient for {variable.path}"


def check_mixed_precision(
    layer_cls, init_kwargs: dict, input_shape: tuple[int, ...]
) -> None:
    x = _random_inputs(input_shape, seed=2)
    reference = layer_cls(**init_kwargs)
    expected = to_numpy(reference(x))
    for policy, atol in (("mixed_float16", 2e-2), ("mixed_bfloat16", 1e-1)):
        layer = layer_cls(**init_kwargs, dtype=policy)
        layer.build(x.shape)
        layer.set_weights(reference.get_weights())
        assert all(w.dtype == "float32" for w in layer.weights)
        out = layer(x)
        assert keras.backend.standardize_dtype(out.dtype) == policy.split("_")[1]
        out = to_numpy(keras.ops.cast(out, "float32"))
        assert np.all(np.isfinite(out)), policy
        np.testing.assert_allclose(out, expected, atol=atol, rtol=atol, err_msg=policy)


def check_saving(layer, input_shape: tuple[int, ...], tmp_path) -> None:
    inputs = keras.Input((None, input_shape[-1]), name="x")
    model = keras.Model(inputs, layer(inputs))
    x = _random_inputs(input_shape, seed=3)
    expected = model.predict(x, verbose=0)
    path = tmp_path / "model.keras"
    model.save(path)
    revived = keras.models.load_model(path)  # no custom_objects
    np.testing.assert_allclose(revived.predict(x, verbose=0), expected, atol=1e-6)
    revived_layer = revived.layers[-1]
    assert revived_layer.get_config() == layer.get_config()
    for a, b in zip(revived_layer.get_weights(), layer.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)


def run_layer_test(
    layer_cls,
    init_kwargs: dict,
    input_shape: tuple[int, ...],
    expected_output_shape: tuple[int, ...],
    expected_weight_shapes: list[tuple[int, ...]],
    tmp_path,
) -> None:
    """Runs every check above for one configuration."""
    check_config_round_trip(layer_cls, init_kwargs)
    layer = check_build_and_calls(
        layer_cls,
        init_kwargs,
        input_shape,
        expected_output_shape,
        expected_weight_shapes,
    )
    check_training(layer_cls, init_kwargs, input_shape)
    check_mixed_precision(layer_cls, init_kwargs, input_shape)
    check_saving(layer, input_shape, tmp_path)
