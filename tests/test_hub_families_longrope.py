"""LongRoPE (Phi-3's "su" rotary scaling: keras-hub's
`Phi3SuScaledRotaryEmbedding`, transformers' `longrope`) of SelfAttention's
rotary embedding, against an independent numpy reference of its two tables
and their switch; then keras-hub's su-scaled Phi-3 (Phi-3 128k, Phi-3.5,
Phi-4 mini), converted: its backbone's outputs on both sides of the switch,
keras-hub's greedy tokens in `generate` and in the ONNX and LiteRT
generators where keras-hub's `generate` follows the original model, and,
where it does not (a prompt of at most the pretraining length, generating
past it), the tokens of keras-hub's own cached call driven one prompt at a
time as Hugging Face drives a model."""

from __future__ import annotations

import math

import keras
import numpy as np
import pytest

import keras_selfattn
from keras_selfattn import SelfAttention
from tests import generation_reference as reference
from tests.test_convert_blocks import PROMPTS, STEPS, _keras_hub_greedy
from tests.test_hub_families_rotary import exports_alone

ORIGINAL = 6
LONGROPE = {
    "rope_type": "longrope",
    "short_factor": [1.0, 1.5, 0.7, 2.0],
    "long_factor": [3.0, 5.0, 9.0, 20.0],
    "original_max_position_embeddings": ORIGINAL,
}
WAVELENGTH = 50.0
X = np.random.default_rng(7).normal(size=(2, 11, 12)).astype("float32")


def _frequencies(end: int, scaling: dict, switch: int) -> np.ndarray:
    """keras-hub's inverse frequencies of a call ending at `end`: base **
    (-2i / D) divided by the long factors past `switch`, else the short."""
    factors = scaling["long_factor" if end > switch else "short_factor"]
    depth = 2 * len(factors)
    return np.array([WAVELENGTH ** (-2 * i / depth) / f for i, f in enumerate(factors)])


def _rotated(row: np.ndarray, position: int, frequencies) -> np.ndarray:
    half = len(frequencies)
    out = np.array(row, np.float64)
    for i, f in enumerate(frequencies):
        c, s = math.cos(position * f), math.sin(position * f)
        a, b = row[i], row[i + half]
        out[i], out[i + half] = a * c - b * s, b * c + a * s
    return out


def _reference(layer, x, calls, scaling=LONGROPE, switch=ORIGINAL) -> np.ndarray:
    """The causal attention of `layer` (no output projection) over (B, T, F)
    `x` run as `calls`, (start, length) pairs in order, in float64: each
    call's queries and keys turn by its own table, and keys keep theirs."""
    wq, wk, wv = (np.asarray(w, np.float64) for w in layer.get_weights())
    heads, depth = layer.num_heads, layer.key_dim
    batch, time, _ = x.shape
    out = np.zeros((batch, time, heads * depth))
    for b in range(batch):
        q, k, v = x[b] @ wq, x[b] @ wk, x[b] @ wv
        for h in range(heads):
            part = slice(h * depth, (h + 1) * depth)
            keys = np.zeros((time, depth))
            for start, length in calls:
                frequencies = _frequencies(start + length, scaling, switch)
                for t in range(start, start + length):
                    keys[t] = _rotated(k[t, part], t, frequencies)
                for t in range(start, start + length):
                    query = _rotated(q[t, part], t, frequencies)
                    scores = keys[: t + 1] @ query / math.sqrt(depth)
                    weights = np.exp(scores - scores.max())
                    out[b, t, part] = weights / weights.sum() @ v[: t + 1, part]
    return out


@pytest.fixture(scope="module")
def layer():
    found = SelfAttention(
        num_heads=2,
        key_dim=8,
        causal=True,
        rope_max_wavelength=WAVELENGTH,
        rope_frequency_scaling=LONGROPE,
    )
    found.build((None, None, 12))
    rng = np.random.default_rng(3)
    found.set_weights([rng.normal(size=w.shape) for w in found.get_weights()])
    return found


def _full(layer, time: int) -> np.ndarray:
    return keras.ops.convert_to_numpy(layer(X[:, :time]))


@pytest.mark.parametrize("time", [ORIGINAL - 1, ORIGINAL, ORIGINAL + 1, 11])
def test_full_calls_use_the_table_of_their_length(layer, time):
    np.testing.assert_allclose(
        _full(layer, time), _reference(layer, X[:, :time], [(0, time)]), atol=2e-4
    )


