"""The fused ONNX Attention rewrite of layers with score modifications.

A soft-cap becomes the Attention node's `softcap`; an additive bias (ALiBi,
T5's relative bias, `attention_bias`) its float `attn_mask`, with the bool
mask folded in; sinks keep the decomposed graph, with the reason. Every file
runs in the real onnxruntime against Keras (not against the unfused export).
"""

from __future__ import annotations

import keras
import numpy as np
import onnx
import onnxruntime
import pytest

from keras_selfattn import SelfAttention
from keras_selfattn.export import export_onnx, verify
from keras_selfattn.export.formats.onnx.fused import collect_log
from tests import model_zoo

pytestmark = pytest.mark.tensorflow_only(
    "ONNX export through tf2onnx, rewritten by TensorFlow op names"
)

ATOL = 1e-5
HEADS = 2


def _randomize_score_weights(model: keras.Model) -> keras.Model:
    rng = np.random.default_rng(3)
    for weight in model.weights:
        if weight.name in ("relative_attention_bias", "sinks"):
            weight.assign(rng.normal(size=weight.shape).astype("float32"))
    return model


def everything(seed: int = 0) -> keras.Model:
    """Padding, an attention_mask, T5's relative bias, a soft-cap and an
    attention_bias input, in one layer."""
    tokens = keras.Input((None,), dtype="int32", name="tokens")
    allowed = keras.Input((None, None), dtype="bool", name="allowed")
    bias = keras.Input((HEADS, None, None), name="bias")
    x = keras.layers.Embedding(model_zoo.VOCAB, model_zoo.FEATURES, mask_zero=True)(
        tokens
    )
    outputs = SelfAttention(
        num_heads=HEADS,
        position_bias="relative",
        relative_attention_num_buckets=8,
        relative_attention_max_distance=12,
        logit_soft_cap=2.0,
        name="everything",
    )(x, attention_mask=allowed, attention_bias=bias)
    model = keras.Model([tokens, allowed, bias], outputs)
    return _randomize_score_weights(model_zoo._seed_weights(model, seed))


def alibi_language_model(seed: int = 0) -> keras.Model:
    """Causal ALiBi with grouped-query heads (Bloom, MPT)."""
    inputs = keras.Input((None, model_zoo.FEATURES), name="x")
    outputs = SelfAttention(
        num_heads=4,
        num_key_value_heads=2,
        causal=True,
        position_bias="alibi",
        name="alibi",
    )(inputs)
    return model_zoo._seed_weights(keras.Model(inputs, outputs), seed)


def relative_soft_cap_padded(seed: int = 0) -> keras.Model:
    """T5's relative bias + a soft-cap on padded tokens."""
    tokens = keras.Input((None,), dtype="int32", name="tokens")
    x = keras.layers.Embedding(model_zoo.VOCAB, model_zoo.FEATURES, mask_zero=True)(
        tokens
    )
    outputs = SelfAttention(
        num_heads=4,
        position_bias="relative",
        relative_attention_num_buckets=8,
        relative_attention_max_distance=12,
        logit_soft_cap=5.0,
        name="relative",
    )(x)
    model = model_zoo._seed_weights(keras.Model(tokens, outputs), seed)
    return _randomize_score_weights(model)


def attention_bias_input(seed: int = 0) -> keras.Model:
    """A (batch, heads, time, time) attention_bias input, no mask."""
    inputs = keras.Input((None, model_zoo.FEATURES), name="x")
    bias = keras.Input((HEADS, None, None), name="bias")
    outputs = SelfAttention(num_heads=HEADS, name="biased")(inputs, attention_bias=bias)
    return model_zoo._seed_weights(keras.Model([inputs, bias], outputs), seed)


def sinks(seed: int = 0) -> keras.Model:
    inputs = keras.Input((None, model_zoo.FEATURES), name="x")
    outputs = SelfAttention(
        num_heads=HEADS, causal=True, use_sinks=True, logit_soft_cap=3.0, name="sinks"
    )(inputs)
    model = model_zoo._seed_weights(keras.Model(inputs, outputs), seed)
    return _randomize_score_weights(model)


