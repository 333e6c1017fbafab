"""LiteRT's runtime module runs its interpreter on the process's CPUs unless
told a number of threads: an interpreter per file and thread count, each
computing the file's numbers; a bad count is a ValueError naming it."""

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
