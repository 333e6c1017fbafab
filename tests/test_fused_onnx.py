"""`export_onnx(fuse_attention=True)`: one ONNX Attention node per SelfAttention.

Every export is checked in the real onnxruntime against Keras (not against
the unfused export) on the export tests' shapes: batch 1 x time 1, odd 33,
128 and 512, with padded rows where the model has token or bool inputs.
Models are exported once per module (tf2onnx is the slow part).
"""

from __future__ import annotations

import logging

import keras
import numpy as np
import onnx
import onnxruntime
import pytest

from keras_selfattn import SelfAttention
from keras_selfattn.export import export_onnx, verify
from keras_selfattn.export.formats.onnx.fused import FUSED_OPSET, collect_log
from keras_selfattn.tracing import FUSABLE_CORE_SCOPE
from keras_selfattn_cli import main as cli_main
from tests import model_zoo

pytestmark = pytest.mark.tensorflow_only(
    "ONNX export through tf2onnx, rewritten by TensorFlow op names"
)

# onnxruntime 1.31 loads IR versions up to 13.
MAX_IR_VERSION = 13
ATOL = 1e-5


def sliding_window(seed: int = 0) -> keras.Model:
    """Two heads, sliding window 3, biases, scale 1 (TF drops its multiply)."""
    inputs = keras.Input((None, model_zoo.FEATURES), name="x")
    outputs = SelfAttention(
        num_heads=2, sliding_window=3, use_bias=True, scale=1.0, name="window"
    )(inputs)
    return model_zoo._seed_weights(keras.Model(inputs, outputs), seed)


def attention_mask(seed: int = 0) -> keras.Model:
    """An explicit (batch, time, time) bool mask input, output_dim, biases.

    verify pads the bool input's query rows: those rows allow no key at all.
    """
    inputs = keras.Input((None, model_zoo.FEATURES), name="x")
    allowed = keras.Input((None, None), dtype="bool", name="allowed")
    outputs = SelfAttention(num_heads=2, output_dim=5, use_bias=True, name="masked")(
        inputs, attention_mask=allowed
    )
    return model_zoo._seed_weights(keras.Model([inputs, allowed], outputs), seed)


def padded_causal_window(seed: int = 0) -> keras.Model:
    """Embedding(mask_zero) -> causal + sliding window, 4 heads, no projection."""
    tokens = keras.Input((None,), dtype="int32", name="tokens")
    x = keras.layers.Embedding(model_zoo.VOCAB, model_zoo.FEATURES, mask_zero=True)(
        tokens
    )
    outputs = SelfAttention(
        num_heads=4, key_dim=2, causal=True, sliding_window=4, name="local"
    )(x)
    return model_zoo._seed_weights(keras.Model(tokens, outputs), seed)


def chunked_then_plain(seed: int = 0) -> keras.Model:
    """A chunk_size layer (not fused) feeding a plain one (fused)."""
    inputs = keras.Input((None, model_zoo.FEATURES), name="x")
    x = SelfAttention(num_heads=2, chunk_size=16, name="chunked")(inputs)
    outputs = SelfAttention(num_heads=2, name="plain")(x)
    return model_zoo._seed_weights(keras.Model(inputs, outputs), seed)


FUSED_MODELS = {
    **model_zoo.ALL,
    "sliding_window": sliding_window,
    "attention_mask": attention_mask,
    "padded_causal_window": padded_causal_window,
}


def attention_layers(model: keras.Model) -> list[SelfAttention]:
    return [layer for layer in model.layers if isinstance(layer, SelfAttention)]


def count_attention_nodes(proto: onnx.ModelProto) -> int:
    return sum(
        node.op_type == "Attention" and node.domain in ("", "ai.onnx")
        for node in proto.graph.node
    )


def default_opset(proto: onnx.ModelProto) -> int:
    return next(op.version for op in proto.opset_import if op.domain in ("", "ai.onnx"))


def export_logged(model, path, **kwargs) -> list[str]:
    with collect_log() as lines:
        export_onnx(model, path, fuse_attention=True, check=False, **kwargs)
    return list(lines)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """name -> (model, path, log lines) for every model of FUSED_MODELS."""
    folder = tmp_path_factory.mktemp("fused")
    result = {}
    for name, build in FUSED_MODELS.items():
        model = build(seed=3)
        path = str(folder / f"{name}.onnx")
        result[name] = (model, path, export_logged(model, path))
    return result


