"""Selects that keep NaN and inf out of what they do not choose, in exports too.

A masked key gets weight exactly 0, but `0 * NaN` is NaN: a NaN or inf in a
padded input or an unwritten cache slot would still reach every output
through `weights @ values` (and through the scores where a mask is added as
a bias). The layer therefore zeroes those positions before attention with
`zero_unless`.

On TensorFlow, tf2onnx lowers a select to `x * cond + y * (1 - cond)`, where a
NaN in the branch not chosen still gives NaN, unless its condition is a NaN
test (then it emits ONNX `Where`). `where` writes its condition as one.
"""

from __future__ import annotations

import keras
from keras import ops


def where(condition, x, y):
    """`ops.where(condition, x, y)`, exact also where the other branch is NaN
    or inf, on every backend and in ONNX exports through tf2onnx.

    The condition is written as "not `m != m`" with `m = 0 / condition`
    (NaN exactly where it is False), a NaN test tf2onnx keeps as `Where`.
    """
    if keras.backend.backend() != "tensorflow":
        # Selects are exact there, and OpenVINO's torch front end has no
        # rule for the division (aten::divide).
        return ops.where(condition, x, y)
    marker = ops.divide(ops.zeros((), "float32"), ops.cast(condition, "float32"))
    return ops.where(ops.not_equal(marker, marker), y, x)


def zero_unless(keep, x):
    """`x` with exact zeros where the bool `keep` (broadcastable) is False."""
    return where(keep, x, ops.zeros((), x.dtype))
