"""Exported generators (`export_generator`): the SavedModel (its signature
"generate", as TF Serving calls it), the ONNX file (the loop as an ONNX
`Loop`) and the LiteRT file (its WHILE op) return the tokens of the uncached
reference
(tests/generation_reference.py) for prompts of mixed lengths, greedy and
seeded; bad arguments are InvalidArgument naming them in the SavedModel and
an empty result in ONNX Runtime and LiteRT, which cannot raise. The LiteRT
file's "prefill" and "decode" signatures, driven token by token, give the
reference's greedy tokens too."""

from __future__ import annotations

import numpy as np
import pytest

from keras_selfattn.export.generator import (
    PAIR_RUNTIME,
    export_generator,
    verify_generator,
)
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
    return reference.generator_request(PROMPTS, steps, VOCABULARY, controls)


@pytest.fixture(scope="module")
def runners(exported):
    import onnxruntime
    import tensorflow as tf
    from ai_edge_litert.interpreter import Interpreter

    _, saved, onnx_path, litert_path = exported
    runner = Interpreter(model_path=str(litert_path)).get_signature_runner("generate")
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
        out = runner(**request)
        return out["tokens"], out["lengths"]

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


@exports
def test_concurrent_requests_each_get_their_own_tokens(exported, runners):
    """Calls at once on one loaded signature, as TF Serving runs them: the
    loop writes each step into its caches' own buffers (InplaceUpdate), so
    a buffer shared between calls would mix their tokens."""
    import threading

    model = exported[0]
    greedy = _request()
    # The same prompts in reverse order: other keys at every cache slot.
    reversed_rows = {
        **greedy,
        "prompt_tokens": greedy["prompt_tokens"][::-1].copy(),
        "prompt_lengths": greedy["prompt_lengths"][::-1].copy(),
    }
    requests = [greedy, _request(CASES["sampled"]), reversed_rows]
    want = reference.uncached(model, PROMPTS, STEPS)[0]
    sampled = {k: v for k, v in CASES["sampled"].items() if k != "seed"}
    wants = [
        want,
        reference.uncached(model, PROMPTS, STEPS, seed=99, **sampled)[0],
        want[::-1],
    ]
    results, errors = {}, []

    def call(worker: int) -> None:
        try:
            for round_ in range(5):
                request = requests[(worker + round_) % 3]
                results[worker, round_] = runners["saved_model"](request)[0]
        except Exception as error:  # reported below, in the test's thread
            errors.append(error)

    threads = [threading.Thread(target=call, args=(w,)) for w in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert len(results) == 30
    for (worker, round_), tokens in results.items():
        np.testing.assert_array_equal(tokens, wants[(worker + round_) % 3])


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


# The token model's SelfAttention layers (tests/test_generation.py).
CACHES = ("cache_first", "cache_second")


@exports
def test_the_litert_file_has_generate_prefill_and_decode(exported):
    from ai_edge_litert.interpreter import Interpreter

    interpreter = Interpreter(model_path=str(exported[3]))
    signatures = interpreter.get_signature_list()
    assert set(signatures) == {"generate", "prefill", "decode"}
    assert set(signatures["generate"]["outputs"]) == {"tokens", "lengths"}
    for name, time in (("prefill", -1), ("decode", 1)):
        runner = interpreter.get_signature_runner(name)
        inputs = runner.get_input_details()
        assert set(inputs) == {"tokens", *CACHES, "cache_update_index"}
        assert list(inputs["tokens"]["shape_signature"]) == [-1, time]
        assert set(runner.get_output_details()) == {
            "logits",
            *(f"updated_{cache}" for cache in CACHES),
        }


@exports
def test_litert_prefill_then_decode_equals_the_uncached_reference(exported):
    """Each prompt through "prefill", then one "decode" call per new token
    (the argmax of the last logits, the caches fed back), as an app drives
    the pair; prompts of other lengths go in calls of their own."""
    from ai_edge_litert.interpreter import Interpreter

    model, _, _, litert_path = exported
    interpreter = Interpreter(model_path=str(litert_path))
    prefill = interpreter.get_signature_runner("prefill")
    decode = interpreter.get_signature_runner("decode")
    details = prefill.get_input_details()
    tokens = np.zeros((len(PROMPTS), STEPS), np.int32)
    for row, prompt in enumerate(PROMPTS):
        out = prefill(
            tokens=np.array([prompt], np.int32),
            cache_update_index=np.array(0, np.int32),
            **{
                name: np.zeros((1, *details[name]["shape_signature"][1:]), np.float32)
                for name in CACHES
            },
        )
        for step in range(STEPS):
            tokens[row, step] = np.argmax(out["logits"][0, -1])
            if step + 1 < STEPS:
                out = decode(
                    tokens=tokens[row : row + 1, step : step + 1],
                    cache_update_index=np.array(len(prompt) + step, np.int32),
                    **{name: out[f"updated_{name}"] for name in CACHES},
                )
    want, _ = reference.uncached(model, PROMPTS, STEPS)
    np.testing.assert_array_equal(tokens, want)


@exports
def test_the_litert_check_generates_through_prefill_and_decode(exported):
    """`verify_generator` (the exporter's check) runs the pair in a fresh
    LiteRT process: its greedy tokens are a row of the report."""
    model, _, _, litert_path = exported
    report = verify_generator(model, litert_path=litert_path, max_length=MAX_LENGTH)
    pair = [row for row in report.rows if row.runtime == PAIR_RUNTIME]
    assert len(pair) == 1 and pair[0].ok and pair[0].max_abs_err == 0.0


@exports
def test_a_large_litert_file_is_checked_on_the_builtin_kernels(exported, monkeypatch):
    """Past `XNNPACK_CHECK_MAX_BYTES`, the check's LiteRT process runs the
    file without XNNPACK (whose copies of the weights per subgraph would
    outgrow the export), one row a request (the builtin kernels keep a
    packed copy of the weights for several); the report says so, and the
    tokens still agree."""
    from keras_selfattn.export.formats import litert

    model, _, _, litert_path = exported
    monkeypatch.setattr(litert, "XNNPACK_CHECK_MAX_BYTES", 0)
    report = verify_generator(model, litert_path=litert_path, max_length=MAX_LENGTH)
    assert all(row.ok for row in report.rows) and len(report.rows) == 3
    assert {row.shape.split("x")[0] for row in report.rows} == {"1"}, report.table()
    assert any("LiteRT's builtin kernels, XNNPACK off" in n for n in report.notes)
    assert any("one row a request" in note for note in report.notes)
    monkeypatch.undo()
    report = verify_generator(model, litert_path=litert_path, max_length=MAX_LENGTH)
    assert not any("XNNPACK" in note for note in report.notes)
    shapes = [row.shape.split("x")[0] for row in report.rows]
    assert shapes == ["8", "8", "4"], report.table()


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


@exports
def test_litert_compiled_model_with_a_weight_cache_equals_the_uncached_reference(
    exported, tmp_path
):
    """LiteRT's CompiledModel with an XNNPACK weight cache file (docs/export.md:
    each weight packed once for all the file's subgraphs), the output buffers
    sized by the request: the reference's tokens, from a new cache and from
    the cache file it wrote."""
    from ai_edge_litert.compiled_model import CompiledModel
    from ai_edge_litert.cpu_options import CpuOptions
    from ai_edge_litert.hardware_accelerator import HardwareAccelerator
    from ai_edge_litert.options import Options
    from ai_edge_litert.tensor_buffer import TensorBuffer

    model, _, _, litert_path = exported
    request = _request()
    cache = tmp_path / "weights.xnnpack_cache"
    options = Options(
        hardware_accelerators=HardwareAccelerator.CPU,
        cpu_options=CpuOptions(num_threads=1, xnnpack_weight_cache_path=str(cache)),
    )
    want, want_lengths = reference.uncached(model, PROMPTS, STEPS)
    for _ in range(2):  # the second loads the packed weights from the file
        compiled = CompiledModel.from_file(str(litert_path), options=options)
        for name, value in request.items():
            if value.ndim:
                compiled.resize_input_tensor_by_name(
                    "generate", name, list(value.shape)
                )
        inputs = {}
        for name, value in request.items():
            inputs[name] = compiled.create_input_buffer_by_name("generate", name)
            inputs[name].write(value)
        outputs = {
            "tokens": TensorBuffer.create_from_host_memory(
                np.zeros(want.shape, np.int32)
            ),
            "lengths": TensorBuffer.create_from_host_memory(
                np.zeros(want_lengths.shape, np.int32)
            ),
        }
        compiled.run_by_name("generate", inputs, outputs)
        tokens = outputs["tokens"].read(want.size, np.int32).reshape(want.shape)
        np.testing.assert_array_equal(tokens, want)
        np.testing.assert_array_equal(
            outputs["lengths"].read(want_lengths.size, np.int32), want_lengths
        )
        assert cache.stat().st_size > 0
