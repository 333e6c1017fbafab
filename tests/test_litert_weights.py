"""LiteRT conversions with the matrices as markers (`litert_weights`): the
converted file holds each matrix's marker, not its values; `fill` writes the
values in, transposed where the converter transposed them, and the file
computes the model's numbers (numpy, in LiteRT's interpreter); a square
matrix's layout is told by the operation reading it. A large model's large
markers are FILL operations, which `litert_unfolded.place` makes buffers of
the matrices after the flatbuffer. A marker the converter
folded with other values, or a square one read by an operation that does not
tell its layout, leaves the file untouched, and a model that assigns a
variable is refused the markers."""

from __future__ import annotations

import keras
import numpy as np
import pytest

from keras_selfattn.export.formats import litert_unfolded, litert_weights

pytestmark = pytest.mark.tensorflow_only("TensorFlow's LiteRT converter")


class _Doubled(keras.layers.Layer):
    """x @ (2 * kernel): the converter folds the product into one constant."""

    def build(self, input_shape):
        self.kernel = self.add_weight(shape=(input_shape[-1], 5))

    def call(self, x):
        return keras.ops.matmul(x, self.kernel * 2.0)


class _Counting(keras.layers.Layer):
    """Assigns a counter at every call."""

    def build(self, input_shape):
        self.kernel = self.add_weight(shape=(input_shape[-1], 5))
        self.calls = self.add_weight(
            shape=(), initializer="zeros", trainable=False, name="calls"
        )

    def call(self, x):
        self.calls.assign_add(1.0)
        return keras.ops.matmul(x, self.kernel)


def _token_model() -> keras.Model:
    keras.utils.set_random_seed(0)
    tokens = keras.Input((3,), dtype="int32")
    h = keras.layers.Embedding(10, 4, name="embedding")(tokens)
    h = keras.layers.Dense(6, activation="relu", name="hidden")(h)
    h = keras.layers.Dense(6, use_bias=False, name="square")(h)
    logits = keras.layers.Dense(10, use_bias=False, name="logits")(h)
    return keras.Model(tokens, logits)


def _convert(model, marked, path, inputs, large=False) -> None:
    """The model converted as `litert_signatures` converts it (a SavedModel
    of Keras's `ExportArchive`), `marked` read as markers, in this process;
    `large` as a large model's (weights after the flatbuffer, large markers
    as FILL operations)."""
    import tensorflow as tf

    def serve(x):
        with litert_weights.read_as_markers(marked):
            return model(x)

    archive = keras.export.ExportArchive()
    spec = keras.InputSpec(shape=(None, *inputs.shape[1:]), dtype=str(inputs.dtype))
    archive.add_endpoint("serve", serve, input_signature=[spec])
    saved = str(path) + ".saved"
    archive.write_out(saved, verbose=False)
    converter = tf.lite.TFLiteConverter.from_saved_model(saved, ["serve"])
    converter.experimental_enable_resource_variables = True
    converter.canonicalizing_inf_as_min_max_float = False
    converter._experimental_use_buffer_offset = large
    converter._experimental_unfold_large_splat_constant = large
    with open(path, "wb") as file:
        file.write(converter.convert())


def _run(path, inputs):
    from ai_edge_litert.interpreter import Interpreter

    interpreter = Interpreter(model_path=str(path))
    runner = interpreter.get_signature_runner()
    (output,) = runner(**{runner.get_input_details().popitem()[0]: inputs}).values()
    return output


def test_marks_are_the_float32_matrices():
    model = _token_model()
    marked = litert_weights.marks(model)
    assert [m.variable.path for m in marked] == [
        "embedding/embeddings",
        "hidden/kernel",
        "square/kernel",
        "logits/kernel",
    ]
    values = [float(m.value) for m in marked]
    assert len(set(values)) == 4 and all(v >= 2**20 for v in values)


def test_the_file_holds_markers_until_filled_then_computes_the_model(tmp_path):
    model = _token_model()
    tokens = np.array([[1, 7, 3], [9, 0, 4]], np.int32)
    marked = litert_weights.marks(model)
    path = tmp_path / "m.tflite"
    _convert(model, marked, path, tokens)
    written = path.read_bytes()
    for each in marked:
        assert each.read
        values = each.variable.numpy()
        assert values.tobytes() not in written
        assert np.ascontiguousarray(values.T).tobytes() not in written

    assert litert_weights.fill(str(path), marked)

    embeddings, hidden, square, logits = (m.variable.numpy() for m in marked)
    bias = model.get_layer("hidden").bias.numpy()
    want = np.maximum(embeddings[tokens] @ hidden + bias, 0) @ square @ logits
    np.testing.assert_allclose(_run(path, tokens), want, rtol=1e-5, atol=1e-5)
    assert path.stat().st_size == len(written)


def test_a_marker_folded_with_other_values_leaves_the_file_unfilled(tmp_path):
    inputs = keras.Input((3,))
    model = keras.Model(inputs, _Doubled()(inputs))
    marked = litert_weights.marks(model)
    path = tmp_path / "m.tflite"
    _convert(model, marked, path, np.ones((1, 3), np.float32))
    written = path.read_bytes()

    assert marked[0].read
    assert not litert_weights.fill(str(path), marked)
    assert path.read_bytes() == written


