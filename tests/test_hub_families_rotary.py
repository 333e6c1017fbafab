"""Partial rotary (GPT-NeoX's `rotary_percentage`), Llama 3.1's
per-frequency adjustment and YaRN's frequencies (keras-hub's
`RotaryEmbedding(rope_type="yarn")`) of SelfAttention's rotary embedding,
against an independent numpy reference; then the keras-hub families that need them,
converted: GPT-NeoX and Llama 3.1 rope scaling generate keras-hub's greedy
tokens, and export their generators."""

from __future__ import annotations

import math

import keras
import numpy as np
import pytest

import keras_selfattn
from keras_selfattn import SelfAttention
from tests.test_convert_blocks import PROMPTS, STEPS
from tests.test_convert_keras_hub_models import generator_export

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 2.0,
    "original_max_position_embeddings": 16,
}
# Over 64 positions, heads of 16 (rotating 16 or 8) and wavelength 500: the
# ramp of YaRN's 8 frequencies runs from about 0.31 to 2.99, so some keep
# their frequency, some are divided by 4, some are between.
YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 8.0,
    "truncate": False,
}
YARN_TEMPERATURE = 0.1 * math.log(4.0) + 1


def _yarn(frequencies, rotary_dim, max_wavelength, scaling):
    """keras-hub's YaRN, frequency by frequency: the pair index turning n
    times over L positions is c(n) = R ln(L / (2 pi n)) / (2 ln base); from
    low = c(beta_fast) (floored with `truncate`, at least 0) to high =
    c(beta_slow) (ceiled, at most R - 1), the share of f / factor in f grows
    from 0 to 1."""
    length = scaling["original_max_position_embeddings"]

    def turning(n):
        return (
            rotary_dim
            * math.log(length / (2 * math.pi * n))
            / (2 * math.log(max_wavelength))
        )

    low = turning(scaling.get("beta_fast", 32.0))
    high = turning(scaling.get("beta_slow", 1.0))
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    found = []
    for i, f in enumerate(frequencies):
        share = min(max((i - low) / max(high - low, 0.001), 0.0), 1.0)
        found.append(share * f / scaling["factor"] + (1 - share) * f)
    return found


