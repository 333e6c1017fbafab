"""Exported generators (`export_generator`): the SavedModel (its signature
"generate", as TF Serving calls it), the ONNX file (the loop as an ONNX
`Loop`) and the LiteRT file (its WHILE op) return the tokens of the uncached
reference
(tests/generation_reference.py) for prompts of mixed lengths, greedy and
seeded; bad arguments are InvalidArgument naming them in the SavedModel and
an empty result in ONNX Runtime and LiteRT, which cannot raise."""

from __future__ import annotations

import numpy as np
import pytest

from keras_selfattn.export.generator import export_generator
from tests import generation_reference as reference
from tests.test_generation import PROMPTS, VOCABULARY, token_model

pytestmark = pytest.mark.tensorflow_only("the generator's loop in a TensorFlow graph")
# Two exports and a fresh-process check (about a minute): the slow suite.
exports = pytest.mark.slow
MAX_LENGTH = 24
STEPS = 8


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """The model, its SavedModel generator (through the exporter's own
    check, in a fresh process) and its ONNX generator (unchecked here: the
    tests below run it)."""
    model = token_model()
    root = tmp_path_factory.mktemp("generator")
    saved = export_generator(
        model,
        root / "serving",
        "saved_model",
        max_length=MAX_LENGTH,
        name="lm",
        warmup=True,
    )
    onnx_path = export_generator(
        model, root / "lm.onnx", "onnx", max_length=MAX_LENGTH, check=False
    )
    litert_path = export_generator(
        model, root / "lm.tflite", "litert", max_length=MAX_LENGTH, check=False
    )
    return model, saved, onnx_path, litert_path


def _request(controls=None, steps=STEPS):
    padded = np.zeros((len(PROMPTS), max(map(len, PROMPTS))), np.int32)
    for row, prompt in enumerate(PROMPTS):
        padded[row, : len(prompt)] = prompt
    values = {
        "temperature": 0.0,
        "top_k": VOCABULARY,
        "top_p": 1.0,
        "seed": 0,
        "end_token": -1,
    }
    values.update(controls or {})
    dtypes = {"temperature": "float32", "top_p": "float32"}
    return {
        "prompt_tokens": padded,
        "prompt_lengths": np.array([len(p) for p in PROMPTS], np.int32),
        "max_new_tokens": np.array(steps, np.int32),
        **{k: np.array(v, dtypes.get(k, "int32")) for k, v in values.items()},
    }


@pytest.fixture(scope="module")
def runners(exported):
    import onnxruntime
    import tensorflow as tf
    from ai_edge_litert.interpreter import Interpreter

    _, saved, onnx_path, litert_path = exported
    runner = Interpreter(model_path=str(litert_path)).get_signature_runner()
    signature = tf.saved_model.load(saved).signatures["generate"]
    session = onnxruntime.InferenceSession(
        onnx_path, providers=["CPUExecutionProvider"]
    )

    def saved_model(request):
        out = signature(**{k: tf.constant(v) for k, v in request.items()})
        return out["tokens"].numpy(), out["lengths"].numpy()

    def onnx(request):
        return tuple(session.run(["tokens", "lengths"], request))

    def litert(request):
        out = runner(**request)  # Keras's LiteRT export names outputs output_N
        return out["output_0"], out["output_1"]

    return {"saved_model": saved_model, "onnx": onnx, "litert": litert}


CASES = {
    "greedy": {},
    "sampled": {"temperature": 1.2, "top_k": 9, "top_p": 0.9, "seed": 99},
}


@exports
@pytest.mark.parametrize("runtime", ["saved_model", "onnx", "litert"])
@pytest.mark.parametrize("case", list(CASES))
def test_generator_equals_the_uncached_reference(exported, runners, runtime, case):
    model = exported[0]
    controls = CASES[case]
    tokens, lengths = runners[runtime](_request(controls))
    named = {k: v for k, v in controls.items() if k != "seed"}
    want, want_lengths = reference.uncached(
        model, PROMPTS, STEPS, seed=controls.get("seed", 0), **named
    )
    np.testing.assert_array_equal(tokens, want)
    np.testing.assert_array_equal(lengths, want_lengths)


