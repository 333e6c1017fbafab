"""Attention inside layers converts: keras.io's subclassed blocks and
keras-hub's layers and backbones. The reference is always the original
model, Keras's own attention layers."""

from __future__ import annotations

import keras
import numpy as np
import pytest

import keras_selfattn
from keras_selfattn import SelfAttention
from keras_selfattn.migration.adapter import MultiHeadAttentionAdapter
from tests import generation_reference as reference
from tests import user_blocks

ATOL = 2e-5
TOKENS = np.array([[3, 4, 5, 6, 0, 0], [7, 8, 9, 1, 2, 3]], "int32")
PROMPTS = [[3, 7, 1, 9], [5], [8, 2, 6]]
STEPS = 5
jax_slow = pytest.mark.slow_on("jax", "JAX compiles every eager op of a new model")


def _numpy(x):
    return keras.ops.convert_to_numpy(x)


def _keras_attention(model) -> list:
    return [
        layer
        for layer in model._flatten_layers()
        if isinstance(
            layer, (keras.layers.MultiHeadAttention, keras.layers.GroupQueryAttention)
        )
    ]


@pytest.fixture(scope="module")
def classifier():
    model = user_blocks.classifier()
    return model, keras_selfattn.convert(model)


def test_keras_io_block_converts_with_its_outputs(classifier):
    model, new = classifier
    assert _keras_attention(new) == []
    block = new.layers[2]
    assert type(block).__name__ == "TransformerBlock"
    assert isinstance(block.att, MultiHeadAttentionAdapter)
    assert isinstance(block.att.attention, SelfAttention)
    report = new.conversion_report
    assert len(report.converted) == 1 and report.kept == [] and not report.padded
    assert "inside TransformerBlock" in report.converted[0]
    np.testing.assert_allclose(_numpy(new(TOKENS)), _numpy(model(TOKENS)), atol=ATOL)
    assert _keras_attention(model), "the original model is left as it was"


@jax_slow
def test_padded_block_equal_at_real_positions():
    model = user_blocks.tagger()
    new = keras_selfattn.convert(model)
    assert new.conversion_report.padded
    real = TOKENS != 0
    np.testing.assert_allclose(
        _numpy(new(TOKENS))[real], _numpy(model(TOKENS))[real], atol=ATOL
    )


def test_converted_block_saves_loads_and_trains(classifier, tmp_path):
    _, new = classifier
    path = tmp_path / "converted.keras"
    new.save(path)
    # The user's registered block and this package: no custom_objects.
    loaded = keras.models.load_model(path)
    block = loaded.layers[2]
    assert type(block) is user_blocks.TransformerBlock.__mro__[0] or (
        type(block).__mro__[1] is user_blocks.TransformerBlock
    )
    assert isinstance(block.att, MultiHeadAttentionAdapter)
    np.testing.assert_allclose(_numpy(loaded(TOKENS)), _numpy(new(TOKENS)), atol=0)
    loaded.save(tmp_path / "again.keras")  # a loaded model saves alike
    again = keras.models.load_model(tmp_path / "again.keras")
    np.testing.assert_allclose(_numpy(again(TOKENS)), _numpy(new(TOKENS)), atol=0)
    loaded.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    kernel = block.att.attention.query_dense.kernel
    before = _numpy(kernel).copy()
    loaded.fit(TOKENS, np.array([0, 1]), epochs=1, verbose=0)
    assert not np.allclose(_numpy(kernel), before)


@pytest.mark.slow_on("tensorflow", "jax", "generation compiles its loop: 70-90 s")
def test_converted_language_model_generates_what_the_original_computes():
    model = user_blocks.language_model()
    new = keras_selfattn.convert(model)
    assert _keras_attention(new) == [] and len(new.conversion_report.converted) == 2
    result = keras_selfattn.generate(new, PROMPTS, STEPS)
    tokens, lengths = reference.uncached(model, PROMPTS, STEPS)
    assert len(np.unique(tokens)) > 2, "a test of varied tokens"
    np.testing.assert_array_equal(result.tokens, tokens)
    np.testing.assert_array_equal(result.lengths, lengths)


