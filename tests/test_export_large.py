"""Models past 2 GiB: ONNX generators written with their weights as external
data beside the .onnx file, LiteRT generators with their weights after the
flatbuffer, and a lone LiteRT target refused in one line.

The thresholds are lowered on a small model (the same code paths; the
files run in onnxruntime and LiteRT against the uncached reference). A
model truly past 2 GiB (2.3 GB of float32 weights) is exported to both in
the release suite and checked in a fresh process by the exports
themselves: about 10 GiB for ONNX and 16.5 GiB for LiteRT, minutes each
(docs/export.md, "Large models")."""

from __future__ import annotations

import os

import keras
import numpy as np
import pytest

from keras_selfattn import SelfAttention
from keras_selfattn.export import export_generator
from tests import generation_reference as reference
from tests.test_generation import PROMPTS, VOCABULARY, token_model

pytestmark = [
    pytest.mark.tensorflow_only("the generator's loop in a TensorFlow graph"),
    # An export and a fresh-process check each (tens of seconds).
    pytest.mark.slow,
]
MAX_LENGTH = 24
STEPS = 8
WIDTH = 256
# The most a tensor's start in a data file moves for alignment: onnx's own
# writing aligns large tensors to 64 KiB.
ALIGNED = 2**16


def _request():
    return reference.generator_request(PROMPTS, STEPS, VOCABULARY)


def test_onnx_generator_past_the_limit_keeps_external_data(monkeypatch, tmp_path):
    """The weights go to the data file as they are converted: the proto
    handed to `save` holds none of their bytes, and each starts on a page
    (ONNX's own writing of external data does not align them). Weights of
    more than 300 elements are stored so here (this model's largest have
    368), and its kernels of 256 are appended by `format.save` after them."""
    import onnx
    import onnxruntime

    from keras_selfattn.export.formats.onnx import external
    from keras_selfattn.export.formats.onnx import format as onnx_format

    monkeypatch.setattr(onnx_format, "EXTERNAL_DATA_BYTES", 0)
    monkeypatch.setattr(external, "STORED_ELEMENTS", 300)
    saved = []
    save = onnx_format.save

    def save_and_keep(proto, path, external):
        saved.append(onnx.ModelProto.FromString(proto.SerializeToString()))
        save(proto, path, external)

    monkeypatch.setattr(onnx_format, "save", save_and_keep)
    model = token_model()
    path = export_generator(model, tmp_path / "lm.onnx", "onnx", max_length=MAX_LENGTH)
    assert sorted(os.listdir(tmp_path)) == ["lm.onnx", "lm.onnx.data"]
    large = [w for w in model.weights if np.prod(w.shape) > external.STORED_ELEMENTS]
    assert large
    (handed,) = saved
    data = (tmp_path / "lm.onnx.data").read_bytes()
    in_proto, in_file = set(), set()
    for tensor in handed.graph.initializer:
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            in_proto.add(tensor.raw_data)
        else:
            entry = {
                e.key: int(e.value) for e in tensor.external_data if e.key != "location"
            }
            assert entry["offset"] % external.ALIGNMENT == 0, tensor.name
            in_file.add(data[entry["offset"] : entry["offset"] + entry["length"]])
    for weight in large:
        value = np.asarray(weight).tobytes()
        assert value in in_file and value not in in_proto, weight.path
    stored = onnx.load(path, load_external_data=False)
    outside = [
        tensor
        for tensor in stored.graph.initializer
        if tensor.data_location == onnx.TensorProto.EXTERNAL
    ]
    kilobyte = [w for w in model.weights if 4 * np.prod(w.shape) >= 1024]
    assert len(outside) >= len(kilobyte) > len(large)
    locations = {
        entry.value
        for tensor in outside
        for entry in tensor.external_data
        if entry.key == "location"
    }
    assert locations == {"lm.onnx.data"}
    session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
    tokens, lengths = session.run(["tokens", "lengths"], _request())
    want, want_lengths = reference.uncached(model, PROMPTS, STEPS)
    np.testing.assert_array_equal(tokens, want)
    np.testing.assert_array_equal(lengths, want_lengths)


def test_onnx_forward_export_past_the_limit_keeps_external_data(monkeypatch, tmp_path):
    """The forward pass's export writes through the same ONNX format: its
    exporter's fresh-process check runs the two files from the path."""
    import onnxruntime

    from keras_selfattn.export import export_onnx
    from keras_selfattn.export.formats.onnx import external
    from keras_selfattn.export.formats.onnx import format as onnx_format

    monkeypatch.setattr(onnx_format, "EXTERNAL_DATA_BYTES", 0)
    monkeypatch.setattr(external, "STORED_ELEMENTS", 300)
    model = token_model()
    path = export_onnx(model, tmp_path / "m.onnx")
    assert sorted(os.listdir(tmp_path)) == ["m.onnx", "m.onnx.data"]
    tokens = np.array([[3, 5, 7, 1], [2, 2, 9, 4]], np.int32)
    session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
    (logits,) = session.run(None, {"tokens": tokens})
    np.testing.assert_allclose(logits, model(tokens), atol=1e-5)


