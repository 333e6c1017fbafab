"""Decoder models as users write them decode right (issue 44): attention
inside subclassed blocks, nested Sequential and subclassed models, learned
absolute positions (keras-hub's and keras_selfattn's), each compared with
generation by the uncached full forward of every row alone
(tests/generation_reference.py), and the position-mixing models that
cannot decode refused by every decoding API, in one line, nothing written.
"""

from __future__ import annotations

import os

import keras
import numpy as np
import pytest

import keras_selfattn
from keras_selfattn import SelfAttention, generate
from keras_selfattn.export import export_decode_step, export_generator
from keras_selfattn.export.decode_step.graph import build_decode_step
from keras_selfattn.generation import decode_check
from tests import decoder_zoo
from tests import generation_reference as reference

PROMPTS = [[3, 7, 1, 9, 4, 4, 2], [5], [8, 2, 6], [1, 1]]
STEPS = 6
_MODELS: dict = {}


def _model(kind: str) -> keras.Model:
    if kind not in _MODELS:
        _MODELS[kind] = decoder_zoo.decoder(kind)
    return _MODELS[kind]


# Generation is eager here, a few milliseconds a step on PyTorch and tens on
# TensorFlow and JAX (JAX compiles each new shape): PyTorch's fast suite
# decodes every kind; TensorFlow's and JAX's slow suites two kinds each.
_SLOW_KINDS = {
    "tensorflow": ("hub_positions", "subclassed"),
    "jax": ("blocks_rope", "hub_blocks"),
}


def _kind(kind: str):
    """`kind` as a parameter: fast on PyTorch, slow where `_SLOW_KINDS`
    names it, skipped elsewhere (another backend decodes it)."""
    backend = keras.backend.backend()
    if backend == "torch":
        return kind
    if kind in _SLOW_KINDS[backend]:
        return pytest.param(kind, marks=pytest.mark.slow)
    return pytest.param(
        kind, marks=pytest.mark.skip(reason=f"decoded in the {_where(kind)}")
    )


def _where(kind: str) -> str:
    suites = [f"{b} slow suite" for b, kinds in _SLOW_KINDS.items() if kind in kinds]
    return " and ".join(["torch fast suite", *suites])


@pytest.mark.parametrize("kind", [_kind(kind) for kind in decoder_zoo.KINDS])
def test_greedy_and_seeded_tokens_equal_the_uncached_loop(kind):
    """Prompts of mixed lengths; the uniform stream is the numpy
    reference's, so the same seed gives these tokens on every backend."""
    model = _model(kind)
    result = generate(model, PROMPTS, STEPS)
    tokens, lengths = reference.uncached(model, PROMPTS, STEPS)
    np.testing.assert_array_equal(result.tokens, tokens)
    np.testing.assert_array_equal(result.lengths, lengths)
    assert len({tuple(row) for row in tokens}) > 1  # rows differ: a real check
    controls = {"temperature": 1.5, "top_k": 8, "top_p": 0.95}
    sampled = generate(model, PROMPTS, STEPS, seed=7, **controls)
    tokens, _ = reference.uncached(model, PROMPTS, STEPS, seed=7, **controls)
    np.testing.assert_array_equal(sampled.tokens, tokens)


# Every variant on PyTorch, one each on TensorFlow (30 to 50 s a variant)
# and JAX.
_VARIANTS = {"tensorflow": ("int8",), "jax": ("mixed_bfloat16",)}


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["int8", "lora", "mixed_bfloat16"])
def test_quantized_lora_and_mixed_precision_blocks_decode(variant):
    backend = keras.backend.backend()
    if variant not in _VARIANTS.get(backend, (variant,)):
        pytest.skip(f"{variant}: decoded by PyTorch's slow suite")
    if variant == "mixed_bfloat16":
        keras.config.set_dtype_policy(variant)
        try:
            model = decoder_zoo.decoder("hub_blocks", seed=1)
        finally:
            keras.config.set_dtype_policy("float32")
    else:
        model = decoder_zoo.decoder("hub_blocks", seed=1)
    if variant == "int8":
        model.quantize("int8")
    elif variant == "lora":
        for layer in model.layers:
            if isinstance(layer, decoder_zoo.TransformerBlock):
                layer.att.enable_lora(2)
    result = generate(model, PROMPTS, STEPS)
    tokens, _ = reference.uncached(model, PROMPTS, STEPS)
    np.testing.assert_array_equal(result.tokens, tokens)


def test_own_position_embedding_equals_its_table():
    """keras_selfattn.PositionEmbedding against numpy: rows of its table."""
    layer = keras_selfattn.PositionEmbedding(sequence_length=10)
    x = np.zeros((2, 4, 6), "float32")
    out = keras.ops.convert_to_numpy(layer(x, start_index=3))
    table = keras.ops.convert_to_numpy(layer.position_embeddings)
    np.testing.assert_array_equal(out, np.broadcast_to(table[3:7], (2, 4, 6)))
    rows = np.array([[0, 1, 2, 3], [5, 6, 7, 8]])
    out = keras.ops.convert_to_numpy(layer(x, positions=rows))
    np.testing.assert_array_equal(out, table[rows])