@pytest.mark.parametrize("name", sorted(FUSED_MODELS))
def test_one_attention_node_per_layer(exported, name):
    model, path, lines = exported[name]
    proto = onnx.load(path)
    onnx.checker.check_model(proto, full_check=True)
    layers = attention_layers(model)
    assert layers
    assert count_attention_nodes(proto) == len(layers)
    assert default_opset(proto) >= 23
    assert proto.ir_version <= MAX_IR_VERSION
    # Nothing of the decomposed cores is left: under their scope only the
    # Attention node and its mask expansion remain.
    leftovers = {
        node.op_type for node in proto.graph.node if FUSABLE_CORE_SCOPE in node.name
    }
    assert leftovers <= {"Attention", "Shape", "Concat", "Expand"}
    assert lines == [
        f"layer {layer.name!r}: fused into one ONNX Attention node" for layer in layers
    ]


@pytest.mark.parametrize("name", sorted(FUSED_MODELS))
def test_parity_with_keras_in_onnxruntime(exported, name):
    model, path, _ = exported[name]
    report = verify(model, onnx_path=path, atol=ATOL, rtol=0.0)
    assert report.ok, report.table()
    assert [row.shape.split()[0] for row in report.rows] == [
        "1x1",
        "2x33",
        "3x128",
        "2x512",
    ]
    has_discrete_input = any(
        "int" in str(t.dtype) or "bool" in str(t.dtype) for t in model.inputs
    )
    assert any("padded" in row.shape for row in report.rows) == has_discrete_input


def run_onnx(path: str, feeds: dict) -> list[np.ndarray]:
    session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def test_row_without_allowed_key_outputs_zeros(tmp_path):
    """A query that may attend no key outputs exactly 0, never NaN."""
    inputs = keras.Input((None, 4), name="x")
    allowed = keras.Input((None, None), dtype="bool", name="allowed")
    outputs = SelfAttention(num_heads=2, name="attention")(
        inputs, attention_mask=allowed
    )
    model = model_zoo._seed_weights(keras.Model([inputs, allowed], outputs), 5)
    path = str(tmp_path / "blocked.onnx")
    assert export_logged(model, path) == [
        "layer 'attention': fused into one ONNX Attention node"
    ]
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 7, 4)).astype("float32")
    mask = rng.random((2, 7, 7)) < 0.5
    mask[0, 3, :] = False
    mask[1, :, :] = False  # every query of the second sequence
    (actual,) = run_onnx(path, {"x": x, "allowed": mask})
    expected = keras.ops.convert_to_numpy(model([x, mask]))
    assert not np.isnan(actual).any()
    np.testing.assert_array_equal(actual[0, 3], 0.0)
    np.testing.assert_array_equal(actual[1], 0.0)
    np.testing.assert_allclose(actual, expected, atol=ATOL, rtol=0)


def test_padded_queries_output_zeros(exported):
    """Padding tokens (an all-padding row too) give exact zeros, like Keras."""
    model, path, _ = exported["padded_causal_window"]
    tokens = np.array(
        [[3, 7, 9, 4, 0, 0], [0, 0, 0, 0, 0, 0], [5, 0, 0, 0, 0, 0]], dtype="int32"
    )
    (actual,) = run_onnx(path, {"tokens": tokens})
    expected = keras.ops.convert_to_numpy(model(tokens))
    assert not np.isnan(actual).any()
    np.testing.assert_array_equal(actual[tokens == 0], 0.0)
    np.testing.assert_allclose(actual, expected, atol=ATOL, rtol=0)


@pytest.mark.slow  # two fused exports, checked: 6 s
def test_shared_and_nested_layers_fuse_every_call(tmp_path):
    """A layer called twice, one inside a nested model, similar names."""
    inputs = keras.Input((None, model_zoo.FEATURES), name="x")
    inner_inputs = keras.Input((None, model_zoo.FEATURES))
    block = keras.Model(
        inner_inputs,
        SelfAttention(num_heads=2, causal=True, name="attention")(inner_inputs),
        name="block",
    )
    shared = SelfAttention(num_heads=2, use_bias=True, name="shared")
    x = block(shared(shared(inputs)))
    outputs = SelfAttention(name="attention_1")(x)
    model = model_zoo._seed_weights(keras.Model(inputs, outputs), 7)
    path = str(tmp_path / "shared.onnx")
    assert sorted(export_logged(model, path)) == [
        "layer 'attention': fused into one ONNX Attention node",
        "layer 'attention_1': fused into one ONNX Attention node",
        "layer 'shared': fused into 2 ONNX Attention nodes (one per call)",
    ]
    assert count_attention_nodes(onnx.load(path)) == 4
    assert verify(model, onnx_path=path, atol=ATOL, rtol=0.0).ok


