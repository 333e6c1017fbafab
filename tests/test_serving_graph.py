"""SelfAttention's projections in a TensorFlow graph, and the SavedModel's
`jit_compile` option.

In a traced TensorFlow call (a `tf.function`, Keras's `predict`, a SavedModel
signature) each float projection is one einsum into the heads' layout
(`keras_selfattn._projection_ops`), where Keras's own `Dense` call
multiplies a 3-D input by `tensordot`, a chain of shape ops around a MatMul
per call. Checked here: the outputs against the float64 numpy reference
(`tests/reference.py`) in both heads layouts (the explicit path's
heads-first, a cached call's time-first keys and values), with GQA, a gate,
rotary, no biases, time 0 and mixed precision; that the graph holds one
einsum per projection and none of `tensordot`'s shape ops; that quantized
and LoRA projections keep their Keras layer call; and the SavedModel's
`jit_compile` (XLA) export, its check and its refusals (the export with
its check, and a run of `benchmarks.serving --quick`, are slow).
"""

from __future__ import annotations

import json
import os

import keras
import numpy as np
import pytest

from keras_selfattn import SelfAttention
from tests import reference
from tests.backend import BACKEND

tensorflow_only = pytest.mark.tensorflow_only("TensorFlow graphs and SavedModels")

FEATURES = 8
CONFIGS = {
    "bias_output": {"num_heads": 4, "output_dim": 8, "use_bias": True},
    "gqa_gate": {
        "num_heads": 4,
        "num_key_value_heads": 2,
        "key_dim": 4,
        "value_dim": 6,
        "use_gate": True,
        "use_bias": True,
        "output_dim": 5,
    },
    "causal_rope": {"num_heads": 2, "causal": True, "rope_max_wavelength": 100.0},
    "one_head": {"num_heads": 1, "use_bias": True},
}


def _layer(config: dict, seed: int = 0) -> SelfAttention:
    keras.utils.set_random_seed(seed)
    layer = SelfAttention(**config)
    layer.build((None, None, FEATURES))
    for weight in layer.weights:
        # Non-zero biases, so a bias added to the wrong head shows.
        weight.assign(np.random.default_rng(seed).normal(size=weight.shape) * 0.5)
        seed += 1
    return layer


def _graph(fn, *specs, tensordots=()):
    """`fn` as a tf.function, and the op types of its graph, checked to hold
    a `tensordot` (Keras's Dense call of a 3-D input: a chain of shape ops
    around a MatMul, under its name scope) for the projections named in
    `tensordots` only (None: not checked)."""
    import tensorflow as tf

    function = tf.function(fn, input_signature=list(specs), autograph=False)
    operations = function.get_concrete_function().graph.get_operations()
    scopes = {op.name.split("/Tensordot/")[0] for op in operations}
    found = {
        name
        for name in ("query", "key", "value", "gate", "output")
        if any(scope.endswith(f"/{name}_dense_1") for scope in scopes)
    }
    assert tensordots is None or found == set(tensordots), found
    return function, [op.type for op in operations]


def _spec(*shape):
    import tensorflow as tf

    return tf.TensorSpec(shape, tf.float32)