def _square_table_model(size: int) -> keras.Model:
    """A square embedding table, gathered, then a dense layer."""
    keras.utils.set_random_seed(0)
    tokens = keras.Input((3,), dtype="int32")
    h = keras.layers.Embedding(size, size, name="square_table")(tokens)
    return keras.Model(tokens, keras.layers.Dense(7, name="out")(h))


def test_a_square_marker_read_otherwise_leaves_the_file_unfilled(tmp_path):
    """A square embedding table is gathered, which does not tell whether
    its buffer holds it transposed."""
    model = _square_table_model(5)
    marked = litert_weights.marks(model)
    path = tmp_path / "m.tflite"
    _convert(model, marked, path, np.array([[1, 4, 0]], np.int32))
    written = path.read_bytes()

    assert all(each.read for each in marked)
    assert not litert_weights.fill(str(path), marked)
    assert path.read_bytes() == written


def test_a_model_that_assigns_a_variable_is_refused_the_markers(tmp_path):
    inputs = keras.Input((3,))
    model = keras.Model(inputs, _Counting()(inputs))
    marked = litert_weights.marks(model)
    with pytest.raises(litert_weights.Assigned, match="assigns '.*calls'"):
        _convert(model, marked, tmp_path / "m.tflite", np.ones((1, 3), np.float32))


class _Looped(keras.layers.Layer):
    """x @ kernel @ kernel in a loop: the kernel is passed to the loop's body,
    which reads it."""

    def build(self, input_shape):
        self.kernel = self.add_weight(
            shape=(input_shape[-1], input_shape[-1]), name="kernel"
        )

    def call(self, x):
        return keras.ops.fori_loop(
            0, 2, lambda i, h: keras.ops.matmul(h, self.kernel), x
        )


def _wide_model() -> keras.Model:
    """Matrices past the converter's unfolding size (31,250 values), square
    ones among them (one read in a loop), and a small one it keeps as a
    buffer."""
    keras.utils.set_random_seed(0)
    tokens = keras.Input((3,), dtype="int32")
    h = keras.layers.Embedding(300, 128, name="embedding")(tokens)
    h = keras.layers.Dense(256, activation="relu", name="hidden")(h)
    h = keras.layers.Dense(256, use_bias=False, name="square")(h)
    h = _Looped(name="looped")(h)
    h = keras.layers.Dense(300, use_bias=False, name="logits")(h)
    return keras.Model(tokens, keras.layers.Dense(8, use_bias=False, name="small")(h))


def _operators(path) -> set[int]:
    from tensorflow.lite.python import schema_py_generated as schema

    model = schema.Model.GetRootAs(path.read_bytes(), 0)
    found = set()
    for s in range(model.SubgraphsLength()):
        subgraph = model.Subgraphs(s)
        for o in range(subgraph.OperatorsLength()):
            code = model.OperatorCodes(subgraph.Operators(o).OpcodeIndex())
            found.add(max(code.BuiltinCode(), code.DeprecatedBuiltinCode()))
    return found


def test_large_markers_filled_by_operations_become_the_matrices_buffers(tmp_path):
    from tensorflow.lite.python import schema_py_generated as schema

    model = _wide_model()
    tokens = np.array([[1, 299, 3], [150, 0, 42]], np.int32)
    marked = litert_weights.marks(model)
    path = tmp_path / "m.tflite"
    _convert(model, marked, path, tokens, large=True)
    assert schema.BuiltinOperator.FILL in _operators(path)
    assert path.stat().st_size < 100_000

    placed = litert_unfolded.place(str(path), marked)

    by_name = {each.variable.path.split("/")[0]: each for each in marked}
    large = ("embedding", "hidden", "square", "looped", "logits")
    assert placed == {id(by_name[n]) for n in large}
    assert schema.BuiltinOperator.FILL not in _operators(path)
    written = path.read_bytes()
    embeddings, hidden, square, looped, logits = (
        by_name[n].variable.numpy() for n in large
    )
    # Each matrix once, as the operation reading it wants it: the table as
    # it is, the fully connected layers' weights transposed.
    assert written.count(embeddings.tobytes()) == 1
    for kernel in (hidden, square, looped, logits):
        assert written.count(np.ascontiguousarray(kernel.T).tobytes()) == 1
    assert litert_weights.fill(str(path), marked, placed)

    small = by_name["small"].variable.numpy()
    bias = model.get_layer("hidden").bias.numpy()
    h = np.maximum(embeddings[tokens] @ hidden + bias, 0) @ square @ looped @ looped
    want = h @ logits @ small
    np.testing.assert_allclose(_run(path, tokens), want, rtol=1e-4, atol=1e-4)


def test_a_large_square_marker_read_otherwise_is_not_placed(tmp_path):
    """The same past the unfolding size: the FILL's readings do not tell."""
    model = _square_table_model(256)
    marked = litert_weights.marks(model)
    path = tmp_path / "m.tflite"
    _convert(model, marked, path, np.array([[1, 4, 0]], np.int32), large=True)
    written = path.read_bytes()

    assert litert_unfolded.place(str(path), marked) is None
    assert path.read_bytes() == written