def _inverse_frequencies(rotary_dim, max_wavelength, scaling=None):
    """Llama 3.1's rule, frequency by frequency (transformers' own words:
    wavelength 2 pi / f; above L / low: f / factor; below L / high: f;
    between: (1 - s) f / factor + s f, s = (L / wavelength - low) / (high -
    low))."""
    if scaling is not None and scaling["rope_type"] == "yarn":
        plain = _inverse_frequencies(rotary_dim, max_wavelength)
        return _yarn(plain, rotary_dim, max_wavelength, scaling)
    found = []
    for i in range(rotary_dim // 2):
        f = 1.0 / max_wavelength ** (2 * i / rotary_dim)
        if scaling is not None:
            length = scaling["original_max_position_embeddings"]
            low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
            wavelength = 2 * math.pi / f
            if wavelength > length / low:
                f = f / scaling["factor"]
            elif wavelength >= length / high:
                s = (length / wavelength - low) / (high - low)
                f = (1 - s) * f / scaling["factor"] + s * f
        found.append(f)
    return found


def _rotated(x, rotary_dim, frequencies):
    """(T, D) rows of one head: the pairs (i, i + R/2), i < R/2, of the first
    R features turned by t * frequencies[i]; the others as they are."""
    out = np.array(x, np.float64)
    half = rotary_dim // 2
    for t in range(x.shape[0]):
        for i in range(half):
            c, s = math.cos(t * frequencies[i]), math.sin(t * frequencies[i])
            a, b = x[t, i], x[t, i + half]
            out[t, i], out[t, i + half] = a * c - b * s, b * c + a * s
    return out


def _reference(layer, x):
    """The causal attention of `layer` (no output projection) over (B, T, F)
    `x`, in float64, its rotary as `_rotated` says."""
    wq, wk, wv = (np.asarray(w, np.float64) for w in layer.get_weights())
    heads, depth = layer.num_heads, layer.key_dim
    rotary_dim = int(depth * layer.rope_partial_fraction)
    frequencies = _inverse_frequencies(
        rotary_dim, layer.rope_max_wavelength, layer.rope_frequency_scaling
    )
    batch, time, _ = x.shape
    out = np.zeros((batch, time, heads * depth))
    for b in range(batch):
        q, k, v = x[b] @ wq, x[b] @ wk, x[b] @ wv
        for h in range(heads):
            part = slice(h * depth, (h + 1) * depth)
            qh = _rotated(q[:, part], rotary_dim, frequencies)
            kh = _rotated(k[:, part], rotary_dim, frequencies)
            scores = qh @ kh.T * (layer.scale or 1 / math.sqrt(depth))
            scores[np.triu_indices(time, 1)] = -np.inf
            weights = np.exp(scores - scores.max(-1, keepdims=True))
            weights /= weights.sum(-1, keepdims=True)
            out[b, :, part] = weights @ v[:, part]
    return out


CASES = {
    # GPT-NeoX's rotary_percentage 0.25 of a head of 16: 4 features turn.
    "partial": dict(rope_partial_fraction=0.25),
    # The three bands of Llama 3.1's rule: wavelengths 6.3 (kept), 13.6
    # (between 16 / 2 and 16 / 1) and 29.7 up (8 times longer).
    "llama3": dict(rope_frequency_scaling=LLAMA3),
    "both": dict(rope_partial_fraction=0.5, rope_frequency_scaling=LLAMA3),
    # The temperature is the caller's scale (GPT-OSS's mapping).
    "yarn": dict(rope_frequency_scaling=YARN, scale=YARN_TEMPERATURE**2 / 4),
    # Truncated (the default): the ramp from 0 to 2 over 4 frequencies.
    "yarn partial": dict(
        rope_partial_fraction=0.5,
        rope_frequency_scaling={**YARN, "truncate": True, "beta_fast": 32.0},
    ),
}


def _layer(case):
    layer = SelfAttention(
        num_heads=2, key_dim=16, causal=True, rope_max_wavelength=500.0, **CASES[case]
    )
    layer.build((None, None, 12))
    rng = np.random.default_rng(3)
    layer.set_weights([rng.normal(size=w.shape) for w in layer.get_weights()])
    return layer


X = np.random.default_rng(4).normal(size=(2, 40, 12)).astype("float32")


@pytest.mark.parametrize("case", CASES)
def test_rotary_variants_match_the_numpy_reference(case):
    layer = _layer(case)
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(layer(X)), _reference(layer, X), atol=2e-4
    )


@pytest.mark.slow_on("jax", "JAX compiles every eager op of each decoding step")
@pytest.mark.parametrize("case", ["partial", "llama3", "yarn"])
def test_rotary_variants_decode_step_by_step_as_the_full_call(case):
    layer = _layer(case)
    x = X[:, :6]
    full = keras.ops.convert_to_numpy(layer(x))
    cache = layer.empty_cache(2, 6)
    for t in range(6):
        step, cache = layer(x[:, t : t + 1], cache=cache, cache_update_index=t)
        np.testing.assert_allclose(
            keras.ops.convert_to_numpy(step)[:, 0], full[:, t], atol=1e-5
        )


def test_rotary_variants_round_trip_their_config():
    layer = _layer("both")
    config = layer.get_config()
    assert config["rope_partial_fraction"] == 0.5
    assert config["rope_frequency_scaling"] == LLAMA3
    copy = SelfAttention.from_config(config)
    copy.build((None, None, 12))
    copy.set_weights(layer.get_weights())
    np.testing.assert_array_equal(
        keras.ops.convert_to_numpy(copy(X[:, :5])),
        keras.ops.convert_to_numpy(layer(X[:, :5])),
    )


def test_yarn_round_trips_its_config_with_its_defaults_filled_in():
    layer = _layer("yarn")
    config = layer.get_config()
    assert config["rope_frequency_scaling"] == {**YARN, "beta_slow": 1.0}
    assert config["scale"] == YARN_TEMPERATURE**2 / 4
    copy = SelfAttention.from_config(config)
    copy.build((None, None, 12))
    copy.set_weights(layer.get_weights())
    np.testing.assert_array_equal(
        keras.ops.convert_to_numpy(copy(X[:, :5])),
        keras.ops.convert_to_numpy(layer(X[:, :5])),
    )