@pytest.mark.slow_on("jax", "tensorflow", "JAX compiles each shape anew; 6 s on TF")
def test_own_token_and_position_embedding_decodes_and_saves(tmp_path):
    keras.utils.set_random_seed(3)
    tokens = keras.Input((None,), dtype="int32", name="tokens")
    h = keras_selfattn.TokenAndPositionEmbedding(
        decoder_zoo.VOCABULARY, 32, 16, embeddings_initializer="random_normal"
    )(tokens)
    h = decoder_zoo.TransformerBlock(16, 2, 32)(h)
    model = keras.Model(tokens, keras.layers.Dense(decoder_zoo.VOCABULARY)(h))
    path = str(tmp_path / "gpt.keras")
    model.save(path)
    restored = keras.saving.load_model(path)
    result = generate(restored, PROMPTS, STEPS)
    tokens, _ = reference.uncached(model, PROMPTS, STEPS)
    np.testing.assert_array_equal(result.tokens, tokens)


# ------------------------------------------------------------ refusals
def _refused(call, *names):
    with pytest.raises(ValueError) as info:
        call()
    message = str(info.value)
    assert "\n" not in message
    for name in names:
        assert name in message, message
    return message


@pytest.mark.slow_on("jax", "every decoding API on a model compiled op by op: 11 s")
def test_arange_positions_are_refused_by_every_api(tmp_path):
    model = decoder_zoo.decoder("arange")
    names = ("(ArangePositions) mixes positions",)
    names += ("TokenAndPositionEmbedding",)
    _refused(lambda: generate(model, PROMPTS, STEPS), *names)
    step = tmp_path / "step.onnx"
    _refused(lambda: export_decode_step(model, step, "onnx", max_length=12), *names)
    lm = tmp_path / "lm.onnx"
    _refused(lambda: export_generator(model, lm, "onnx", max_length=12), *names)
    assert os.listdir(tmp_path) == []


@pytest.mark.slow_on("tensorflow", "jax", "eager generation; PyTorch's is fast")
def test_the_check_is_what_catches_a_position_mixing_model():
    """A Conv1D over time decodes without error, into wrong tokens: the
    check refuses it; `check=False` (the opt-out) returns those tokens."""
    keras.utils.set_random_seed(0)
    tokens = keras.Input((None,), dtype="int32", name="tokens")
    h = keras.layers.Embedding(decoder_zoo.VOCABULARY, 16)(tokens)
    h = decoder_zoo.TransformerBlock(16, 2, 32)(h)
    h = keras.layers.Conv1D(16, 3, padding="same", name="mixes")(h)
    model = keras.Model(tokens, keras.layers.Dense(decoder_zoo.VOCABULARY)(h))
    # A bad argument is named before the model runs (the check would refuse).
    with pytest.raises(ValueError, match="`max_new_tokens`"):
        generate(model, PROMPTS, 0)
    _refused(lambda: generate(model, PROMPTS, STEPS), "'mixes' (Conv1D)")
    unchecked = generate(model, PROMPTS, STEPS, check=False).tokens
    tokens, _ = reference.uncached(model, PROMPTS, STEPS)
    assert (unchecked != tokens).any()
    # The exporters' check=False waives it the same way (decode_check.waived).
    _refused(lambda: build_decode_step(model, 6), "'mixes' (Conv1D)")
    with decode_check.waived():
        assert len(build_decode_step(model, 6).layers) == 1


def test_a_layer_called_twice_or_with_an_attention_bias_is_refused():
    shared = SelfAttention(num_heads=2, causal=True)
    tokens = keras.Input((None,), dtype="int32", name="tokens")
    h = keras.layers.Embedding(10, 8)(tokens)
    twice = keras.Model(tokens, keras.layers.Dense(10)(shared(shared(h))))
    _refused(lambda: generate(twice, [[1, 2]], 2), "called more than once")

    class Biased(keras.layers.Layer):
        def __init__(self):
            super().__init__()
            self.att = SelfAttention(num_heads=2, causal=True)

        def call(self, x):
            return self.att(x, attention_bias=keras.ops.zeros((1, 1, 1, 1)))

    biased = keras.Model(tokens, keras.layers.Dense(10)(Biased()(h)))
    _refused(lambda: generate(biased, [[1, 2]], 2), "['attention_bias']")


