"""`keras_selfattn.generate` against independent references
(tests/generation_reference.py): the uniform stream and the sampler in
numpy, and generation by the uncached full forward of each row alone."""

from __future__ import annotations

import os

import keras
import numpy as np
import pytest

from keras_selfattn import SelfAttention, generate
from keras_selfattn.generation import arguments, random_stream, sampling
from keras_selfattn.generation.generate import generated
from tests import generation_reference as reference

VOCABULARY = 23
FEATURES = 16
# Mixed lengths: rows are aligned at their last position inside generate.
PROMPTS = [[3, 7, 1, 9, 4, 4, 2], [5], [8, 2, 6], [1, 1]]
STEPS = 6


def token_model(seed: int = 0) -> keras.Model:
    """Rotary, grouped key/value heads, a gate and a sliding window; logits
    spread wide enough that greedy tokens vary."""
    keras.utils.set_random_seed(seed)
    wide = keras.initializers.RandomNormal(stddev=1.0, seed=seed)
    tokens = keras.Input((None,), dtype="int32", name="tokens")
    h = keras.layers.Embedding(VOCABULARY, FEATURES, embeddings_initializer=wide)(
        tokens
    )
    a = SelfAttention(num_heads=2, causal=True, rope_max_wavelength=100, name="first")(
        h
    )
    h = keras.layers.LayerNormalization()(keras.layers.Add()([h, a]))
    a = SelfAttention(
        num_heads=4,
        num_key_value_heads=2,
        key_dim=4,
        causal=True,
        sliding_window=4,
        use_gate=True,
        rope_max_wavelength=100,
        output_dim=FEATURES,
        name="second",
    )(h)
    h = keras.layers.Add()([h, a])
    logits = keras.layers.Dense(VOCABULARY, kernel_initializer=wide, name="logits")(h)
    return keras.Model(tokens, logits)


# JAX compiles `generate` for the model's first call: 40 s of `make test` on
# 2 shared AVX2 cores, whichever test calls it first; the other suites
# generate in `make test`, JAX's slow suite too.
GENERATES_ON_JAX = pytest.mark.slow_on("jax", "generate compiled on first use")


@pytest.fixture(scope="module")
def model():
    return token_model()


# ------------------------------------------------------------ the stream
@pytest.mark.slow_on("jax", "tensorflow", "a sampler traced per shape: 12 s, 8 s")
def test_uniform_stream_equals_the_integer_reference():
    seeds, rows, steps = (
        (0, 1, -5, 2**31 - 1, -(2**31)),
        np.arange(5),
        (0, 1, 77, 2**31 - 2),
    )
    for seed in seeds:
        for step in steps:
            got = keras.ops.convert_to_numpy(
                random_stream.uniforms(
                    np.int32(seed), rows.astype("int32"), np.array([step], "int32")
                )
            )[:, 0]
            expected = [reference.uniform(seed, int(r), step) for r in rows]
            np.testing.assert_array_equal(got, np.array(expected, np.float32))


@pytest.mark.slow_on("jax", "a sampler compiled per shape: 7 s")
def test_uniform_stream_is_uniform_and_steps_independent():
    """Chi-square over 16 bins and the correlation of neighbouring steps,
    on 4096 draws (bounds far outside what chance gives)."""
    rows = np.arange(64, dtype="int32")
    draws = keras.ops.convert_to_numpy(
        random_stream.uniforms(np.int32(11), rows, np.arange(64, dtype="int32"))
    ).T  # (step, row)
    assert draws.min() >= 0 and draws.max() < 1
    counts = np.histogram(draws, bins=16, range=(0, 1))[0]
    expected = draws.size / 16
    chi_square = ((counts - expected) ** 2 / expected).sum()
    assert chi_square < 45, chi_square  # 15 degrees of freedom: p ~ 1e-4
    neighbours = np.corrcoef(draws[:-1].ravel(), draws[1:].ravel())[0, 1]
    assert abs(neighbours) < 0.06, neighbours
    rows_apart = np.corrcoef(draws[:, :-1].ravel(), draws[:, 1:].ravel())[0, 1]
    assert abs(rows_apart) < 0.06, rows_apart