def test_the_reference_tells_a_wrong_switch_or_factor(layer):
    """The reference run with the switch one position early, or a long
    factor changed, differs from the layer: the tests above can fail."""
    swapped = {**LONGROPE, "long_factor": [3.0, 5.0, 20.0, 9.0]}
    wrong = [
        (ORIGINAL, _reference(layer, X[:, :ORIGINAL], [(0, ORIGINAL)], switch=5)),
        (11, _reference(layer, X, [(0, 11)], scaling=swapped)),
        (ORIGINAL, _reference(layer, X[:, :ORIGINAL], [(0, ORIGINAL)], swapped, 5)),
    ]
    for time, expected in wrong:
        assert np.abs(_full(layer, time) - expected).max() > 1e-2


@pytest.mark.slow_on("jax", "JAX compiles every eager op of each decoding step")
def test_cached_steps_switch_at_their_end_and_keys_keep_their_table(layer):
    """A prompt of 4 (short), then one position per step: the steps ending
    past 6 turn their query and key by the long table, the cached keys keep
    the short one."""
    cache = layer.empty_cache(2, 11)
    first, cache = layer(X[:, :4], cache=cache, cache_update_index=0)
    outputs = [keras.ops.convert_to_numpy(first)]
    for t in range(4, 11):
        step, cache = layer(X[:, t : t + 1], cache=cache, cache_update_index=t)
        outputs.append(keras.ops.convert_to_numpy(step))
    calls = [(0, 4), *((t, 1) for t in range(4, 11))]
    np.testing.assert_allclose(
        np.concatenate(outputs, axis=1), _reference(layer, X, calls), atol=2e-4
    )


def test_longrope_round_trips_its_config(layer):
    config = layer.get_config()
    assert config["rope_frequency_scaling"] == LONGROPE
    copy = SelfAttention.from_config(config)
    copy.build((None, None, 12))
    copy.set_weights(layer.get_weights())
    np.testing.assert_array_equal(
        keras.ops.convert_to_numpy(copy(X[:, :8])), _full(layer, 8)
    )


@pytest.mark.parametrize(
    "scaling, named",
    [
        ({**LONGROPE, "short_factor": [1.0, 2.0]}, "['short_factor']"),
        ({**LONGROPE, "long_factor": [1.0] * 5}, "['long_factor']"),
        ({**LONGROPE, "long_factor": []}, "['long_factor']"),
        ({**LONGROPE, "short_factor": [1.0, -1.0, 1.0, 1.0]}, "['short_factor']"),
        ({**LONGROPE, "short_factor": 2.0}, "['short_factor']"),
        (
            {**LONGROPE, "original_max_position_embeddings": 6.5},
            "['original_max_position_embeddings']",
        ),
        ({**LONGROPE, "factor": 2.0}, "'factor'"),
    ],
)
def test_bad_longrope_arguments_are_named_in_one_line(scaling, named):
    with pytest.raises(ValueError, match="Received") as error:
        SelfAttention(
            num_heads=2,
            key_dim=8,
            rope_max_wavelength=WAVELENGTH,
            rope_frequency_scaling=scaling,
        )
    assert named in str(error.value) and "\n" not in str(error.value)


@pytest.mark.release  # the generators' and the step's exports below run in CI
@pytest.mark.slow
@pytest.mark.parametrize("export_format", ["saved_model", "onnx", "litert", "openvino"])
def test_longrope_exports_in_every_format(export_format, layer, tmp_path):
    """Each export's own check runs the file in its runtime against Keras;
    the fused ONNX writer still fuses the attention core (the switch and the
    rotation stay before it), and its file follows the switch."""
    if keras.backend.backend() != "tensorflow":
        pytest.skip("one export per format, from TensorFlow's slow suite")
    copy = SelfAttention.from_config({**layer.get_config(), "output_dim": 12})
    model, path = exports_alone(copy, export_format, tmp_path)
    if export_format == "onnx":
        import onnxruntime

        session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
        for time in (ORIGINAL, 9):  # the short table, then the long one
            (found,) = session.run(None, {session.get_inputs()[0].name: X[:, :time]})
            np.testing.assert_allclose(
                found, keras.ops.convert_to_numpy(model(X[:, :time])), atol=1e-5
            )


# A tiny su-scaled Phi-3: heads of 4 (2 factors each), 32 positions
# extended from `original` (its cosines and sines multiplied by sqrt(1 +
# ln(32 / 8) / ln(8)) = 1.29); random weights (seed 0) whose greedy tokens
# vary (at least 4 distinct in each row).
SHORT_PROMPTS = [[3, 7, 1], [5]]  # 3 + 5 = 8 positions: all short
LONG_PROMPTS = [[3, 7, 1, 9, 4, 2, 8, 5, 6, 1], [5, 8, 2, 6, 1, 3, 9, 4, 7]]