@pytest.mark.parametrize(
    "arguments, named",
    [
        (dict(rope_partial_fraction=0.0), "rope_partial_fraction=0.0"),
        (dict(rope_partial_fraction=1.5), "rope_partial_fraction=1.5"),
        # 16 * 0.3 = 4.8: 4 features; 16 * 0.1: 1, odd.
        (dict(rope_partial_fraction=0.1), "rope_partial_fraction=0.1"),
        (dict(rope_frequency_scaling={"rope_type": "yarn"}), "'yarn'"),
        (
            dict(rope_frequency_scaling={**LLAMA3, "factor": -1.0}),
            "rope_frequency_scaling['factor']",
        ),
        (
            dict(rope_frequency_scaling={**LLAMA3, "high_freq_factor": 0.5}),
            "'high_freq_factor'",
        ),
        (dict(rope_frequency_scaling={**YARN, "factor": 0}), "['factor']"),
        (dict(rope_frequency_scaling={**YARN, "truncate": 1}), "['truncate']"),
        (dict(rope_frequency_scaling={**YARN, "beta_slow": 9.0}), "['beta_fast']"),
        # The temperature is the layer's `scale`, not a key.
        (
            dict(rope_frequency_scaling={**YARN, "attention_factor": 1.1}),
            "'attention_factor'",
        ),
        (
            dict(rope_frequency_scaling={"rope_type": "yarn", "factor": 4.0}),
            "'original_max_position_embeddings'",
        ),
    ],
)
def test_bad_rotary_arguments_are_named(arguments, named):
    with pytest.raises(ValueError, match="Received") as error:
        SelfAttention(num_heads=2, key_dim=16, rope_max_wavelength=10.0, **arguments)
    assert named in str(error.value)


@pytest.mark.slow
@pytest.mark.parametrize("export_format", ["saved_model", "onnx", "litert", "openvino"])
def test_rotary_variants_export_in_every_format(export_format, tmp_path):
    """Each export's own check runs the file in its runtime against Keras;
    the fused ONNX writer fuses the attention core (the rotation stays
    before it)."""
    if keras.backend.backend() != "tensorflow":
        pytest.skip("one export per format, from TensorFlow's slow suite")
    layer = SelfAttention(
        num_heads=2,
        key_dim=16,
        causal=True,
        output_dim=12,
        rope_max_wavelength=500.0,
        name="rotary",
        **CASES["both"],
    )
    exports_alone(layer, export_format, tmp_path)


def exports_alone(layer, export_format: str, tmp_path) -> tuple[keras.Model, str]:
    """A model of `layer` alone on (batch, time, 12) inputs and its export
    to `export_format`, through the export's own check (the file in its
    runtime against Keras); an ONNX file is written fused and must hold one
    Attention node."""
    from keras_selfattn.export import export

    x = keras.Input((None, 12), name="x")
    model = keras.Model(x, layer(x))
    options = {
        "saved_model": {"name": layer.name},
        "onnx": {"fuse_attention": True},
    }.get(export_format, {})
    suffix = {"onnx": ".onnx", "litert": ".tflite", "openvino": ".xml"}
    path = export(
        model,
        tmp_path / f"{layer.name}{suffix.get(export_format, '')}",
        export_format,
        **options,
    )
    if export_format == "onnx":
        import onnx

        nodes = onnx.load(path).graph.node
        assert [node.op_type for node in nodes].count("Attention") == 1
    return model, path


# keras-hub families (tiny, random weights whose greedy tokens vary: at
# least 4 distinct in each row): backbone, causal LM, arguments, seed.
FAMILIES = {
    # Half of each head of 8 turns (keras-hub's default 0.25 turns 2).
    "GPT-NeoX": (
        "GPTNeoXBackbone",
        "GPTNeoXCausalLM",
        dict(
            vocabulary_size=40,
            num_layers=2,
            num_heads=2,
            hidden_dim=16,
            intermediate_dim=32,
            rotary_max_wavelength=500,
            rotary_percentage=0.5,
        ),
        10,
    ),
    # Wavelengths 6.3 (between 16 / 4 and 16 / 1) and 140 (8 times longer).
    "Llama 3.1": (
        "LlamaBackbone",
        "LlamaCausalLM",
        dict(
            vocabulary_size=40,
            hidden_dim=16,
            intermediate_dim=32,
            num_layers=2,
            num_query_heads=4,
            num_key_value_heads=2,
            rope_max_wavelength=500,
            rope_frequency_adjustment_factor=8.0,
            rope_low_freq_factor=1.0,
            rope_high_freq_factor=4.0,
            rope_pretraining_sequence_length=16,
        ),
        5,
    ),
}