@exports
@pytest.mark.parametrize("runtime", ["saved_model", "onnx", "litert"])
def test_end_token_and_fewer_tokens(exported, runners, runtime):
    model = exported[0]
    greedy, _ = runners[runtime](_request())
    end = int(greedy[1, 1])
    tokens, lengths = runners[runtime](_request({"end_token": end}, steps=5))
    want, want_lengths = reference.uncached(model, PROMPTS, 5, end_token=end)
    assert tokens.shape == (len(PROMPTS), 5)
    np.testing.assert_array_equal(tokens, want)
    np.testing.assert_array_equal(lengths, want_lengths)
    ended = list(greedy[1]).index(end) + 1  # the end token counts
    assert lengths[1] == ended and (tokens[1, ended:] == -1).all()


BAD = {
    "top_k": {"top_k": 0},
    "top_p": {"top_p": 1.5},
    "temperature": {"temperature": float("nan")},
    "end_token": {"end_token": VOCABULARY},
    "max_new_tokens": {"max_new_tokens": MAX_LENGTH},
    "prompt_lengths": {"prompt_lengths": np.array([0, 1, 1, 1], np.int32)},
    "prompt_tokens": {"prompt_tokens": np.full((4, 7), VOCABULARY, np.int32)},
}


@exports
@pytest.mark.parametrize("argument", list(BAD))
def test_bad_arguments_in_the_saved_model_name_themselves(runners, argument):
    import tensorflow as tf

    request = _request()
    changes = BAD[argument]
    for name, value in changes.items():
        request[name] = np.asarray(value, request[name].dtype)
    with pytest.raises(tf.errors.InvalidArgumentError, match=f"`{argument}`"):
        runners["saved_model"](request)


@exports
@pytest.mark.parametrize("runtime", ["onnx", "litert"])
@pytest.mark.parametrize("argument", list(BAD))
def test_bad_arguments_elsewhere_return_nothing_generated(runners, runtime, argument):
    request = _request()
    for name, value in BAD[argument].items():
        request[name] = np.asarray(value, request[name].dtype)
    tokens, lengths = runners[runtime](request)
    assert (lengths == 0).all() and (tokens == -1).all()


@exports
def test_the_saved_model_has_a_served_layout_and_warmup(exported):
    import os

    from keras_selfattn.serving import layout

    _, saved, _, _ = exported
    assert os.path.isfile(os.path.join(saved, layout.WARMUP_PATH))
    assert os.path.isfile(
        os.path.join(os.path.dirname(os.path.dirname(saved)), "models.config")
    )


def test_other_formats_are_refused_in_one_line(tmp_path):
    model = token_model()
    with pytest.raises(ValueError, match="export_decode_step") as caught:
        export_generator(model, tmp_path / "lm.xml", "openvino", max_length=8)
    assert "\n" not in str(caught.value)


@exports
def test_xla_compiled_saved_model_generator_equals_generate(tmp_path):
    """`jit_compile=True`: the SavedModel's loop compiled by XLA; its own
    check (a fresh TensorFlow process) found generate's tokens, and its
    bad arguments are still InvalidArgument."""
    import tensorflow as tf

    model = token_model()
    saved = export_generator(
        model,
        tmp_path,
        "saved_model",
        max_length=MAX_LENGTH,
        name="lm",
        jit_compile=True,
    )
    signature = tf.saved_model.load(saved).signatures["generate"]
    request = {k: tf.constant(v) for k, v in _request(CASES["sampled"]).items()}
    out = signature(**request)
    want, lengths = reference.uncached(
        model, PROMPTS, STEPS, seed=99, temperature=1.2, top_k=9, top_p=0.9
    )
    np.testing.assert_array_equal(out["tokens"].numpy(), want)
    np.testing.assert_array_equal(out["lengths"].numpy(), lengths)
    request["top_k"] = tf.constant(0, tf.int32)
    with pytest.raises(tf.errors.InvalidArgumentError, match="`top_k`"):
        signature(**request)


def test_jit_compile_is_for_the_saved_model_only(tmp_path):
    with pytest.raises(ValueError, match="jit_compile"):
        export_generator(
            token_model(), tmp_path / "lm.onnx", "onnx", max_length=8, jit_compile=True
        )
