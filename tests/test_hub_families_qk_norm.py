"""SelfAttention's query and key RMS norms (`use_query_key_norm`), and the
keras-hub families that need them: Qwen 3, Qwen 3 MoE and Gemma 3 (text)
convert, and generate keras-hub's own greedy tokens, in `generate` and in
their ONNX and LiteRT generators. The references are a numpy formula and
the original keras-hub models."""

from __future__ import annotations

import keras
import numpy as np
import pytest

import keras_selfattn
from keras_selfattn import SelfAttention
from tests import reference as numpy_reference
from tests import user_blocks
from tests.test_convert_blocks import PROMPTS, STEPS, _keras_hub_greedy
from tests.test_convert_keras_hub_models import (
    ATOL,
    SMALL,
    TOKENS,
    _adapters,
    exports_keras_hub_s_tokens,
    generator_export,
)

keras_hub = pytest.importorskip("keras_hub")

FAMILIES = {
    # name: (backbone class, causal LM class, extra backbone arguments)
    "Qwen 3": ("Qwen3Backbone", "Qwen3CausalLM", {"head_dim": 8}),
    "Qwen 3 MoE": (
        "Qwen3MoeBackbone",
        "Qwen3MoeCausalLM",
        {"head_dim": 8, "moe_intermediate_dim": 8, "num_experts": 4, "top_k": 2},
    ),
    # Six layers: five sliding (window 3, rope 10k), one global (rope 1M,
    # its positions scaled by 2).
    "Gemma 3": (
        "Gemma3Backbone",
        "Gemma3CausalLM",
        {
            "num_layers": 6,
            "head_dim": 8,
            "use_sliding_window_attention": True,
            "sliding_window_size": 3,
            "global_rope_scaling_factor": 2.0,
            "vision_encoder": None,
            "image_size": 16,
        },
    ),
}
jax_slow = pytest.mark.slow_on("jax", "JAX compiles every eager op of a new layer")
# Random weights whose greedy tokens vary (at least 4 distinct in each row).
SEEDS = {"Qwen 3": 2, "Qwen 3 MoE": 11, "Gemma 3": 0}


def _backbone(family: str, **changes):
    backbone, _, extra = FAMILIES[family]
    return getattr(keras_hub.models, backbone)(**{**SMALL, **extra, **changes})


def _randomized(model, seed: int = 0):
    return user_blocks.randomized(model, seed=seed, scale=1.0)


def _causal_lm(family: str):
    lm = getattr(keras_hub.models, FAMILIES[family][1])
    model = lm(backbone=_backbone(family), preprocessor=None)
    return _randomized(model, seed=SEEDS[family])


def _greedy(lm) -> np.ndarray:
    """keras-hub's greedy tokens of `PROMPTS`: `_keras_hub_greedy`, but for
    Gemma 3, whose `generate` cannot concatenate its own outputs (it keeps
    `images: None`): its generate function, called as `generate` calls it."""
    if not isinstance(lm, keras_hub.models.Gemma3CausalLM):
        return _keras_hub_greedy(lm, PROMPTS, STEPS)
    width = max(len(prompt) for prompt in PROMPTS) + STEPS
    ids = np.zeros((len(PROMPTS), width), "int32")
    padding = np.zeros((len(PROMPTS), width), bool)
    for row, prompt in enumerate(PROMPTS):
        ids[row, : len(prompt)], padding[row, : len(prompt)] = prompt, True
    lm.compile(sampler="greedy")
    generate = lm.make_generate_function()
    out = generate({"token_ids": ids, "padding_mask": padding}, stop_token_ids=None)
    out = keras.ops.convert_to_numpy(out["token_ids"])
    return np.stack(
        [out[row, len(p) : len(p) + STEPS] for row, p in enumerate(PROMPTS)]
    )


# --- the layer ---------------------------------------------------------------