def _inputs(batch: int, time: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.normal(size=(batch, time, FEATURES)).astype(np.float32)


def _projections(config: dict) -> int:
    return 3 + bool(config.get("use_gate")) + ("output_dim" in config)


@tensorflow_only
@pytest.mark.parametrize("name", list(CONFIGS))
def test_traced_projections_match_the_reference(name):
    config = CONFIGS[name]
    layer = _layer(config)
    function, ops = _graph(layer, _spec(None, None, FEATURES))
    assert ops.count("Einsum") == _projections(config), ops
    for batch, time in [(2, 7), (1, 1), (3, 0)]:
        x = _inputs(batch, time, seed=time)
        expected = reference.for_layer(layer, x)[0]
        np.testing.assert_allclose(function(x).numpy(), expected, atol=1e-5)


@tensorflow_only
def test_traced_cached_calls_match_the_reference():
    # Cached calls project keys and values time-first (the cache's layout),
    # and one new position's query too (the single-query path).
    config = {**CONFIGS["gqa_gate"], "value_dim": 4, "causal": True}
    layer = _layer(config, seed=3)
    cache_spec = _spec(None, 2, 9, config["num_key_value_heads"], config["key_dim"])
    outputs = []
    cache = layer.empty_cache(2, 9)
    x = _inputs(2, 9, seed=5)
    for start, time in [(0, 8), (8, 1)]:

        def step(x, cache, start=start):
            return layer(x, cache=cache, cache_update_index=start)

        function, ops = _graph(step, _spec(None, time, FEATURES), cache_spec)
        assert ops.count("Einsum") == _projections(config), ops
        output, cache = function(x[:, start : start + time], cache)
        outputs.append(output.numpy())
    expected = reference.for_layer(layer, x)[0]
    np.testing.assert_allclose(np.concatenate(outputs, 1), expected, atol=1e-5)


@tensorflow_only
@pytest.mark.parametrize(
    "policy, tolerance", [("mixed_float16", 5e-3), ("mixed_bfloat16", 3e-2)]
)
def test_traced_mixed_precision_matches_the_reference(policy, tolerance):
    # The tolerances of tests/test_numerics.py: of the largest |output|.
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(policy)
    try:
        layer = _layer(CONFIGS["gqa_gate"], seed=7)
    finally:
        keras.config.set_dtype_policy(previous)
    function, ops = _graph(layer, _spec(None, None, FEATURES))
    assert ops.count("Einsum") == _projections(CONFIGS["gqa_gate"]), ops
    x = _inputs(2, 6, seed=1)
    output = function(x).numpy()
    assert str(output.dtype) == layer.compute_dtype
    expected = reference.for_layer(layer, x)[0]
    error = np.max(np.abs(output.astype(np.float64) - expected))
    assert error <= tolerance * np.max(np.abs(expected)), error


@tensorflow_only
def test_lora_projections_keep_their_layer_call():
    config = CONFIGS["bias_output"]
    layer = _layer(config, seed=11)
    weights = reference.layer_weights(layer)
    layer.enable_lora(2, lora_alpha=4.0)
    rng = np.random.default_rng(0)
    for name in ("query", "value"):
        projection = getattr(layer, f"{name}_dense")
        projection.lora_kernel_b.assign(rng.normal(size=(2, 8)))
        update = 2.0 * (projection.lora_kernel_a.numpy() @ projection.lora_kernel_b)
        weights["w" + name[0]] = weights["w" + name[0]] + update
    # key and output: one einsum each; query and value: Keras's Dense calls.
    function, ops = _graph(
        layer, _spec(None, None, FEATURES), tensordots=("query", "value")
    )
    assert ops.count("Einsum") == 2, ops
    x = _inputs(2, 5)
    expected = reference.for_layer(layer, x, weights)[0]
    np.testing.assert_allclose(function(x).numpy(), expected, atol=1e-5)


@tensorflow_only
def test_quantized_projections_keep_their_layer_call():
    layer = _layer(CONFIGS["bias_output"], seed=13)
    layer.quantize("int8")
    # Keras's int8 call: an integer matmul of quantized activations.
    function, ops = _graph(layer, _spec(None, None, FEATURES), tensordots=None)
    assert "Einsum" not in ops, ops
    x = _inputs(2, 5)
    # Keras's own int8 call, eagerly (its activations quantized per token).
    np.testing.assert_allclose(function(x).numpy(), layer(x).numpy(), atol=1e-6)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A SelfAttention model, the SavedModels' base dir, and the model
    exported there as "plain" (no check)."""
    from keras_selfattn.export import export_saved_model

    base = tmp_path_factory.mktemp("serving")
    inputs = keras.Input((None, FEATURES), name="x")
    layer = _layer(CONFIGS["gqa_gate"], seed=17)
    model = keras.Model(inputs, layer(inputs))
    plain = export_saved_model(model, base, "plain", check=False)
    return model, base, plain


@tensorflow_only
def test_serving_signature_reads_no_shape_per_projection(served):
    from benchmarks.serving import graph_nodes

    _, _, path = served
    entries = graph_nodes(path)["live_ops"].split(", ")
    ops = {op: int(n) for op, n in (entry.rsplit(" ", 1) for entry in entries)}
    assert ops["Einsum"] == _projections(CONFIGS["gqa_gate"]), ops
    # The merge of the heads reads the time (a Reshape to (-1, T, H * D)).
    assert ops.get("Shape", 0) <= 1, ops


@tensorflow_only
@pytest.mark.slow
def test_jit_compile_export_is_checked_with_xla_and_says_so(served):
    import tensorflow as tf

    from keras_selfattn.export import export_saved_model
    from keras_selfattn.export.formats import saved_model

    model, base, _ = served
    path = export_saved_model(model, base, "xla", jit_compile=True)
    assert saved_model.needs_xla(path)
    with open(os.path.join(path, saved_model.DESCRIPTION_PATH)) as file:
        assert json.load(file)["tf_serving_flags"] == [saved_model.XLA_FLAG]
    signature = tf.saved_model.load(path).signatures["serving_default"]
    x = _inputs(3, 11, seed=2)
    (output,) = signature(x=tf.constant(x)).values()
    expected = reference.for_layer(model.layers[-1], x)[0]
    np.testing.assert_allclose(output.numpy(), expected, atol=1e-5)


@tensorflow_only
def test_jit_compile_refuses_a_layer_xla_cannot_compile(tmp_path):
    from keras_selfattn.export import export_saved_model

    inputs = keras.Input((None, FEATURES), name="x")
    layer = SelfAttention(num_heads=2, causal=True, chunk_size=4)
    model = keras.Model(inputs, layer(inputs))
    with pytest.raises(ValueError, match="cannot be compiled by XLA"):
        export_saved_model(model, tmp_path, "m", jit_compile=True)
    assert not os.path.exists(tmp_path / "m" / "1")


@pytest.mark.skipif(BACKEND == "torch", reason="no SavedModel export on torch")
def test_jit_compile_is_a_boolean_on_tensorflow_only(tmp_path):
    from keras_selfattn.export import export_saved_model

    inputs = keras.Input((None, FEATURES), name="x")
    model = keras.Model(inputs, SelfAttention(num_heads=2)(inputs))
    with pytest.raises(ValueError, match="jit_compile` must be True or False"):
        export_saved_model(model, tmp_path, "m", jit_compile="yes")
    if BACKEND == "jax":
        with pytest.raises(ValueError, match="compiled by XLA already"):
            export_saved_model(model, tmp_path, "m", jit_compile=True)
    assert not os.path.exists(tmp_path / "m")


@tensorflow_only
@pytest.mark.slow
def test_serving_benchmark_runs_every_candidate(tmp_path):
    from tests.benchmark_runs import run_quick

    loaded, markdown = run_quick("serving", tmp_path, timeout=900)
    assert [g["artifact"] for g in loaded["graphs"]] == [
        "saved_model",
        "saved_model_jit_compile",
        "mha_saved_model",
    ]
    # Two settings: four candidates with XLA, three without.
    assert len(loaded["rows"]) == 7
    for row in loaded["rows"]:
        assert row["ms"] > 0 and row["saved_model_time_ratio"] > 0, row
        assert row["max_abs_error"] < 1e-4, row
    assert [t["value"] is not None for t in loaded["targets"]] == [True, True]
    assert loaded["machine"]["cpu"] in markdown