def export_logged(model, path) -> list[str]:
    with collect_log() as lines:
        export_onnx(model, path, fuse_attention=True, check=False)
    return list(lines)


def attention_nodes(path) -> list[onnx.NodeProto]:
    return [node for node in onnx.load(path).graph.node if node.op_type == "Attention"]


def fused_line(name: str) -> str:
    return f"layer {name!r}: fused into one ONNX Attention node"


def test_every_modification_with_masks_fuses_and_matches_keras(tmp_path):
    """A query with no allowed key (an all-False attention_mask row) outputs
    zeros, and a non-finite bias where the masks exclude changes nothing."""
    model = everything(seed=1)
    path = str(tmp_path / "everything.onnx")
    assert export_logged(model, path) == [fused_line("everything")]
    (node,) = attention_nodes(path)
    attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    assert attributes["softcap"] == pytest.approx(2.0)
    assert len(node.input) == 4  # the attn_mask: bias and masks in one
    session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    for batch, time in ((1, 1), (2, 9), (3, 20)):
        tokens = rng.integers(1, model_zoo.VOCAB, size=(batch, time)).astype("int32")
        allowed = rng.random((batch, time, time)) < 0.7
        bias = rng.standard_normal((batch, HEADS, time, time)).astype("float32")
        if batch > 1:
            tokens[1, time // 2 :] = 0  # padding
            allowed[0, time - 1, :] = False  # a query with no allowed key
            excluded = ~allowed[:, None] | (tokens == 0)[:, None, None, :]
            bias[excluded & (rng.random(bias.shape) < 0.5)] = -np.inf
            # (NaN only where the attention_mask excludes: the layer's own
            # output has NaN where a padded key's bias is NaN or +inf.)
            bias[~allowed[:, None] & (rng.random(bias.shape) < 0.3)] = np.nan
        feeds = {"tokens": tokens, "allowed": allowed, "bias": bias}
        (actual,) = session.run(None, feeds)
        expected = keras.ops.convert_to_numpy(model([tokens, allowed, bias]))
        assert np.isfinite(expected).all()
        np.testing.assert_allclose(actual, expected, atol=ATOL, rtol=0)
        if batch > 1:
            np.testing.assert_array_equal(actual[0, time - 1], 0.0)


@pytest.mark.slow  # three exports, each checked on the export tests' shapes
@pytest.mark.parametrize(
    "build, name, softcap",
    [
        (alibi_language_model, "alibi", None),
        (relative_soft_cap_padded, "relative", 5.0),
        (attention_bias_input, "biased", None),
    ],
)
def test_fused_and_equal_to_keras_in_onnxruntime(tmp_path, build, name, softcap):
    model = build(seed=2)
    path = str(tmp_path / f"{name}.onnx")
    assert export_logged(model, path) == [fused_line(name)]
    (node,) = attention_nodes(path)
    assert len(node.input) == 4  # a float attn_mask
    softcaps = [a.f for a in node.attribute if a.name == "softcap"]
    assert softcaps == ([] if softcap is None else [pytest.approx(softcap)])
    report = verify(model, onnx_path=path, atol=ATOL, rtol=0.0)
    assert report.ok, report.table()
    assert [row.shape.split()[0] for row in report.rows] == [
        "1x1",
        "2x33",
        "3x128",
        "2x512",
    ]


@pytest.mark.slow  # an export checked on the export tests' shapes
def test_sinks_keep_the_decomposed_graph_and_still_match(tmp_path):
    model = sinks(seed=4)
    path = str(tmp_path / "sinks.onnx")
    assert export_logged(model, path) == [
        "layer 'sinks': not fused (use_sinks=True: ONNX's Attention op has no "
        "sink logits (one more logit per head in the softmax's denominator))"
    ]
    assert attention_nodes(path) == []
    report = verify(model, onnx_path=path, atol=ATOL, rtol=0.0)
    assert report.ok, report.table()