# ------------------------------------------------------------ the sampler
@pytest.mark.parametrize(
    "controls",
    [
        {"temperature": 0.0},
        {"temperature": 1.0},
        {"temperature": 0.7, "top_k": 3},
        {"temperature": 1.3, "top_p": 0.6},
        {"temperature": 1.0, "top_k": 5, "top_p": 0.9},
        {"temperature": 2.0, "top_k": 1},
    ],
)
def test_sampler_equals_the_numpy_reference(controls):
    rng = np.random.default_rng(5)
    logits = (rng.normal(size=(64, VOCABULARY)) * 3).astype("float32")
    logits[0, 3] = logits[0, 5] = logits[0].max() + 1  # a tie: the first wins
    uniforms = rng.random(64).astype("float32")
    uniforms[1] = 0.0
    uniforms[2] = np.float32(1 - 2**-24)
    got = keras.ops.convert_to_numpy(
        sampling.next_token(
            logits,
            uniforms,
            np.float32(controls.get("temperature", 0.0)),
            np.int32(controls.get("top_k", 0)),
            np.float32(controls.get("top_p", 1.0)),
        )
    )
    expected = [
        reference.next_token(row, u, **controls)
        for row, u in zip(logits, uniforms, strict=True)
    ]
    np.testing.assert_array_equal(got, expected)


def test_sampler_picks_only_kept_tokens_at_their_frequencies():
    """Over 4000 rows: top-k 2 picks only the two largest logits, at about
    their renormalized probabilities."""
    logits = np.tile(np.array([[0.0, 2.0, 1.0, -1.0]], "float32"), (4000, 1))
    uniforms = keras.ops.convert_to_numpy(
        random_stream.uniforms(
            np.int32(3), np.arange(4000, dtype="int32"), np.zeros(1, "int32")
        )
    )[:, 0]
    picked = keras.ops.convert_to_numpy(
        sampling.next_token(
            logits, uniforms, np.float32(1.0), np.int32(2), np.float32(1.0)
        )
    )
    assert set(np.unique(picked)) == {1, 2}
    share = (picked == 1).mean()
    assert abs(share - np.exp(2) / (np.exp(2) + np.exp(1))) < 0.03, share


# ------------------------------------------------------------ generation
@GENERATES_ON_JAX
def test_greedy_equals_the_uncached_forward(model):
    result = generate(model, PROMPTS, STEPS)
    tokens, lengths = reference.uncached(model, PROMPTS, STEPS)
    np.testing.assert_array_equal(result.tokens, tokens)
    np.testing.assert_array_equal(result.lengths, lengths)
    assert len({tuple(row) for row in tokens}) > 1  # rows differ: a real check


@pytest.mark.slow_on("jax", "tensorflow", "a second compile of generate: 10 s on TF")
def test_one_prompt_equals_the_uncached_forward(model):
    """A batch of one: broadcasting against a batch of 1 cannot restore a
    static batch that a step lost, which a loop variable must keep."""
    result = generate(model, PROMPTS[:1], STEPS)
    tokens, lengths = reference.uncached(model, PROMPTS[:1], STEPS)
    np.testing.assert_array_equal(result.tokens, tokens)
    np.testing.assert_array_equal(result.lengths, lengths)


@GENERATES_ON_JAX
@pytest.mark.slow_on("tensorflow", "traces the sampling loop: 12 s")
def test_seeded_sampling_equals_the_uncached_forward(model):
    controls = {"temperature": 1.5, "top_k": 8, "top_p": 0.95}
    first = generate(model, PROMPTS, STEPS, seed=7, **controls)
    again = generate(model, PROMPTS, STEPS, seed=7, **controls)
    other = generate(model, PROMPTS, STEPS, seed=8, **controls)
    tokens, _ = reference.uncached(model, PROMPTS, STEPS, seed=7, **controls)
    np.testing.assert_array_equal(first.tokens, tokens)
    np.testing.assert_array_equal(again.tokens, first.tokens)
    assert (other.tokens != first.tokens).any()