def _numpy_attention(x, weights, heads, kv_heads, depth, epsilon, wavelength):
    """Causal grouped attention with each head's query and key RMS
    normalized (`x / sqrt(mean(x ** 2) + epsilon) * scale`), then rotated."""
    x = x.astype(np.float64)
    batch, time, _ = x.shape
    q = (x @ weights["wq"]).reshape(batch, time, heads, depth)
    k = (x @ weights["wk"]).reshape(batch, time, kv_heads, depth)
    v = (x @ weights["wv"]).reshape(batch, time, kv_heads, depth)

    def rms(y, scale):
        return y / np.sqrt(np.mean(y**2, axis=-1, keepdims=True) + epsilon) * scale

    q, k = rms(q, weights["query_scale"]), rms(k, weights["key_scale"])
    out = np.zeros((batch, time, heads, depth))
    allowed = np.tril(np.ones((time, time), bool))
    for b in range(batch):
        for h in range(heads):
            g = h // (heads // kv_heads)
            qh = numpy_reference.rotary(q[b, :, h], wavelength)
            kh = numpy_reference.rotary(k[b, :, g], wavelength)
            scores = np.where(allowed, qh @ kh.T / np.sqrt(depth), -np.inf)
            w = np.exp(scores - scores.max(-1, keepdims=True))
            out[b, :, h] = (w / w.sum(-1, keepdims=True)) @ v[b, :, g]
    return out.reshape(batch, time, -1) @ weights["wo"]


# A causal layer with the norms, rotary positions and grouped heads.
NORMED = dict(
    num_heads=4,
    num_key_value_heads=2,
    key_dim=8,
    output_dim=16,
    causal=True,
    rope_max_wavelength=100.0,
    use_query_key_norm=True,
)


@pytest.fixture(scope="module")
def normed_layer():
    """A built layer with random weights and norm scales, and its weights."""
    layer = SelfAttention(**NORMED, query_key_norm_epsilon=1e-3)
    layer.build((None, None, 16))
    rng = np.random.default_rng(3)
    weights = {
        "wq": rng.normal(0, 1, (16, 32)),
        "wk": rng.normal(0, 1, (16, 16)),
        "wv": rng.normal(0, 1, (16, 16)),
        "wo": rng.normal(0, 0.3, (32, 16)),
        "query_scale": rng.uniform(0.5, 2.0, 8),
        "key_scale": rng.uniform(0.5, 2.0, 8),
    }
    for name, attribute in (
        ("wq", "query_dense.kernel"),
        ("wk", "key_dense.kernel"),
        ("wv", "value_dense.kernel"),
        ("wo", "output_dense.kernel"),
        ("query_scale", "query_norm_scale"),
        ("key_scale", "key_norm_scale"),
    ):
        owner, *rest = attribute.split(".")
        variable = getattr(layer, owner)
        if rest:
            variable = getattr(variable, rest[0])
        variable.assign(weights[name].astype("float32"))
    return layer, weights


@jax_slow
def test_query_key_norm_matches_numpy_and_a_decoding_step(normed_layer):
    layer, weights = normed_layer
    # Inputs of very different sizes per position: the norm evens them out.
    rng = np.random.default_rng(4)
    x = (rng.normal(0, 1, (2, 6, 16)) * rng.uniform(0.01, 5, (2, 6, 1))).astype(
        "float32"
    )
    expected = _numpy_attention(x, weights, 4, 2, 8, 1e-3, 100.0)
    full = keras.ops.convert_to_numpy(layer(x))
    np.testing.assert_allclose(full, expected, atol=2e-4, rtol=1e-4)
    cache = layer.empty_cache(2, 6)
    _, cache = layer(x[:, :5], cache=cache, cache_update_index=0)
    step, _ = layer(x[:, 5:], cache=cache, cache_update_index=5)
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(step)[:, 0], expected[:, 5], atol=2e-4, rtol=1e-4
    )
    without = layer.__class__.from_config(
        {**layer.get_config(), "use_query_key_norm": False}
    )
    without.build((None, None, 16))
    without.set_weights([w for w in layer.get_weights() if w.ndim == 2])
    assert not np.allclose(keras.ops.convert_to_numpy(without(x)), full, atol=1e-2)


def test_query_key_norm_round_trips_its_config(normed_layer):
    layer, _ = normed_layer
    config = layer.get_config()
    assert config["use_query_key_norm"] is True
    assert config["query_key_norm_epsilon"] == 1e-3
    copy = SelfAttention.from_config(config)
    copy.build((None, None, 16))
    copy.set_weights(layer.get_weights())
    x = np.random.default_rng(5).normal(0, 1, (1, 4, 16)).astype("float32")
    np.testing.assert_array_equal(
        keras.ops.convert_to_numpy(copy(x)), keras.ops.convert_to_numpy(layer(x))
    )
    assert [w.shape for w in (copy.query_norm_scale, copy.key_norm_scale)] == [
        (8,),
        (8,),
    ]