def _causal_lm(original: int = 8):
    keras_hub = pytest.importorskip("keras_hub")
    from tests.test_convert_keras_hub_models import SMALL, _randomized

    rng = np.random.default_rng(0)
    backbone = keras_hub.models.Phi3Backbone(
        **SMALL,
        rope_max_wavelength=500,
        max_sequence_length=32,
        pretraining_sequence_length=original,
        rope_scaling_type="su",
        rope_scaling_short_factor=[float(f) for f in rng.uniform(0.5, 2, 2)],
        rope_scaling_long_factor=[float(f) for f in rng.uniform(2, 8, 2)],
    )
    lm = keras_hub.models.Phi3CausalLM(backbone, preprocessor=None)
    return _randomized(lm, seed=0)


@pytest.fixture(scope="module")
def phi3():
    lm = _causal_lm()
    return lm, keras_selfattn.convert_causal_lm(lm)


@pytest.mark.slow_on("jax", "JAX compiles every eager op of a new model")
def test_su_scaled_phi3_backbone_computes_keras_hub_s_on_both_sides(phi3):
    lm, tokens_model = phi3
    assert len(tokens_model.conversion_report.converted) == 2
    backbone = keras_selfattn.convert(lm.backbone)
    ids = np.random.default_rng(1).integers(1, 40, (2, 12)).astype("int32")
    for time in (7, 8, 9, 12):
        inputs = {
            "token_ids": ids[:, :time],
            "padding_mask": np.ones((2, time), bool),
        }
        np.testing.assert_allclose(
            keras.ops.convert_to_numpy(backbone(inputs)),
            keras.ops.convert_to_numpy(lm.backbone(inputs)),
            atol=2e-5,
        )


@pytest.mark.slow_on("tensorflow", "jax", "keras-hub's generate compiles its loop")
@pytest.mark.parametrize(
    "prompts", [SHORT_PROMPTS, LONG_PROMPTS], ids=["below", "above"]
)
def test_su_scaled_phi3_generates_keras_hub_s_greedy_tokens(phi3, prompts):
    """All within the 8 pretraining positions (the short table), and prompts
    all past them (the long one)."""
    lm, tokens_model = phi3
    expected = _keras_hub_greedy(lm, prompts, STEPS)
    assert min(len(np.unique(row)) for row in expected) >= 4, expected
    result = keras_selfattn.generate(tokens_model, prompts, STEPS)
    np.testing.assert_array_equal(result.tokens, expected)


# Shorter than, as long as and longer than the 8 pretraining positions,
# generating past them: the first two rows switch tables while generating.
CROSSING = [[3, 7, 1], [5, 8, 2, 6, 1, 3, 9, 4], [3, 7, 1, 9, 4, 2, 8, 5, 6, 1]]
CROSSING_STEPS = 8


def _alone(lm, prompt, steps, row=0, seed=0, **controls) -> list[int]:
    """keras-hub's `call_with_cache` driven as Hugging Face drives a model,
    one prompt alone: its exact tokens prefilled at index 0, then one token
    per step at its own index (each call's table by its own end), the next
    token by `reference.next_token` (greedy unless `controls`) with the
    uniform of row `row`, step t of `seed`."""
    backbone = lm.backbone
    cache = np.zeros(
        (
            1,
            backbone.num_layers,
            2,
            len(prompt) + steps,
            backbone.num_key_value_heads,
            backbone.hidden_dim // backbone.num_query_heads,
        ),
        "float32",
    )
    fed, index, tokens = np.array([prompt], "int32"), 0, []
    for t in range(steps):
        logits, _, cache = lm.call_with_cache(fed, cache, index)
        last = keras.ops.convert_to_numpy(logits)[0, -1]
        tokens.append(
            reference.next_token(last, reference.uniform(seed, row, t), **controls)
        )
        index += fed.shape[1]
        fed = np.array([[tokens[-1]]], "int32")
    return tokens


@pytest.fixture(scope="module")
def crossing(phi3):
    """Each CROSSING row's greedy tokens, alone."""
    lm, _ = phi3
    expected = np.array([_alone(lm, p, CROSSING_STEPS) for p in CROSSING])
    assert min(len(np.unique(row)) for row in expected) >= 4, expected
    return expected