@GENERATES_ON_JAX
@pytest.mark.slow_on("tensorflow", "traces the sampling loop: 12 s")
def test_greedy_requests_on_the_sampling_loop_equal_the_uncached_forward(model):
    """`greedy_loop=False`, as an exported generator's check runs it (not
    compiled): a greedy request runs the loop that samples, which must
    choose the greedy tokens."""
    read = arguments.read_structure(model)
    request = arguments.request(read, PROMPTS, STEPS)
    result = generated(read, request, jit=False, greedy_loop=False)
    tokens, lengths = reference.uncached(model, PROMPTS, STEPS)
    np.testing.assert_array_equal(result.tokens, tokens)
    np.testing.assert_array_equal(result.lengths, lengths)


@GENERATES_ON_JAX
def test_end_token_ends_each_row(model):
    """A row stops after its end token (counted); later slots hold -1."""
    greedy = generate(model, PROMPTS, STEPS).tokens
    end = int(greedy[0, 2])
    result = generate(model, PROMPTS, STEPS, end_token=end)
    tokens, lengths = reference.uncached(model, PROMPTS, STEPS, end_token=end)
    np.testing.assert_array_equal(result.lengths, lengths)
    np.testing.assert_array_equal(result.tokens, tokens)
    assert (
        result.lengths[0] <= 3 and (result.tokens[0, result.lengths[0] :] == -1).all()
    )
    assert [len(row) for row in result.rows()] == list(lengths)


@GENERATES_ON_JAX
def test_padded_array_with_lengths_equals_the_list(model):
    padded = np.zeros((len(PROMPTS), 7), "int32")
    for row, prompt in enumerate(PROMPTS):
        padded[row, : len(prompt)] = prompt
    lengths = [len(p) for p in PROMPTS]
    from_array = generate(model, padded, STEPS, prompt_lengths=lengths)
    np.testing.assert_array_equal(
        from_array.tokens, generate(model, PROMPTS, STEPS).tokens
    )


@pytest.mark.slow_on("jax", "tensorflow", "a second model compiled: 8 s on TF")
def test_non_finite_states_at_padded_positions_change_no_token(model):
    """Shorter prompts are padded with token 0 on the left. A model whose
    embedding of token 0 is NaN puts NaN in every layer's cache slots there;
    those slots must change no token. Token 0 itself is never chosen: its
    logit is pushed down, in both models."""
    original = model.get_weights()
    logits = model.get_layer("logits")
    kernel, bias = logits.get_weights()
    logits.set_weights([kernel, np.where(np.arange(VOCABULARY) == 0, -1e4, bias)])
    try:
        expected = generate(model, PROMPTS, STEPS).tokens
        poisoned = token_model()
        poisoned.set_weights(model.get_weights())
    finally:
        model.set_weights(original)
    embedding = next(
        layer for layer in poisoned.layers if isinstance(layer, keras.layers.Embedding)
    )
    (table,) = embedding.get_weights()
    table[0] = np.nan
    embedding.set_weights([table])
    assert (expected > 0).all()
    np.testing.assert_array_equal(generate(poisoned, PROMPTS, STEPS).tokens, expected)


@pytest.mark.slow_on("jax", "a second model compiled op by op")
def test_value_model_feeds_its_output_back():
    """A causal forecaster: each new position is the last output."""
    keras.utils.set_random_seed(2)
    x = keras.Input((None, 3), name="series")
    h = SelfAttention(num_heads=1, key_dim=4, causal=True, output_dim=3)(x)
    model = keras.Model(x, keras.layers.Add()([x, h]))
    rng = np.random.default_rng(0)
    prompts = [
        rng.normal(size=(4, 3)).astype("float32"),
        rng.normal(size=(2, 3)).astype("float32"),
    ]
    result = generate(model, prompts, 5)
    expected = reference.uncached_values(model, prompts, 5)
    np.testing.assert_allclose(result.tokens, expected, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(result.lengths, [5, 5])


@pytest.mark.parametrize(
    ("arguments", "named"),
    [
        ({"max_new_tokens": 6, "max_length": 6}, "prompts"),
        ({"max_new_tokens": 6, "max_length": 10}, "max_new_tokens"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"max_new_tokens": 2, "temperature": 1.0, "top_k": 0}, "top_k"),
        ({"max_new_tokens": 2, "temperature": 1.0, "top_p": 0.0}, "top_p"),
        ({"max_new_tokens": 2, "temperature": 1.0, "top_p": 1.5}, "top_p"),
        ({"max_new_tokens": 2, "temperature": -1.0}, "temperature"),
        ({"max_new_tokens": 2, "temperature": float("nan")}, "temperature"),
        ({"max_new_tokens": 2, "end_token": VOCABULARY}, "end_token"),
        ({"max_new_tokens": 2, "top_k": 3}, "top_k"),
        ({"max_new_tokens": 2, "prompt_lengths": [1, 2, 0, 1]}, "prompt_lengths"),
        ({"max_new_tokens": 2, "seed": 2**40}, "seed"),
    ],
)
def test_bad_arguments_are_named(model, arguments, named):
    prompts = np.ones((4, 7), "int32") if "prompt_lengths" in arguments else PROMPTS
    with pytest.raises(ValueError, match=f"`{named}`"):
        generate(model, prompts, **arguments)