def test_onnx_generator_below_the_limit_stays_one_file(tmp_path):
    export_generator(
        token_model(), tmp_path / "lm.onnx", "onnx", max_length=MAX_LENGTH, check=False
    )
    assert os.listdir(tmp_path) == ["lm.onnx"]


def _quantized_token_model(mode: str) -> keras.Model:
    """Tokens to logits through a SelfAttention of width 256 quantized to
    `mode`: each projection's dequantized kernel is 256 KiB of float32."""
    keras.utils.set_random_seed(0)
    tokens = keras.Input((None,), dtype="int32", name="tokens")
    h = keras.layers.Embedding(VOCABULARY, WIDTH)(tokens)
    a = SelfAttention(num_heads=4, causal=True, name="attention")(h)
    h = keras.layers.LayerNormalization()(keras.layers.Add()([h, a]))
    logits = keras.layers.Dense(VOCABULARY, name="logits")(h)
    model = keras.Model(tokens, logits)
    model.quantize(mode)
    return model


def test_int8_onnx_generator_never_makes_a_float_kernel(monkeypatch, tmp_path):
    """An int8 model's ONNX generator traces Keras's dequantization of each
    stored int8 kernel and the integer pass finds it by its integers: no
    dequantized float kernel is made (none held while converting). The
    weights go to the data file while the passes run and come back into
    the one .onnx file, which holds every layer as Keras's int8 scheme."""
    import json

    import onnx

    from keras_selfattn.export import quantization, quantized_kernels
    from keras_selfattn.export.formats.onnx import external, integer

    made, moved = [], []
    dequantized, load = quantized_kernels.dequantized, external.load

    def dequantized_and_count(integers, scale):
        made.append(integers.shape)
        return dequantized(integers, scale)

    def load_and_keep(proto, path):
        moved.append(len(external._stored(proto)))
        load(proto, path)

    monkeypatch.setattr(quantized_kernels, "dequantized", dequantized_and_count)
    monkeypatch.setattr(external, "load", load_and_keep)
    model = _quantized_token_model("int8")
    path = export_generator(model, tmp_path / "lm.onnx", "onnx", max_length=MAX_LENGTH)
    assert made == []
    assert os.listdir(tmp_path) == ["lm.onnx"]
    assert moved and moved[0] > 0
    proto = onnx.load(path)
    assert not external._stored(proto)
    metadata = {entry.key: entry.value for entry in proto.metadata_props}
    layers = json.loads(metadata[integer.METADATA_KEY])["layers"]
    assert len(layers) == len(quantization.quantized_layers(model))
    assert all(scheme.startswith(integer.EXACT_INT8) for scheme in layers.values())


def test_int4_onnx_generator_past_the_limit_keeps_only_what_it_uses(
    monkeypatch, tmp_path
):
    """Past the limit the data file is rewritten with the tensors the model
    refers to: no stretch of it outside them but alignment (the int4
    layers' dequantized float kernels, 256 KiB each, which the integer pass
    replaced by 4-bit codes, are gone), and the export's own check (a fresh
    onnxruntime process against `generate`) reads the model from the
    path."""
    import onnx

    from keras_selfattn.export import quantization
    from keras_selfattn.export.formats.onnx import external
    from keras_selfattn.export.formats.onnx import format as onnx_format

    monkeypatch.setattr(onnx_format, "EXTERNAL_DATA_BYTES", 0)
    written = []
    compact = external.compact

    def compact_and_keep(proto, path):
        written.append(os.path.getsize(path))
        compact(proto, path)

    monkeypatch.setattr(external, "compact", compact_and_keep)
    model = _quantized_token_model("int4")
    path = export_generator(model, tmp_path / "lm.onnx", "onnx", max_length=MAX_LENGTH)
    assert sorted(os.listdir(tmp_path)) == ["lm.onnx", "lm.onnx.data"]
    kernels = quantization.quantized_layers(model)
    assert written[0] >= sum(q.kernel.nbytes for q in kernels)
    proto = onnx.load(path, load_external_data=False)
    spans = sorted(
        (int(entries.get("offset", 0)), int(entries["length"]))
        for entries in (
            {entry.key: entry.value for entry in tensor.external_data}
            for tensor in external._stored(proto)
        )
    )
    end = 0
    for offset, length in spans:
        assert offset - end < ALIGNED, (offset, end)
        end = max(end, offset + length)
    assert os.path.getsize(path + ".data") - end < ALIGNED


def test_onnx_external_data_target_taken_is_refused(tmp_path):
    (tmp_path / "lm.onnx.data").write_bytes(b"")
    with pytest.raises(FileExistsError):
        export_generator(token_model(), tmp_path / "lm.onnx", "onnx", max_length=8)


