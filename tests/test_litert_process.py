"""The LiteRT converter's own process: a conversion the machine cannot hold is
refused before it starts, one that runs the machine short is stopped, and a
converter's failure keeps its telling line; each is one line and leaves
nothing on disk. The check's runtime opens one interpreter per file, shared
by the signatures it runs."""

from __future__ import annotations

import os

import numpy as np
import pytest

from keras_selfattn.export import ExportError, export_generator
from keras_selfattn.export.formats import litert_process, litert_weights
from tests.test_generation import token_model

pytestmark = pytest.mark.tensorflow_only("the generator's loop in a TensorFlow graph")


def test_needed_memory_scales_with_the_weights():
    assert litert_process.needed_bytes(0) == litert_process.BASE_BYTES
    assert litert_process.needed_bytes(2**30) == pytest.approx(
        litert_process.BASE_BYTES + litert_process.NEEDED_PER_WEIGHT_BYTE * 2**30, abs=1
    )
    unfolded = litert_process.needed_bytes(2**30, unfolded=True)
    assert unfolded == pytest.approx(
        litert_process.UNFOLDED_BASE_BYTES
        + litert_process.UNFOLDED_PER_WEIGHT_BYTE * 2**30,
        abs=1,
    )
    # Measured (docs/export.md): the unfolded converter's peaks at 0.59 B
    # and 1.24 B fit under the reckoning, which is under the expanded one's.
    gib = 2**30
    assert litert_process.needed_bytes(int(2.21 * gib), True) >= 4.43 * gib
    assert litert_process.needed_bytes(int(4.60 * gib), True) >= 6.65 * gib
    assert litert_process.needed_bytes(int(4.60 * gib), True) < (
        litert_process.needed_bytes(int(4.60 * gib))
    )


def test_available_memory_is_read_on_linux():
    available = litert_process.available_bytes()
    if not os.path.exists("/proc/meminfo"):
        assert available is None
        return
    assert 0 < available <= os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def test_a_conversion_past_the_available_memory_is_refused_before_it_starts(
    monkeypatch, tmp_path
):
    def unconverted(*args, **kwargs):
        raise AssertionError("the converter started")

    monkeypatch.setattr(litert_process, "available_bytes", lambda: 3 * 2**30)
    monkeypatch.setattr(litert_process, "BASE_BYTES", 3 * 2**30)
    monkeypatch.setattr(litert_process.subprocess, "Popen", unconverted)
    with pytest.raises(ExportError) as error:
        export_generator(token_model(), tmp_path / "lm.tflite", "litert", max_length=8)
    message = str(error.value)
    assert "\n" not in message
    assert "needs about 3.0 GiB" in message
    assert "has 3.0 GiB available" in message
    assert "ONNX" in message and "SavedModel" in message
    assert not os.listdir(tmp_path)


# The converter's process starts (TensorFlow imported): about 10 s each.
@pytest.mark.slow
def test_a_conversion_running_the_machine_short_is_stopped(monkeypatch, tmp_path):
    readings = iter([64 * 2**30])  # enough at the check, then short

    monkeypatch.setattr(
        litert_process, "available_bytes", lambda: next(readings, 2**20)
    )
    with pytest.raises(ExportError) as error:
        export_generator(token_model(), tmp_path / "lm.tflite", "litert", max_length=8)
    message = str(error.value)
    assert "\n" not in message
    assert "stopped when this machine's available memory fell to 0.0 GiB" in message
    assert not os.listdir(tmp_path)


@pytest.mark.slow
def test_the_converter_failure_keeps_its_line(tmp_path):
    with pytest.raises(RuntimeError, match="error: OSError: .*not-a-saved-model"):
        litert_process.convert(
            str(tmp_path / "not-a-saved-model"),
            str(tmp_path / "lm.tflite"),
            ["generate"],
            large=False,
            weights=0,
        )
    assert not (tmp_path / "lm.tflite").exists()


def test_the_signatures_of_one_file_share_one_interpreter(tmp_path):
    """The fresh-process check opens each signature it runs: one interpreter
    holds the file's weights for all of them."""
    import numpy as np
    import tensorflow as tf

    from keras_selfattn_runtimes import litert as runtime

    module = tf.Module()
    module.w = tf.Variable(np.arange(16, dtype=np.float32).reshape(4, 4))
    spec = [tf.TensorSpec((1, 4), tf.float32, name="x")]
    double = tf.function(lambda x: {"y": tf.matmul(x, module.w) * 2}, spec)
    triple = tf.function(lambda x: {"y": tf.matmul(x, module.w) * 3}, spec)
    saved = str(tmp_path / "saved")
    tf.saved_model.save(module, saved, signatures={"double": double, "triple": triple})
    path = str(tmp_path / "m.tflite")
    with open(path, "wb") as file:
        file.write(tf.lite.TFLiteConverter.from_saved_model(saved).convert())
    first, second = runtime.load(path, "double"), runtime.load(path, "triple")
    assert first._runner._interpreter is second._runner._interpreter
    x = np.array([[1, 2, 3, 4]], np.float32)
    w = np.arange(16, dtype=np.float32).reshape(4, 4)
    np.testing.assert_allclose(first({"x": x})["y"], 2 * x @ w)
    np.testing.assert_allclose(second({"x": x})["y"], 3 * x @ w)
    np.testing.assert_allclose(first({"x": x})["y"], 2 * x @ w)


