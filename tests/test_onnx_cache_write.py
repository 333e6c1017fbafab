"""The key/value cache write as tf2onnx converts it
(`tf2onnx_handlers.dynamic_update_slice`): XLA's dynamic update slice, its
start clamped into the operand, as one ScatterND, against numpy in ONNX
Runtime, at starts inside, at and past the end, and at another batch."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.tensorflow_only("tf2onnx converts TensorFlow graphs")

CACHE = (None, 2, 6, 3, 4)  # (B, 2, L, G, K), as SelfAttention's
UPDATE = (None, 2, 2, 3, 4)


def _numpy_write(cache: np.ndarray, update: np.ndarray, start: np.ndarray):
    """XLA's DynamicUpdateSlice: `start` clamped so the update fits."""
    limit = np.asarray(cache.shape) - np.asarray(update.shape)
    first = np.clip(start, 0, limit)
    out = cache.copy()
    out[tuple(slice(f, f + n) for f, n in zip(first, update.shape, strict=True))] = (
        update
    )
    return out


@pytest.fixture(scope="module")
def converted():
    """The write converted to an ONNX Runtime session."""
    import onnxruntime
    import tensorflow as tf
    import tf2onnx
    from tensorflow.compiler.tf2xla.python import xla

    from keras_selfattn.export.formats.onnx import tf2onnx_handlers

    @tf.function(
        input_signature=[
            tf.TensorSpec(CACHE, tf.float32, name="cache"),
            tf.TensorSpec(UPDATE, tf.float32, name="update"),
            tf.TensorSpec((), tf.int32, name="index"),
        ]
    )
    def write(cache, update, index):
        zero = tf.zeros((), tf.int32)
        return xla.dynamic_update_slice(
            cache, update, tf.stack([zero, zero, index, zero, zero])
        )

    proto, _ = tf2onnx.convert.from_function(
        write,
        input_signature=write.input_signature,
        opset=17,
        custom_op_handlers=dict(tf2onnx_handlers.CUSTOM_OP_HANDLERS),
    )
    ops = {node.op_type for node in proto.graph.node}
    return ops, onnxruntime.InferenceSession(proto.SerializeToString())


@pytest.mark.parametrize("batch, index", [(1, 0), (1, 3), (3, 4), (3, 5), (2, 9)])
def test_the_write_is_xlas_clamped_update(converted, batch, index):
    ops, session = converted
    assert "ScatterND" in ops and not {"Where", "Pad"} & ops, ops
    rng = np.random.default_rng(index)
    cache = rng.standard_normal((batch, *CACHE[1:])).astype(np.float32)
    update = rng.standard_normal((batch, *UPDATE[1:])).astype(np.float32)
    (written,) = session.run(
        None, {"cache": cache, "update": update, "index": np.asarray(index, np.int32)}
    )
    start = np.array([0, 0, index, 0, 0])
    np.testing.assert_array_equal(written, _numpy_write(cache, update, start))
