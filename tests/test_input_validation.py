"""Bad `inputs` get the same ValueError whether the layer is built or not,
and in symbolic or eager calls; the message names `inputs` and the value."""

from __future__ import annotations

import keras
import numpy as np
import pytest

from keras_selfattn import SelfAttention

GOOD = np.zeros((2, 3, 4), "float32")


def _unbuilt():
    return SelfAttention(num_heads=2)


def _built():
    layer = SelfAttention(num_heads=2)
    layer.build(GOOD.shape)
    return layer


STATES = {"unbuilt": _unbuilt, "built": _built}
BAD_EAGER = {
    "list": ([GOOD, GOOD], r"one float tensor of rank 3.*inputs=a list of 2 items"),
    "tuple": ((GOOD,), r"inputs=a tuple of 1 items"),
    "dict": ({"x": GOOD}, r"inputs=a dict of 1 items"),
    "rank_2": (np.zeros((2, 4), "float32"), r"rank 3.*inputs.shape=\(2, 4\)"),
    "rank_4": (np.zeros((1, 2, 3, 4), "float32"), r"rank 3"),
    "int_dtype": (np.zeros((2, 3, 4), "int32"), r"inputs.dtype=int32"),
    "bool_dtype": (np.zeros((2, 3, 4), bool), r"inputs.dtype=bool"),
}


@pytest.mark.parametrize("state", list(STATES))
@pytest.mark.parametrize("case", list(BAD_EAGER))
def test_bad_eager_inputs(state, case):
    value, message = BAD_EAGER[case]
    with pytest.raises(ValueError, match=message):
        STATES[state]()(value)


@pytest.mark.parametrize("state", list(STATES))
@pytest.mark.parametrize(
    ("shape", "dtype", "message"),
    [
        ((None, 4), "float32", r"rank 3"),
        ((None, None, 4), "int32", r"inputs.dtype=int32"),
    ],
)
def test_bad_symbolic_inputs(state, shape, dtype, message):
    symbolic = keras.Input(shape[1:], batch_size=None, dtype=dtype)
    with pytest.raises(ValueError, match=message):
        STATES[state]()(symbolic)


@pytest.mark.parametrize("state", list(STATES))
def test_symbolic_list_input(state):
    inputs = [keras.Input((3, 4)), keras.Input((3, 4))]
    with pytest.raises(ValueError, match=r"inputs=a list of 2 items"):
        STATES[state]()(inputs)


def test_wrong_last_dimension_once_built():
    layer = _built()
    message = r"was built for features=4. Received: inputs.shape=\(2, 3, 5\)"
    with pytest.raises(ValueError, match=message):
        layer(np.zeros((2, 3, 5), "float32"))
    with pytest.raises(ValueError, match=r"was built for features=4"):
        layer(keras.Input((None, 5)))


@pytest.mark.parametrize("state", list(STATES))
def test_unknown_last_dimension(state):
    with pytest.raises(ValueError, match=r"needs a known last dimension"):
        STATES[state]()(keras.Input((None, None)))
