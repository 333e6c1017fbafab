"""LiteRT's runtime module runs its interpreter on the process's CPUs unless
told a number of threads, with XNNPACK unless told `xnnpack=False`: an
interpreter per file, thread count and delegate, each computing the file's
numbers; a bad count or flag is a ValueError naming it."""

from __future__ import annotations

import os

import numpy as np
import pytest

pytestmark = pytest.mark.tensorflow_only("converts a tf.function")


@pytest.fixture(scope="module")
def tflite_file(tmp_path_factory):
    import tensorflow as tf

    w = tf.constant(np.arange(12, dtype=np.float32).reshape(3, 4))
    spec = [tf.TensorSpec((None, 3), tf.float32, name="x")]
    function = tf.function(lambda x: {"y": tf.matmul(x, w) + 1.0}, input_signature=spec)
    converter = tf.lite.TFLiteConverter.from_concrete_functions(
        [function.get_concrete_function()], function
    )
    path = str(tmp_path_factory.mktemp("threads") / "m.tflite")
    with open(path, "wb") as file:
        file.write(converter.convert())
    return path


def test_the_default_is_the_process_cpus():
    from keras_selfattn_runtimes import litert as runtime

    assert runtime.default_threads() == len(os.sched_getaffinity(0))


def test_each_thread_count_has_its_interpreter_and_the_same_numbers(tflite_file):
    from keras_selfattn_runtimes import litert as runtime

    default = runtime.load(tflite_file, "serving_default")
    same = runtime.load(tflite_file, "serving_default", num_threads=None)
    one = runtime.load(tflite_file, "serving_default", num_threads=1)
    # A file without signatures: its positional tensors, on `_interpreter`.
    assert default._interpreter is same._interpreter
    if runtime.default_threads() != 1:
        assert default._interpreter is not one._interpreter
    x = np.array([[1, 2, 3], [0, -1, 5]], np.float32)
    want = x @ np.arange(12, dtype=np.float32).reshape(3, 4) + 1.0
    for loaded in (default, one):
        (name,) = loaded.input_names
        (out,) = loaded.output_names
        np.testing.assert_array_equal(loaded({name: x})[out], want)


@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "2"])
def test_a_bad_thread_count_is_refused(tflite_file, bad):
    from keras_selfattn_runtimes import litert as runtime

    with pytest.raises(ValueError, match="num_threads"):
        runtime.load(tflite_file, "serving_default", num_threads=bad)


def test_xnnpack_off_runs_the_builtin_kernels_with_the_same_numbers(tflite_file):
    from keras_selfattn_runtimes import litert as runtime

    delegated = runtime.load(tflite_file, "serving_default")
    builtin = runtime.load(tflite_file, "serving_default", xnnpack=False)
    x = np.array([[1, 2, 3], [0, -1, 5]], np.float32)
    want = x @ np.arange(12, dtype=np.float32).reshape(3, 4) + 1.0
    for loaded in (delegated, builtin):
        loaded._interpreter.allocate_tensors()
        np.testing.assert_array_equal(loaded({"x": x})[loaded.output_names[0]], want)
    # XNNPACK takes the graph over as a DELEGATE node; the builtin kernels run
    # it as converted.
    ops = [
        [op["op_name"] for op in loaded._interpreter._get_ops_details()]
        for loaded in (delegated, builtin)
    ]
    assert ops == [["FULLY_CONNECTED", "DELEGATE"], ["FULLY_CONNECTED"]]


@pytest.mark.parametrize("bad", [0, 1, "no", None])
def test_a_bad_xnnpack_flag_is_refused(tflite_file, bad):
    from keras_selfattn_runtimes import litert as runtime

    with pytest.raises(ValueError, match=f"xnnpack={bad!r}"):
        runtime.load(tflite_file, "serving_default", xnnpack=bad)