@pytest.mark.slow_on("tensorflow", "jax", "eager generation; PyTorch's is fast")
def test_same_named_layers_in_blocks_get_their_path_as_cache_names():
    keras.utils.set_random_seed(0)

    class Block(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.att = SelfAttention(num_heads=2, causal=True, name="att")

        def call(self, x):
            return x + self.att(x)

    tokens = keras.Input((None,), dtype="int32", name="tokens")
    h = keras.layers.Embedding(10, 8)(tokens)
    h = Block(name="block_a")(Block(name="block_b")(h))
    model = keras.Model(tokens, keras.layers.Dense(10, name="logits")(h))
    step = build_decode_step(model, 6)
    assert step.cache_names == ("cache_block_b_att", "cache_block_a_att")
    result = generate(model, PROMPTS, 3)
    tokens, _ = reference.uncached(model, PROMPTS, 3)
    np.testing.assert_array_equal(result.tokens, tokens)


# ------------------------------------------------------------ exports
# TensorFlow's slow suite exports a nested model's generator to ONNX (and
# runs it here); the formats in every backend's slow suite below.
FAST_EXPORTS = {"tensorflow": ("onnx",), "jax": (), "torch": ()}
SUFFIX = {"saved_model": "", "onnx": ".onnx", "litert": ".tflite", "torch": ".pt2"}


def _export_and_run(model, export_format, tmp_path):
    """Exports the generator (its own check runs it in a fresh process of
    its runtime against `generate`); the ONNX file, run here, must also
    equal the uncached reference."""
    options = {"name": "lm"} if export_format == "saved_model" else {}
    path = tmp_path / f"lm{SUFFIX[export_format]}"
    written = export_generator(model, path, export_format, max_length=16, **options)
    assert os.path.exists(written)
    if export_format != "onnx":
        return
    import onnxruntime

    session = onnxruntime.InferenceSession(written, providers=["CPUExecutionProvider"])
    controls = {"temperature": 1.5, "top_k": 8, "top_p": 0.95, "seed": 7}
    request = reference.generator_request(
        PROMPTS, STEPS, decoder_zoo.VOCABULARY, controls
    )
    tokens, _ = session.run(["tokens", "lengths"], request)
    expected, _ = reference.uncached(model, PROMPTS, STEPS, **controls)
    np.testing.assert_array_equal(tokens, expected)


@pytest.mark.slow
def test_a_nested_model_s_generator_exports(tmp_path):
    backend = keras.backend.backend()
    if not FAST_EXPORTS[backend]:
        pytest.skip(f"{backend}: exported in TensorFlow's slow suite")
    _export_and_run(_model("hub_blocks"), "onnx", tmp_path)


# Each backend's slow suite exports one kind in one format (a minute or two
# each): every kind and every format once, each from another backend.
GENERATOR_KINDS = ("hub_positions", "blocks_rope", "subclassed")
GENERATOR_FORMATS = ("saved_model", "onnx", "litert")
GENERATOR_PAIRS = {
    "tensorflow": ("subclassed", "litert"),
    "jax": ("blocks_rope", "saved_model"),
    "torch": ("hub_positions", "onnx"),
}


@pytest.mark.slow
@pytest.mark.parametrize("export_format", GENERATOR_FORMATS)
@pytest.mark.parametrize("kind", GENERATOR_KINDS)
def test_nested_generators_in_every_format(kind, export_format, tmp_path):
    if GENERATOR_PAIRS[keras.backend.backend()] != (kind, export_format):
        pytest.skip("exported by another backend's pairing")
    _export_and_run(_model(kind), export_format, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["hub_blocks", "sequential_blocks", "subclassed"])
def test_nested_decoding_steps_export(kind, tmp_path):
    """The step's own check decodes whole sequences through the export in
    a fresh runtime process against Keras's cached and full forward. One
    kind per backend (a minute each)."""
    exported = {"tensorflow": "sequential_blocks", "jax": "hub_blocks"}
    if exported.get(keras.backend.backend(), "subclassed") != kind:
        pytest.skip("exported by another backend's slow suite")
    # On torch, .pt2: Keras's torch ONNX route cannot trace LayerNormalization.
    formats = {"tensorflow": "saved_model", "jax": "onnx", "torch": "torch"}
    export_format = formats[keras.backend.backend()]
    options = {"name": "step"} if export_format == "saved_model" else {}
    path = tmp_path / f"step{SUFFIX[export_format]}"
    written = export_decode_step(
        _model(kind), path, export_format, max_length=8, **options
    )
    assert os.path.exists(written)


@pytest.mark.tensorflow_only("the CLI's exports are tested on TensorFlow")
@pytest.mark.parametrize("command", [["--decode-step"], ["--generate"]])
def test_the_command_line_refuses_arange_positions(command, tmp_path, capsys):
    from keras_selfattn_cli import main

    decoder_zoo.decoder("arange").save(tmp_path / "lm.keras")
    out = tmp_path / "out.onnx"
    argv = ["export", tmp_path / "lm.keras", *command, "--max-length", "8"]
    status = main([str(a) for a in [*argv, "--onnx", out]])
    err = capsys.readouterr().err
    assert status == 1
    assert len(err.splitlines()) == 1, err
    assert "(ArangePositions) mixes positions" in err
    assert not out.exists()