@pytest.mark.slow_on(
    "tensorflow",
    "jax",
    "each row's own loop compiled (13 s on TensorFlow): PyTorch checks",
)
def test_rows_crossing_the_switch_generate_what_each_computes_alone(phi3, crossing):
    """In one batch of mixed lengths, each row's table switches at its own
    end position and its positions are its own: no row's tokens depend on
    the others (keras-hub's `generate` prefills the whole padded width with
    the long table instead, docs/decoding.md)."""
    _, tokens_model = phi3
    result = keras_selfattn.generate(tokens_model, CROSSING, CROSSING_STEPS)
    np.testing.assert_array_equal(result.tokens, crossing)
    alone = keras_selfattn.generate(tokens_model, CROSSING[:1], CROSSING_STEPS)
    np.testing.assert_array_equal(alone.tokens, crossing[:1])


@pytest.mark.slow_on(
    "tensorflow", "jax", "keras-hub's eager cached calls, row by row, and a new loop"
)
def test_rows_crossing_the_switch_sample_what_each_samples_alone(phi3):
    """Seeded sampling of CROSSING: each row's tokens alone, with the uniforms
    of its row of the batch."""
    lm, tokens_model = phi3
    controls = {"temperature": 1.5, "top_k": 12, "top_p": 0.9}
    expected = [
        _alone(lm, p, CROSSING_STEPS, seed=5, row=row, **controls)
        for row, p in enumerate(CROSSING)
    ]
    result = keras_selfattn.generate(
        tokens_model, CROSSING, CROSSING_STEPS, seed=5, **controls
    )
    np.testing.assert_array_equal(result.tokens, expected)


@pytest.mark.slow
def test_su_scaled_phi3_exports_its_generator_to_litert(tmp_path):
    """Pretraining length 12: `PROMPTS` stay within it (keras-hub's tokens,
    the short table) and the export's own checks, of 16 positions, switch to
    the long table in the runtime as in `generate`."""
    from tests.test_convert_keras_hub_models import exports_keras_hub_s_tokens

    exports_keras_hub_s_tokens(
        lambda: _causal_lm(original=12),
        "litert",
        tmp_path,
        lambda lm: _keras_hub_greedy(lm, PROMPTS, STEPS),
    )


@pytest.mark.slow
def test_su_scaled_phi3_onnx_generator_crosses_the_switch_per_row(
    phi3, crossing, tmp_path
):
    """The ONNX generator of CROSSING (rows crossing the 8 pretraining
    positions while generating), run in ONNX Runtime: each row's tokens
    alone."""
    if keras.backend.backend() != "tensorflow":
        pytest.skip("one export per format, from TensorFlow's slow suite")
    import onnxruntime

    from keras_selfattn.export import export_generator

    _, tokens_model = phi3
    path = export_generator(tokens_model, tmp_path / "lm.onnx", "onnx", max_length=20)
    session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
    request = reference.generator_request(CROSSING, CROSSING_STEPS, 40)
    tokens, _ = session.run(["tokens", "lengths"], request)
    np.testing.assert_array_equal(tokens, crossing)


@pytest.mark.slow_on("tensorflow", "jax", "the decode check's loops: PyTorch checks")
def test_decode_check_compares_the_forward_before_the_switch(phi3):
    """A decode crossing N (prompts of 1 and 3, max_length 12) is compared
    with the full forward on its first N positions (after them no single
    forward pass computes the cached keys' mixed tables); a whole-sequence
    prompt, all long, on every position."""
    from keras_selfattn.export import verify_decode_step
    from keras_selfattn.export.decode_step.check import forward_positions
    from keras_selfattn.export.decode_step.graph import build_decode_step

    _, tokens_model = phi3
    layers = build_decode_step(tokens_model, 12).layers
    assert forward_positions(layers, 3, 12) == 8
    assert forward_positions(layers, 9, 12) == 12
    assert forward_positions(layers, 3, 8) == 8
    report = verify_decode_step(tokens_model, max_length=12)
    assert {row.runtime for row in report.rows} == {"keras_cache"}


@pytest.mark.slow
def test_su_scaled_phi3_decoding_step_exports_past_the_switch(phi3, tmp_path):
    """The exported ONNX step decodes, in a fresh onnxruntime process, as
    Keras's cached calls do across the switch (the export's own check; the
    logits reach 11, and ONNX Runtime's float32 sums differ from Keras's by
    up to 4e-5 on either side of the switch: atol 1e-4)."""
    if keras.backend.backend() != "tensorflow":
        pytest.skip("one export, from TensorFlow's slow suite")
    from keras_selfattn.export import export_decode_step

    _, tokens_model = phi3
    path = export_decode_step(
        tokens_model, tmp_path / "step.onnx", "onnx", max_length=12, atol=1e-4
    )
    assert path.endswith(".onnx")