def test_ids_outside_the_vocabulary_are_refused(model):
    with pytest.raises(
        ValueError, match=rf"`prompts` must hold ids in \[0, {VOCABULARY}\)"
    ):
        generate(model, [[1, VOCABULARY]], 2)


@pytest.mark.parametrize("kind", ["not causal", "padding mask"])
def test_models_that_cannot_decode_are_refused(kind):
    tokens = keras.Input((None,), dtype="int32", name="tokens")
    h = keras.layers.Embedding(10, 8, mask_zero=kind == "padding mask")(tokens)
    h = SelfAttention(num_heads=1, causal=kind != "not causal")(h)
    model = keras.Model(tokens, keras.layers.Dense(10)(h))
    with pytest.raises(ValueError, match="Cannot generate with model"):
        generate(model, [[1, 2]], 2)


# The formats each backend's slow suite exports a generator in: the writer
# is the same for all three, so each format once and ONNX on both.
GENERATOR_FORMATS = {"jax": ("saved_model", "onnx"), "torch": ("onnx", "litert")}


@pytest.mark.slow
@pytest.mark.parametrize("export_format", ["saved_model", "onnx", "litert"])
def test_generator_exports_from_jax_and_torch(
    model, export_format, tmp_path, monkeypatch
):
    """Off TensorFlow a TensorFlow process writes the generator from the
    model's .keras file; the exporter's own check runs it in its runtime
    against this backend's `generate` (8 prompts, greedy and seeded), whose
    references this process computes once, while that process writes. The
    ONNX file, run here, also equals the uncached reference."""
    backend = keras.backend.backend()
    if backend == "tensorflow":
        pytest.skip("TensorFlow's own generators: tests/test_export_generator.py")
    if export_format not in GENERATOR_FORMATS[backend]:
        pytest.skip(f"{export_format} from {backend}: the other backend's suite")
    import psutil

    from keras_selfattn.export import export_generator, generator
    from keras_selfattn.export.generator import _writer, check

    computed = []
    references = check.references

    def recorded(*args):
        children = psutil.Process().children(recursive=True)
        computed.append(any(_writer.WORKER in c.cmdline() for c in children))
        return references(*args)

    monkeypatch.setattr(generator, "references", recorded)
    monkeypatch.setattr(check, "references", recorded)
    options = {"name": "lm"} if export_format == "saved_model" else {}
    suffix = {"saved_model": "", "onnx": ".onnx", "litert": ".tflite"}
    path = tmp_path / f"lm{suffix[export_format]}"
    written = export_generator(model, path, export_format, max_length=16, **options)
    assert computed == [True]
    if export_format != "onnx":
        assert os.path.isdir(written) or os.path.isfile(written)
        return
    import onnxruntime

    session = onnxruntime.InferenceSession(written, providers=["CPUExecutionProvider"])
    controls = {"temperature": 1.5, "top_k": 8, "top_p": 0.95, "seed": 7}
    request = reference.generator_request(PROMPTS, STEPS, VOCABULARY, controls)
    tokens, lengths = session.run(["tokens", "lengths"], request)
    expected, expected_lengths = reference.uncached(model, PROMPTS, STEPS, **controls)
    np.testing.assert_array_equal(tokens, expected)
    np.testing.assert_array_equal(lengths, expected_lengths)