def test_litert_generator_past_the_limit_uses_buffer_offsets(monkeypatch, tmp_path):
    from ai_edge_litert.interpreter import Interpreter

    from keras_selfattn.export.formats import litert

    monkeypatch.setattr(litert, "BUFFER_OFFSET_BYTES", 0)
    model = token_model()
    path = export_generator(
        model, tmp_path / "lm.tflite", "litert", max_length=MAX_LENGTH
    )
    assert os.listdir(tmp_path) == ["lm.tflite"]
    assert "buffer_location" in _metadata_names(path)
    runner = Interpreter(model_path=path).get_signature_runner("generate")
    out = runner(**_request())
    want, want_lengths = reference.uncached(model, PROMPTS, STEPS)
    np.testing.assert_array_equal(out["tokens"], want)
    np.testing.assert_array_equal(out["lengths"], want_lengths)


def _metadata_names(path) -> set[str]:
    """The names of a .tflite file's metadata entries ("buffer_location"
    where its weights follow the flatbuffer at recorded offsets)."""
    from tensorflow.lite.tools import flatbuffer_utils

    model = flatbuffer_utils.read_model_from_bytearray(
        bytearray(open(path, "rb").read())
    )
    return {entry.name.decode() for entry in model.metadata or []}


def test_litert_target_alone_past_the_limit_is_refused(monkeypatch, tmp_path):
    from keras_selfattn.export import export_litert
    from keras_selfattn.export.formats import litert

    monkeypatch.setattr(litert, "BUFFER_OFFSET_BYTES", 0)
    with pytest.raises(ValueError, match="flatbuffer holds at most 2 GiB") as error:
        export_litert(token_model(), tmp_path / "lm.tflite")
    assert "\n" not in str(error.value)
    assert not os.listdir(tmp_path)


# Just over 2 GiB of float32 weights: an embedding and an untied head of
# 160000 x 1792 each (2.29 GB), one attention layer between them.
BIG_VOCABULARY, BIG_FEATURES = 160_000, 1792


@pytest.fixture(scope="module")
def big_model():
    import keras

    from keras_selfattn import SelfAttention

    keras.utils.set_random_seed(0)
    tokens = keras.Input((None,), dtype="int32", name="tokens")
    h = keras.layers.Embedding(
        BIG_VOCABULARY,
        BIG_FEATURES,
        embeddings_initializer=keras.initializers.RandomNormal(stddev=1.0),
    )(tokens)
    a = SelfAttention(
        num_heads=4,
        num_key_value_heads=2,
        key_dim=16,
        causal=True,
        rope_max_wavelength=100,
        output_dim=BIG_FEATURES,
    )(h)
    h = keras.layers.Add()([h, a])
    logits = keras.layers.Dense(
        BIG_VOCABULARY,
        kernel_initializer=keras.initializers.RandomNormal(stddev=0.05),
        name="logits",
    )(h)
    return keras.Model(tokens, logits)


def _weights(model) -> int:
    return sum(int(np.prod(w.shape)) * 4 for w in model.weights)


@pytest.mark.release
def test_onnx_generator_just_over_2_gib(big_model, tmp_path):
    """Written as external data and checked in a fresh process (the export's
    own check: the file's tokens against the model's)."""
    weights = _weights(big_model)
    assert weights > 2**31
    export_generator(big_model, tmp_path / "lm.onnx", "onnx", max_length=16)
    assert sorted(os.listdir(tmp_path)) == ["lm.onnx", "lm.onnx.data"]
    assert os.path.getsize(tmp_path / "lm.onnx.data") >= weights
    assert os.path.getsize(tmp_path / "lm.onnx") < 2**27


@pytest.mark.release
def test_litert_generator_just_over_2_gib(big_model, tmp_path):
    """Written with its weights after the flatbuffer and checked in a fresh
    process, or refused before its converter starts where the machine lacks
    the memory the converter needs (reckoned here before the export: the
    traced model takes some of it later, so it errs towards converting)."""
    from keras_selfattn.export.formats import ExportError, litert_process

    weights = _weights(big_model)
    available = litert_process.available_bytes()
    needed = litert_process.needed_bytes(weights, unfolded=True)
    if available is not None and needed > available - litert_process.RESERVE_BYTES:
        with pytest.raises(ExportError, match="needs about .* available") as error:
            export_generator(big_model, tmp_path / "lm.tflite", "litert", max_length=16)
        assert "\n" not in str(error.value)
        assert not os.listdir(tmp_path)
        return
    export_generator(big_model, tmp_path / "lm.tflite", "litert", max_length=16)
    assert os.listdir(tmp_path) == ["lm.tflite"]
    assert os.path.getsize(tmp_path / "lm.tflite") >= weights