@pytest.mark.parametrize(
    "arguments, message",
    [
        ({"use_query_key_norm": 1}, "use_query_key_norm=1"),
        ({"query_key_norm_epsilon": 0.0}, "query_key_norm_epsilon=0.0"),
        ({"query_key_norm_epsilon": -1e-6}, "query_key_norm_epsilon=-1e-06"),
    ],
)
def test_query_key_norm_arguments_are_checked(arguments, message):
    with pytest.raises(ValueError, match=message):
        SelfAttention(num_heads=2, **arguments)


@jax_slow
def test_query_key_norm_computes_in_float32_under_mixed_precision(normed_layer):
    layer, weights = normed_layer
    mixed = SelfAttention.from_config({**layer.get_config(), "dtype": "mixed_bfloat16"})
    mixed.build((None, None, 16))
    mixed.set_weights(layer.get_weights())
    assert mixed.query_norm_scale.dtype == "float32"
    x = np.random.default_rng(6).normal(0, 1, (1, 5, 16)).astype("float32")
    out = keras.ops.convert_to_numpy(keras.ops.cast(mixed(x), "float32"))
    expected = _numpy_attention(x, weights, 4, 2, 8, 1e-3, 100.0)
    np.testing.assert_allclose(out, expected, atol=0.15, rtol=0.05)


# --- keras-hub's families ----------------------------------------------------


@pytest.mark.slow
def test_gemma_3_maps_its_norms_windows_and_rope_per_layer_type():
    model = _randomized(_backbone("Gemma 3"))
    new = keras_selfattn.convert(model)
    attentions = [adapter.attention for adapter in _adapters(new)]
    assert [sa.sliding_window for sa in attentions] == [3] * 5 + [None]
    assert [sa.rope_max_wavelength for sa in attentions] == [1e4] * 5 + [1e6]
    assert [sa.rope_scaling_factor for sa in attentions] == [1.0] * 5 + [2.0]
    assert all(sa.use_query_key_norm for sa in attentions)
    assert all(sa.query_key_norm_epsilon == 1e-6 for sa in attentions)
    # Gemma's `1 + scale`, folded into the weight.
    hub = next(
        layer
        for layer in model._flatten_layers()
        if type(layer).__name__ == "CachedGemma3Attention"
    )
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(attentions[0].query_norm_scale),
        1 + keras.ops.convert_to_numpy(hub.query_norm.scale),
        rtol=1e-6,
    )
    inputs = {"token_ids": TOKENS, "padding_mask": TOKENS != 0}
    real = TOKENS != 0
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(new(inputs))[real],
        keras.ops.convert_to_numpy(model(inputs))[real],
        atol=ATOL,
    )


@pytest.mark.slow_on("jax", "Qwen 3 built and converted")
def test_qwen_3_maps_its_norms_and_sliding_window():
    """keras-hub applies Qwen 3's window on its unfused path: TensorFlow's
    (JAX and PyTorch take the fused one, which drops it)."""
    model = _randomized(_backbone("Qwen 3", sliding_window_size=3))
    new = keras_selfattn.convert(model)
    attentions = [adapter.attention for adapter in _adapters(new)]
    assert [sa.sliding_window for sa in attentions] == [3, 3]
    # keras-hub 0.32's decoder leaves its attention's norms at their own
    # default epsilon, not the backbone's layer_norm_epsilon (1e-6).
    assert all(sa.query_key_norm_epsilon == 1e-5 for sa in attentions)
    if keras.backend.backend() != "tensorflow":
        return
    inputs = {"token_ids": TOKENS, "padding_mask": TOKENS != 0}
    real = TOKENS != 0
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(new(inputs))[real],
        keras.ops.convert_to_numpy(model(inputs))[real],
        atol=ATOL,
    )


