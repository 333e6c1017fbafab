"""The default int8 ONNX file against the quantized Keras model on this
machine's CPU, whichever kernel its probe picks (issue 56: on x86 without
VNNI or AMX, uint8 x uint8; both kernels are run here, the second by a
probe made to fail).

A Dense projector, whose integer activations come from the input itself,
is within 1e-5 + 1e-4 |y| of Keras on every shape. The attention model's
output projection quantizes float attention, which ONNX Runtime sums in
another order than TensorFlow: an activation within an ulp of a half-
integer code rounds either way. Its rows outside that rule are few, and
each differs from Keras by exactly one such code: the difference is one
row of the dequantized kernel (a saturating kernel's would not be).
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

from keras_selfattn import SelfAttention
from keras_selfattn.export import export_onnx
from tests.int8_probes import with_inexact_probes

pytestmark = pytest.mark.tensorflow_only("ONNX export runs on TensorFlow")

FEATURES = 512
ATOL, RTOL = 1e-5, 1e-4
# At most this share of the attention model's rows off the rule (measured:
# 8 of 1024 at (8, 128) on an AVX2-only AMD EPYC, 2026-12-01).
TIE_ROWS = 0.02


def _outside(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    return np.abs(got - want) > ATOL + RTOL * np.abs(want)


def _results(model: keras.Model, path: str, x: np.ndarray) -> list[np.ndarray]:
    """The file's outputs on `x`, on the kernel its probe picks and on the
    uint8 x uint8 one (probe made to fail)."""
    import onnx
    import onnxruntime

    proto = onnx.load(path)
    results = []
    for variant in (proto, with_inexact_probes(proto, probes=1)):
        session = onnxruntime.InferenceSession(
            variant.SerializeToString(), providers=["CPUExecutionProvider"]
        )
        results.append(session.run(None, {"x": x})[0])
    return results


def _quantized(layer: keras.layers.Layer, tmp_path) -> tuple[keras.Model, str]:
    keras.utils.set_random_seed(0)
    x = keras.Input((None, FEATURES), name="x")
    model = keras.Model(x, layer(x))
    model.quantize("int8")
    return model, export_onnx(model, tmp_path / "int8.onnx")


def test_a_projector_is_within_the_rule_on_both_kernels(tmp_path):
    model, path = _quantized(keras.layers.Dense(FEATURES, name="proj"), tmp_path)
    rng = np.random.default_rng(7)
    for shape in ((1, 1), (2, 7), (8, 128), (2, 512)):
        x = (3 * rng.standard_normal((*shape, FEATURES))).astype("float32")
        want = keras.ops.convert_to_numpy(model(x))
        for got in _results(model, path, x):
            assert not _outside(got, want).any(), (shape, np.abs(got - want).max())


def test_attention_rows_off_the_rule_differ_by_one_rounded_code(tmp_path):
    layer = SelfAttention(num_heads=8, output_dim=FEATURES, name="attention")
    model, path = _quantized(layer, tmp_path)
    dense = layer.output_dense
    scale = keras.ops.convert_to_numpy(dense.kernel_scale).reshape(-1)
    rows = keras.ops.convert_to_numpy(dense._kernel).astype(np.float64) / scale
    norms = np.linalg.norm(rows, axis=1)
    rng = np.random.default_rng(7)
    for shape in ((2, 7), (8, 128), (2, 512)):
        x = rng.standard_normal((*shape, FEATURES)).astype("float32")
        want = keras.ops.convert_to_numpy(model(x))
        got, unsigned = _results(model, path, x)
        np.testing.assert_array_equal(got, unsigned)  # both kernels exact
        off = _outside(got, want).any(axis=-1)
        assert off.mean() <= TIE_ROWS, (shape, int(off.sum()))
        for difference in (got - want)[off].astype(np.float64):
            cosines = np.abs(rows @ difference) / (norms * np.linalg.norm(difference))
            assert cosines.max() > 0.9999, (shape, cosines.max())