@pytest.mark.slow
def test_a_generator_whose_marker_is_folded_is_converted_again_with_its_weights(
    tmp_path, monkeypatch
):
    """A LoRA-enabled head reads its kernel plus the adapters' product, which
    the converter folds into one constant: the markers cannot be told apart,
    the generator is converted again with the weights, and the export's
    fresh-process check gets Keras's tokens."""
    filled = []
    fill = litert_weights.fill

    def recorded(path, marked, placed):
        filled.append(fill(path, marked, placed))
        return filled[-1]

    monkeypatch.setattr(litert_weights, "fill", recorded)
    model = token_model()
    model.get_layer("logits").enable_lora(2)
    b = model.get_layer("logits").lora_kernel_b
    b.assign(np.random.default_rng(0).normal(size=b.shape).astype("float32"))
    export_generator(model, tmp_path / "lm.tflite", "litert", max_length=8)
    assert filled == [False]
    assert (tmp_path / "lm.tflite").exists()


def _converters() -> list:
    """This process's converter processes now running."""
    import psutil

    return [
        child
        for child in psutil.Process().children(recursive=True)
        if any(part.endswith("litert_process.py") for part in child.cmdline())
    ]


class _Stopped(BaseException):
    """Raised by the work run beside a converter."""


@pytest.mark.slow
def test_the_work_beside_the_converter_runs_while_it_converts_outside_its_modes(
    tmp_path,
):
    """`meanwhile` runs while the converter's process is alive, without the
    conversion's tracing modes; an exception out of it stops the converter
    and comes out of `convert`, which otherwise fails as the converter did."""
    from keras_selfattn import tracing

    seen = []

    def work():
        seen.append((len(_converters()), tracing.active(tracing.FOR_CONVERTER)))

    arguments = (str(tmp_path / "not-a-saved-model"), str(tmp_path / "lm.tflite"))
    with tracing.traced_as(tracing.FOR_CONVERTER):
        with pytest.raises(RuntimeError, match="error: OSError: .*not-a-saved-model"):
            litert_process.convert(
                *arguments, ["generate"], large=False, weights=0, meanwhile=work
            )
        assert seen == [(1, False)]

        def stopped():
            raise _Stopped

        with pytest.raises(_Stopped):
            litert_process.convert(
                *arguments, ["generate"], large=False, weights=0, meanwhile=stopped
            )
    assert _converters() == []
    assert not (tmp_path / "lm.tflite").exists()


@pytest.mark.slow
@pytest.mark.parametrize("how", ["foreseen", "not_foreseen", "command_line"])
def test_the_checks_references_are_computed_while_the_converter_runs(
    tmp_path, monkeypatch, how
):
    """The generator's check computes its Keras references once, while the
    converter's process runs, for the rows the file allows, as the library
    and the command line export it; where the rows were not foreseen
    (`expected_generator_rows`), the check computes them again for the
    file's own, and the tokens are checked either way."""
    from keras_selfattn.export import generator
    from keras_selfattn.export.formats import litert
    from keras_selfattn.export.generator import check
    from keras_selfattn_cli import main

    computed = []
    references = check.references

    def recorded(generator_, seed, rows, paired):
        computed.append((rows, paired, len(_converters())))
        return references(generator_, seed, rows, paired)

    monkeypatch.setattr(generator, "references", recorded)
    monkeypatch.setattr(check, "references", recorded)
    if how == "not_foreseen":
        monkeypatch.setattr(
            litert.LiteRTFormat, "expected_generator_rows", lambda self, weights: 2
        )
    path = tmp_path / "lm.tflite"
    if how == "command_line":
        token_model().save(tmp_path / "lm.keras")
        argv = ["export", tmp_path / "lm.keras", "--generate", "--max-length", "8"]
        assert main([str(a) for a in [*argv, "--litert", path]]) == 0
    else:
        export_generator(token_model(), path, "litert", max_length=8)
    rows = check.ROWS
    if how == "not_foreseen":
        assert computed == [(2, True, 1), (rows, True, 0)]
    else:
        assert computed == [(rows, True, 1)]
    assert path.exists()