@jax_slow
def test_self_attention_converts_and_cross_attention_stays():
    model = user_blocks.encoder_decoder()
    new = keras_selfattn.convert(model)
    report = new.conversion_report
    assert len(report.converted) == 1 and "GroupedQueryAttention" in report.converted[0]
    assert len(report.kept) == 1 and "cross-attention" in report.kept[0]
    block = new.layers[2]
    assert isinstance(block.inner.attention, MultiHeadAttentionAdapter)
    assert type(block.cross) is keras.layers.MultiHeadAttention
    rng = np.random.default_rng(0)
    inputs = [
        rng.normal(size=(2, 5, user_blocks.D)).astype("float32"),
        rng.normal(size=(2, 3, 8)).astype("float32"),
    ]
    np.testing.assert_allclose(_numpy(new(inputs)), _numpy(model(inputs)), atol=ATOL)


def test_adapter_refuses_what_it_cannot_compute_in_one_line():
    mha = keras.layers.MultiHeadAttention(2, 4)
    x = np.random.default_rng(0).normal(size=(1, 5, 8)).astype("float32")
    mha(x, x)
    adapter = MultiHeadAttentionAdapter.from_multi_head_attention(mha)
    np.testing.assert_allclose(_numpy(adapter(x, x)), _numpy(mha(x, x)), atol=ATOL)
    for call, match in [
        (lambda: adapter(x, x[:, :3]), "its value must be its query"),
        (lambda: adapter(x, x, use_causal_mask=True), "use_causal_mask=True"),
    ]:
        with pytest.raises(ValueError, match=match) as error:
            call()
        assert "\n" not in str(error.value)


class OwnCall(keras.layers.MultiHeadAttention):
    def call(self, query, value, key=None, **kwargs):
        return super().call(query, value, key, **kwargs) * 2.0


