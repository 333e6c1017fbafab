"""The decoding step exports from JAX and PyTorch in every format Keras
writes there: JAX's SavedModel (jax2tf) and ONNX (jax2onnx); torch's ONNX,
OpenVINO and .pt2; and TensorFlow's OpenVINO step (its cache write a
gather). Each export runs its exporter's own check
(`verify_decode_step`): whole sequences decoded step by step in a fresh
process of the runtime, against Keras's cached calls and the model's full
forward, so a step that writes its cache at the wrong position, or bakes
the example's index or sizes into the graph, fails. An ONNX step is also
run here, one position at a time from the first, against the model's full
forward (the reference that does not use the cache at all).
TensorFlow's other steps are tested in test_export_decode_step.py."""

from __future__ import annotations

import keras
import numpy as np
import pytest

from keras_selfattn.export.decode_step import export_decode_step
from tests import model_zoo

MAX_LENGTH = 9
VOCAB = 30
# Keras's formats per backend; the first of PyTorch's runs in `make test`
# (TensorFlow's OpenVINO step 13 s of make test on 2 shared AVX2 cores, in
# CI's TensorFlow slow suite; JAX's ONNX step, through jax2onnx, about 35 s).
FORMATS = {
    "tensorflow": ("openvino",),
    "jax": ("onnx", "saved_model"),
    "torch": ("onnx", "openvino", "torch"),
}
SUFFIX = {"onnx": ".onnx", "openvino": ".xml", "torch": ".pt2", "saved_model": ""}


def _model():
    """Without LayerNormalization, which Keras cannot convert to ONNX on torch."""
    return model_zoo.decoder_language_model(VOCAB, normalized=False)


def _cases() -> list:
    cases = []
    for backend, formats in FORMATS.items():
        for number, export_format in enumerate(formats):
            fast = number == 0 and backend == "torch"
            marks = [] if fast else [pytest.mark.slow]
            cases.append(pytest.param(backend, export_format, marks=marks))
    return cases


@pytest.mark.parametrize("backend, export_format", _cases())
def test_decode_step_exports_from_every_backend(backend, export_format, tmp_path):
    if keras.backend.backend() != backend:
        pytest.skip(f"a {backend} export (KERAS_BACKEND={backend})")
    model = _model()
    options = {"name": "lm"} if export_format == "saved_model" else {}
    path = tmp_path / f"step{SUFFIX[export_format]}"
    written = export_decode_step(
        model, path, export_format, max_length=MAX_LENGTH, **options
    )
    if export_format != "onnx":
        return
    import onnxruntime

    session = onnxruntime.InferenceSession(written, providers=["CPUExecutionProvider"])
    tokens = np.random.default_rng(0).integers(0, VOCAB, (2, MAX_LENGTH), "int32")
    expected = keras.ops.convert_to_numpy(model.predict_on_batch(tokens))
    feed = {
        i.name: np.zeros([d if isinstance(d, int) else 2 for d in i.shape], "float32")
        for i in session.get_inputs()
        if i.name.startswith("cache_") and i.name != "cache_update_index"
    }
    names = [o.name for o in session.get_outputs()]
    (index_type,) = [
        i.type for i in session.get_inputs() if i.name == "cache_update_index"
    ]
    index_dtype = index_type[len("tensor(") : -1]
    for position in range(MAX_LENGTH):
        feed["tokens"] = tokens[:, position : position + 1]
        feed["cache_update_index"] = np.array(position, index_dtype)
        outputs = dict(zip(names, session.run(None, feed), strict=True))
        np.testing.assert_allclose(
            outputs["logits"][:, 0], expected[:, position], atol=2e-5, rtol=1e-4
        )
        for name in list(feed):
            if name.startswith("cache_") and name != "cache_update_index":
                feed[name] = outputs[f"updated_{name}"]


def test_torch_litert_step_names_the_route(tmp_path):
    if keras.backend.backend() != "torch":
        pytest.skip("litert-torch's fixed shapes (KERAS_BACKEND=torch)")
    with pytest.raises(ValueError, match="KERAS_BACKEND=tensorflow") as caught:
        export_decode_step(_model(), tmp_path / "s.tflite", "litert", max_length=4)
    assert "\n" not in str(caught.value)
    assert not (tmp_path / "s.tflite").exists()


@pytest.mark.slow_on(
    "jax",
    "torch",
    "the refusal comes first on every backend; importing the "
    "exporters costs 10-17 s there under make test's load",
)
@pytest.mark.parametrize(
    "export_format, suffix, what",
    [("openvino", ".xml", "decoding step"), ("litert", ".tflite", "generator")],
)
def test_quantized_steps_and_generators_name_the_formats_that_work(
    export_format, suffix, what, tmp_path
):
    """OpenVINO computed a quantized step 17.8 away from Keras (TensorFlow)
    or failed to convert it (torch), LiteRT's converter has no int8 batch
    matmul: refused before anything is written, naming the formats that
    keep Keras's integer layers."""
    from keras_selfattn.export.generator import export_generator

    model = _model()
    model.quantize("int8")
    export = export_decode_step if what == "decoding step" else export_generator
    path = tmp_path / f"out{suffix}"
    with pytest.raises(ValueError, match="SavedModel or ONNX") as caught:
        export(model, path, export_format, max_length=4)
    message = str(caught.value)
    assert "\n" not in message and f"A {what} of a quantized model" in message
    assert "attn1/query_dense" in message
    assert list(tmp_path.iterdir()) == []