def _causal_lm(family: str):
    keras_hub = pytest.importorskip("keras_hub")
    from tests.test_convert_keras_hub_models import _randomized

    backbone, lm, arguments, seed = FAMILIES[family]
    backbone = getattr(keras_hub.models, backbone)(**arguments)
    return _randomized(getattr(keras_hub.models, lm)(backbone, preprocessor=None), seed)


def _forward_greedy(lm) -> np.ndarray:
    """Greedy tokens of keras-hub's own forward pass, one call per token."""
    rows = []
    for prompt in PROMPTS:
        ids = list(prompt)
        for _ in range(STEPS):
            x = np.array([ids], "int32")
            logits = lm({"token_ids": x, "padding_mask": np.ones_like(x, bool)})
            ids.append(int(np.argmax(keras.ops.convert_to_numpy(logits)[0, -1])))
        rows.append(ids[len(prompt) :])
    return np.array(rows)


def _expected(family: str, lm) -> np.ndarray:
    """keras-hub's greedy tokens: its `generate`'s; GPT-NeoX's from its
    forward pass (keras-hub 0.32's cached call rotates a step's query as
    position 0, `migration.hub_neox`)."""
    if family == "GPT-NeoX":
        return _forward_greedy(lm)
    from tests.test_convert_blocks import _keras_hub_greedy

    return _keras_hub_greedy(lm, PROMPTS, STEPS)


@pytest.mark.parametrize(
    "family",
    [
        pytest.param(family, marks=pytest.mark.slow)
        if family == "GPT-NeoX"
        else pytest.param(
            family,
            marks=pytest.mark.slow_on(
                "tensorflow", "jax", "keras-hub's generate compiles its loop"
            ),
        )
        for family in FAMILIES
    ],
)
def test_converted_family_generates_keras_hub_s_greedy_tokens(family):
    lm = _causal_lm(family)
    tokens_model = keras_selfattn.convert_causal_lm(lm)
    assert len(tokens_model.conversion_report.converted) == 2
    expected = _expected(family, lm)
    assert min(len(np.unique(row)) for row in expected) >= 4, expected
    result = keras_selfattn.generate(tokens_model, PROMPTS, STEPS)
    np.testing.assert_array_equal(result.tokens, expected)


@pytest.mark.slow
@pytest.mark.parametrize(
    "family, export_format",
    [
        generator_export(family, form)
        for family in FAMILIES
        for form in ("onnx", "litert")
    ],
)
def test_converted_family_exports_its_generator(family, export_format, tmp_path):
    from tests.test_convert_keras_hub_models import exports_keras_hub_s_tokens

    exports_keras_hub_s_tokens(
        lambda: _causal_lm(family),
        export_format,
        tmp_path,
        lambda lm: _expected(family, lm),
    )


@pytest.mark.slow_on("tensorflow", "jax", "a backbone converted: PyTorch checks")
def test_llama_s_position_scaling_factor_is_mapped_as_keras_hub_computes_it():
    """keras-hub 0.32's Llama rotary embedding leaves its
    `rope_position_scaling_factor` out of its frequencies: the converted
    backbone computes what keras-hub's computes, not a rotation 4 times
    slower."""
    keras_hub = pytest.importorskip("keras_hub")
    from tests.test_convert_keras_hub_models import TOKENS, _randomized

    arguments = dict(FAMILIES["Llama 3.1"][2], rope_position_scaling_factor=4.0)
    model = _randomized(keras_hub.models.LlamaBackbone(**arguments), seed=5)
    new = keras_selfattn.convert(model)
    inputs = {"token_ids": TOKENS, "padding_mask": TOKENS != 0}
    real = TOKENS != 0
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(new(inputs))[real],
        keras.ops.convert_to_numpy(model(inputs))[real],
        atol=2e-5,
    )