class Holder(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.mha = OwnCall(2, 4)

    def call(self, x):
        return self.mha(x, x)


def test_subclass_with_its_own_call_inside_a_layer_stays():
    x = keras.Input((None, user_blocks.D))
    model = keras.Model(x, Holder(name="holder")(x))
    report = keras_selfattn.convert(model).conversion_report
    assert report.converted == []
    assert "holder/" in report.kept[0] and "a subclass, OwnCall" in report.kept[0]


# --- keras-hub ------------------------------------------------------------

keras_hub = pytest.importorskip("keras_hub")  # noqa: E402


# keras-hub's model families, small: random weights, seconds to build.
SMALL = {"vocabulary_size": 40, "hidden_dim": 16, "intermediate_dim": 32}


def _hub_models() -> dict:
    tokens = keras.Input((None,), dtype="int32")
    x = keras_hub.layers.TokenAndPositionEmbedding(40, 16, 16, mask_zero=True)(tokens)
    x = keras_hub.layers.TransformerEncoder(32, 2)(x)
    x = keras.layers.GlobalAveragePooling1D()(x)
    encoder = keras.Model(tokens, keras.layers.Dense(3)(x))
    tokens = keras.Input((None,), dtype="int32")
    x = keras_hub.layers.TokenAndPositionEmbedding(40, 16, 16)(tokens)
    x = keras_hub.layers.TransformerDecoder(32, 2)(x)
    decoder = keras.Model(tokens, keras.layers.Dense(40)(x))
    small = dict(**SMALL, num_layers=2, num_heads=2, max_sequence_length=16)
    return {
        "TransformerEncoder": encoder,
        "TransformerDecoder": decoder,
        "GPT2Backbone": keras_hub.models.GPT2Backbone(**small),
        "BertBackbone": keras_hub.models.BertBackbone(**small),
    }


def _hub_inputs(name: str):
    if "Backbone" not in name:
        return TOKENS
    inputs = {"token_ids": TOKENS, "padding_mask": TOKENS != 0}
    if name == "BertBackbone":
        inputs["segment_ids"] = np.zeros_like(TOKENS)
    return inputs


def _sequence(outputs):
    return _numpy(outputs["sequence_output"] if isinstance(outputs, dict) else outputs)


@jax_slow
def test_keras_hub_layers_and_backbones_convert():
    for name, model in _hub_models().items():
        model = user_blocks.randomized(model)
        new = keras_selfattn.convert(model)
        attention = _keras_attention(model)
        assert _keras_attention(new) == [], name
        assert len(new.conversion_report.converted) == len(attention), name
        inputs = _hub_inputs(name)
        real = slice(None) if name == "TransformerEncoder" else TOKENS != 0
        np.testing.assert_allclose(
            _sequence(new(inputs))[real],
            _sequence(model(inputs))[real],
            atol=ATOL,
            err_msg=name,
        )


@pytest.mark.slow
def test_converted_keras_hub_decoder_generates_what_the_original_computes():
    tokens = keras.Input((None,), dtype="int32")
    x = keras_hub.layers.TokenAndPositionEmbedding(40, 32, 16)(tokens)
    x = keras_hub.layers.TransformerDecoder(32, 2)(x)
    x = keras_hub.layers.TransformerDecoder(32, 2)(x)
    model = keras.Model(tokens, keras.layers.Dense(40)(x))
    model = user_blocks.randomized(model, scale=1.0)
    new = keras_selfattn.convert(model)
    assert all("causal=True" in line for line in new.conversion_report.converted)
    result = keras_selfattn.generate(new, PROMPTS, STEPS)
    tokens, lengths = reference.uncached(model, PROMPTS, STEPS)
    assert len(np.unique(tokens)) > 3, "a test of varied tokens"
    np.testing.assert_array_equal(result.tokens, tokens)
    np.testing.assert_array_equal(result.lengths, lengths)


def _gpt2_causal_lm():
    backbone = keras_hub.models.GPT2Backbone(
        **SMALL, num_layers=2, num_heads=2, max_sequence_length=32
    )
    lm = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
    return user_blocks.randomized(lm, scale=1.0)


def _keras_hub_greedy(lm, prompts, steps) -> np.ndarray:
    """keras-hub's own `generate(sampler="greedy")`: each row's new tokens."""
    width = max(len(prompt) for prompt in prompts) + steps
    ids = np.zeros((len(prompts), width), "int32")
    padding = np.zeros((len(prompts), width), bool)
    for row, prompt in enumerate(prompts):
        ids[row, : len(prompt)], padding[row, : len(prompt)] = prompt, True
    lm.compile(sampler="greedy")
    out = lm.generate(
        {"token_ids": ids, "padding_mask": padding},
        max_length=width,
        stop_token_ids=None,
    )["token_ids"]
    return np.stack(
        [
            out[row, len(prompt) : len(prompt) + steps]
            for row, prompt in enumerate(prompts)
        ]
    )


@pytest.mark.slow_on("tensorflow", "jax", "keras-hub's generate compiles its loop")
def test_converted_gpt2_causal_lm_generates_keras_hub_s_greedy_tokens():
    lm = _gpt2_causal_lm()
    tokens_model = keras_selfattn.convert_causal_lm(lm)
    assert len(tokens_model.conversion_report.converted) == 2
    assert _keras_attention(tokens_model) == []
    expected = _keras_hub_greedy(lm, PROMPTS, STEPS)
    assert len(np.unique(expected)) > 2, "a test of varied tokens"
    result = keras_selfattn.generate(tokens_model, PROMPTS, STEPS)
    np.testing.assert_array_equal(result.tokens, expected)


def test_convert_causal_lm_refuses_other_inputs_in_one_line():
    x = keras.Input((None,), dtype="int32", name="ids")
    model = keras.Model(x, keras.layers.Embedding(10, 4)(x))
    with pytest.raises(ValueError, match=r"Received: inputs=\['ids'\]") as error:
        keras_selfattn.convert_causal_lm(model)
    assert "\n" not in str(error.value)


@pytest.mark.slow
def test_converted_gpt2_causal_lm_exports_its_generator(tmp_path):
    """Each export's own check runs it in a fresh process of its runtime
    against `generate`; the ONNX file, run here, must return keras-hub's
    greedy tokens."""
    if keras.backend.backend() != "tensorflow":
        pytest.skip("one export per format, from TensorFlow's slow suite")
    import onnxruntime

    from keras_selfattn.export import export_generator

    lm = _gpt2_causal_lm()
    tokens_model = keras_selfattn.convert_causal_lm(lm)
    export_generator(
        tokens_model, tmp_path / "serving", "saved_model", max_length=16, name="gpt2"
    )
    export_generator(tokens_model, tmp_path / "gpt2.tflite", "litert", max_length=16)
    path = export_generator(tokens_model, tmp_path / "gpt2.onnx", "onnx", max_length=16)
    session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
    request = reference.generator_request(PROMPTS, STEPS, 40)
    tokens, _ = session.run(["tokens", "lengths"], request)
    np.testing.assert_array_equal(tokens, _keras_hub_greedy(lm, PROMPTS, STEPS))
