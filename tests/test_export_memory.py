"""What an export leaves in the exporting process: none of the graphs it
traced (the artifact's function, the loop its check ran as the reference),
so its fresh-process check runs beside the model alone (docs/export.md,
"Large models"), and none while LiteRT's converter runs beside it; the
loops the user's own `generate` compiled stay."""

from __future__ import annotations

import gc

import keras
import numpy as np
import pytest

import keras_selfattn
from keras_selfattn import SelfAttention
from keras_selfattn.export import export_generator, formats
from keras_selfattn.export.formats import _base

# Each test exports a generator and checks it in a fresh process (20-30 s).
pytestmark = [
    pytest.mark.tensorflow_only("TensorFlow's traced graphs"),
    pytest.mark.slow,
]

VOCABULARY, FEATURES = 24, 8


def _silu_model() -> keras.Model:
    """A token model whose feed-forward layer is a SiLU, as keras-hub's
    Llama's: TensorFlow's `tf.nn.silu` has a custom gradient."""
    keras.utils.set_random_seed(0)
    tokens = keras.Input((None,), dtype="int32", name="tokens")
    h = keras.layers.Embedding(VOCABULARY, FEATURES)(tokens)
    h = keras.layers.Add()([h, SelfAttention(num_heads=2, causal=True)(h)])
    h = keras.layers.Add()([h, keras.layers.Dense(FEATURES, activation="silu")(h)])
    return keras.Model(tokens, keras.layers.Dense(VOCABULARY)(h))


def _graphs() -> dict[int, object]:
    """TensorFlow's traced graphs alive now, by id."""
    from tensorflow.python.framework.func_graph import FuncGraph

    gc.collect()
    return {id(o): o for o in gc.get_objects() if isinstance(o, FuncGraph)}


def _registered() -> set[str]:
    return set(_base._gradient_registry())


@pytest.mark.parametrize("export_format", ["saved_model", "onnx"])
def test_a_generator_export_keeps_no_graph_it_traced(tmp_path, export_format):
    model = _silu_model()
    prompts = np.array([[1, 2, 3]], np.int32)
    # The user's own generate: its compiled loop is kept for the next call.
    keras_selfattn.generate(model, prompts, 2, max_length=8, jit_compile=False)
    users = _graphs()
    assert any(g.name == "generate" for g in users.values())
    registered = _registered()

    saved_model = export_format == "saved_model"
    path = tmp_path / ("models" if saved_model else "g.onnx")
    options = {"name": "g"} if saved_model else {}
    export_generator(model, str(path), export_format, max_length=8, **options)

    after = _graphs()
    new = [g.name for key, g in after.items() if key not in users]
    assert not new, f"graphs the export traced, still alive: {new[:5]}"
    assert set(users) <= set(after), "the user's compiled generate was dropped"
    # Tracing registered custom gradients (the SiLU's); none is left.
    assert _registered() == registered


def test_the_litert_converter_runs_beside_no_traced_graph_and_registers_none(
    tmp_path, monkeypatch
):
    """The converter's process starts once the generator's SavedModel is
    written and the graphs traced for it are dropped: only the user's
    compiled `generate` is alive beside it. The SavedModel holds no custom
    gradient (the SiLU's), so loading it, as the converter does, registers
    none to keep its functions alive."""
    import tensorflow as tf

    from keras_selfattn.export.formats import litert_process

    model = _silu_model()
    keras_selfattn.generate(model, np.array([[1, 2]], np.int32), 2, max_length=8)
    users, registered = _graphs(), _registered()
    seen = []
    convert = litert_process.convert

    def watched(saved, *args, **kwargs):
        alive = [g.name for key, g in _graphs().items() if key not in users]
        before_load = _registered()
        tf.saved_model.load(saved)
        seen.append((alive, before_load, _registered()))
        return convert(saved, *args, **kwargs)

    monkeypatch.setattr(litert_process, "convert", watched)
    export_generator(model, str(tmp_path / "g.tflite"), "litert", max_length=8)
    assert seen, "the converter was not started"
    for alive, before_load, after_load in seen:
        assert not alive, f"graphs traced for the file, alive: {alive[:5]}"
        assert before_load == registered
        assert after_load == registered, "loading the SavedModel registered gradients"


def test_released_drops_only_the_registrations_made_within():
    import tensorflow as tf

    def traced_silu():
        function = tf.function(lambda x: tf.nn.silu(x))
        function.get_concrete_function(tf.TensorSpec([2], tf.float32))
        return function

    kept = traced_silu()
    before = _registered()
    with formats.released(keras.Sequential()):
        dropped = traced_silu()
        within = _registered() - before
        assert within, "tracing tf.nn.silu registered no custom gradient"
        graph = dropped.get_concrete_function(tf.TensorSpec([2], tf.float32)).graph
        graph_id = id(graph)
        del graph, dropped
    assert _registered() == before
    assert graph_id not in _graphs()
    # The registration made before the block still serves its gradient.
    x = tf.constant([0.5, -1.0])
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = kept(x)
    sigmoid = 1 / (1 + np.exp(-x.numpy()))
    want = sigmoid * (1 + x.numpy() * (1 - sigmoid))
    np.testing.assert_allclose(tape.gradient(y, x).numpy(), want, rtol=1e-6)