@pytest.mark.slow  # an export of a chunked model
def test_chunked_layer_falls_back_and_still_matches(tmp_path, caplog):
    model = chunked_then_plain(seed=1)
    path = str(tmp_path / "chunked.onnx")
    with caplog.at_level(
        logging.INFO, logger="keras_selfattn.export.formats.onnx.fused"
    ):
        export_onnx(model, path, fuse_attention=True)  # with the built-in check
    messages = [record.getMessage() for record in caplog.records]
    assert any(
        m.startswith("layer 'chunked': not fused (chunk_size=16") for m in messages
    )
    assert "layer 'plain': fused into one ONNX Attention node" in messages
    assert count_attention_nodes(onnx.load(path)) == 1
    assert verify(model, onnx_path=path, atol=ATOL, rtol=0.0).ok


def test_attention_outputs_fall_back_and_still_match(tmp_path):
    model = attention_mask(seed=2)
    path = str(tmp_path / "weights.onnx")
    lines = export_logged(model, path, attention_outputs={"masked": "weights"})
    assert len(lines) == 1
    assert lines[0].startswith("layer 'masked': not fused (its attention weights")
    proto = onnx.load(path)
    assert count_attention_nodes(proto) == 0
    assert default_opset(proto) >= 23
    report = verify(
        model, onnx_path=path, attention_outputs={"masked": "weights"}, atol=ATOL
    )
    assert report.ok, report.table()


def test_half_precision_layer_fuses_in_float32_and_falls_back_in_float16(tmp_path):
    """A mixed_float16 model exports in float32 by default (its float32 view):
    fused, and exact against that view. Kept in float16
    (`precision="model"`) its core casts inside, so it is not fused."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    model = model_zoo.attention_only(seed=6)
    keras.mixed_precision.set_global_policy("float32")
    float32 = str(tmp_path / "float32.onnx")
    assert export_logged(model, float32) == [
        "layer 'attention': fused into one ONNX Attention node"
    ]
    assert count_attention_nodes(onnx.load(float32)) == 1
    assert verify(model, onnx_path=float32, atol=ATOL).ok
    half = str(tmp_path / "half.onnx")
    lines = export_logged(model, half, precision="model")
    assert lines == [
        "layer 'attention': not fused (query/key are cast inside the core (a "
        "half-precision compute dtype); only float32 cores are fused)"
    ]
    assert count_attention_nodes(onnx.load(half)) == 0
    assert verify(model, onnx_path=half, precision="model").ok


def test_fuse_attention_must_be_bool(tmp_path):
    path = tmp_path / "never.onnx"
    with pytest.raises(ValueError, match="fuse_attention.*'yes'"):
        export_onnx(model_zoo.attention_only(), path, fuse_attention="yes")
    assert not path.exists()


def test_cli_fuse_attention(tmp_path, capsys):
    model = model_zoo.causal_multihead(seed=4)
    model_path = str(tmp_path / "model.keras")
    model.save(model_path)
    out = str(tmp_path / "fused.onnx")
    assert cli_main(["export", model_path, "--onnx", out, "--fuse-attention"]) == 0
    printed = capsys.readouterr().out
    assert f"-> {FUSED_OPSET}, fused Attention" in printed
    assert "layer 'causal_attention': fused into one ONNX Attention node" in printed
    assert count_attention_nodes(onnx.load(out)) == 1
    # The CLI's own parity table: every onnxruntime row within tolerance.
    rows = [line for line in printed.splitlines() if line.startswith("onnx ")]
    assert len(rows) == 4 and all(line.endswith("yes") for line in rows)


def test_cli_fuse_attention_needs_onnx(tmp_path, capsys):
    model_path = str(tmp_path / "model.keras")
    argv = ["export", model_path, "--saved-model", str(tmp_path), "--fuse-attention"]
    assert cli_main(argv) == 1
    assert "--fuse-attention needs --onnx" in capsys.readouterr().err


def test_cli_int8_matmul_needs_onnx(tmp_path, capsys):
    model_path = str(tmp_path / "model.keras")
    argv = ["export", model_path, "--saved-model", str(tmp_path)]
    assert cli_main([*argv, "--int8-matmul", "vnni"]) == 1
    assert "--int8-matmul needs --onnx" in capsys.readouterr().err