@pytest.mark.parametrize(
    "family",
    [
        pytest.param(
            "Qwen 3",
            marks=pytest.mark.slow_on(
                "tensorflow", "jax", "keras-hub's generate compiles its loop"
            ),
        ),
        pytest.param("Qwen 3 MoE", marks=pytest.mark.slow),
        pytest.param("Gemma 3", marks=pytest.mark.slow),
    ],
)
def test_converted_causal_lm_generates_keras_hub_s_greedy_tokens(family):
    lm = _causal_lm(family)
    tokens_model = keras_selfattn.convert_causal_lm(lm)
    layers = FAMILIES[family][2].get("num_layers", SMALL["num_layers"])
    assert len(tokens_model.conversion_report.converted) == layers
    expected = _greedy(lm)
    assert min(len(np.unique(row)) for row in expected) >= 4, expected
    result = keras_selfattn.generate(tokens_model, PROMPTS, STEPS)
    np.testing.assert_array_equal(result.tokens, expected)


@pytest.mark.slow
@pytest.mark.parametrize(
    "family, export_format",
    [
        generator_export(family, form)
        for family in ("Qwen 3", "Gemma 3", "Qwen 3 MoE")
        for form in ("onnx", "litert")
    ],
)
def test_converted_causal_lm_exports_its_generator(family, export_format, tmp_path):
    exports_keras_hub_s_tokens(
        lambda: _causal_lm(family), export_format, tmp_path, _greedy
    )


def _normed_token_model() -> keras.Model:
    """One causal SelfAttention with the norms (random scales), rotary
    positions and grouped heads between an embedding and the logits."""
    tokens = keras.Input((None,), dtype="int32", name="tokens")
    x = keras.layers.Embedding(40, 16)(tokens)
    h = SelfAttention(**NORMED, query_key_norm_epsilon=1e-5)(x)
    x = keras.layers.Add()([x, h])
    logits = keras.layers.Dense(40, name="logits")(x)
    return _randomized(keras.Model(tokens, logits), seed=7)


@jax_slow
def test_query_key_norm_saves_and_loads_its_scales(tmp_path):
    model = _normed_token_model()
    path = tmp_path / "normed.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    tokens = np.array([[1, 5, 9, 2]], "int32")
    np.testing.assert_array_equal(
        keras.ops.convert_to_numpy(loaded(tokens)),
        keras.ops.convert_to_numpy(model(tokens)),
    )
    (attention,) = [
        layer for layer in loaded.layers if isinstance(layer, SelfAttention)
    ]
    assert not np.allclose(keras.ops.convert_to_numpy(attention.key_norm_scale), 1)


@pytest.mark.slow
@pytest.mark.parametrize("export_format", ["saved_model", "onnx", "litert", "openvino"])
def test_query_key_norm_decode_step_exports(export_format, tmp_path):
    """Each export's own check decodes whole sequences step by step in a
    fresh process of its runtime against the Keras model (ONNX's fused
    Attention where it applies: the norms come before its core)."""
    if keras.backend.backend() != "tensorflow":
        pytest.skip("every format from TensorFlow's slow suite")
    from keras_selfattn.export.decode_step import export_decode_step

    suffix = {"saved_model": "", "onnx": ".onnx", "litert": ".tflite"}
    options = {"name": "lm"} if export_format == "saved_model" else {}
    export_decode_step(
        _normed_token_model(),
        tmp_path / f"step{suffix.get(export_format, '.xml')}",
        export_format,
        max_length=6,
        **options,
    )


@pytest.mark.slow
def test_query_key_norm_layer_fuses_into_onnx_attention(tmp_path, caplog):
    """The norms come before the fused core (its Q and K are normalized
    outside it): the layer becomes one ONNX Attention node, and the export's
    own check compares the file with Keras."""
    if keras.backend.backend() != "tensorflow":
        pytest.skip("ONNX's fused Attention is written from TensorFlow's graph")
    import logging

    import onnx

    from keras_selfattn.export import export_onnx

    path = str(tmp_path / "normed.onnx")
    with caplog.at_level(
        logging.INFO, logger="keras_selfattn.export.formats.onnx.fused"
    ):
        export_onnx(_normed_token_model(), path, fuse_attention=True)
    messages = [record.getMessage() for record in caplog.records]
    assert any("fused into one ONNX Attention node" in m for m in messages), messages
    nodes = onnx.load(path).graph.node
    assert sum(node.op_type == "Attention" for node in nodes) == 1
