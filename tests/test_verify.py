"""verify(): the parity report, and that it catches exports that differ."""

from __future__ import annotations

import os

import keras
import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from keras_selfattn import SelfAttention
from keras_selfattn.export import (
    ParityError,
    ParityReport,
    ParityRow,
    export_onnx,
    export_saved_model,
    verify,
)
from tests import model_zoo

pytestmark = pytest.mark.tensorflow_only(
    "ONNX export through tf2onnx and SavedModel loading"
)

DEFAULT_LABELS = ["1x1", "2x33 padded", "3x128 padded", "2x512 padded"]


@pytest.fixture(scope="module")
def classifier_exports(tmp_path_factory):
    """masked_classifier (seed 0) as SavedModel and ONNX."""
    base = tmp_path_factory.mktemp("verify")
    model = model_zoo.masked_classifier(seed=0)
    version_dir = export_saved_model(model, base / "serving", "clf", check=False)
    onnx_path = export_onnx(model, base / "clf.onnx", check=False)
    return model, version_dir, onnx_path


def _unmasked_twin(model: keras.Model) -> keras.Model:
    """masked_classifier's layers without any mask: equal on unpadded input."""
    tokens = keras.Input((None,), dtype="int32", name="tokens")
    x = keras.layers.Embedding(model_zoo.VOCAB, model_zoo.FEATURES)(tokens)
    x = SelfAttention(num_heads=2)(x)
    x = keras.layers.GlobalAveragePooling1D()(x)
    outputs = keras.layers.Dense(3, activation="softmax", name="probabilities")(x)
    twin = keras.Model(tokens, outputs)
    twin.set_weights(model.get_weights())
    return twin


def _count_float64_views(monkeypatch) -> list:
    """Records each float64 reference built (`precision.float64_view`)."""
    from keras_selfattn.export import precision

    built, real = [], precision.float64_view

    def counted(model):
        built.append(model)
        return real(model)

    monkeypatch.setattr(precision, "float64_view", counted)
    return built


def test_report_of_faithful_exports(classifier_exports, monkeypatch):
    model, version_dir, onnx_path = classifier_exports
    built = _count_float64_views(monkeypatch)
    report = verify(model, version_dir, onnx_path)
    assert built == []  # within the tolerance: no float64 reference computed
    assert isinstance(report, ParityReport) and report.ok
    assert [(r.runtime, r.shape) for r in report.rows] == [
        (runtime, label)
        for label in DEFAULT_LABELS
        for runtime in ("saved_model", "onnx")
    ]
    assert all(0 <= r.max_abs_err <= 1e-5 for r in report.rows)
    assert (report.atol, report.rtol) == (1e-5, 1e-4)
    lines = str(report).splitlines()
    assert lines[0].split() == "runtime shape max abs err max rel err ok".split()
    assert len(lines) == 2 + len(report.rows) + 1
    assert lines[2].split()[:2] == ["saved_model", "1x1"]
    assert lines[2].split()[-1] == "yes"
    assert str(report) == report.table()


def test_report_table_rendering():
    report = ParityReport(
        (
            ParityRow("onnx", "2x33", 1.5e-7, 3e-5, True),
            ParityRow("saved_model", "1x1", 2e-3, 0.5, False),
        ),
        atol=1e-5,
        rtol=1e-4,
    )
    assert report.table().splitlines() == [
        "runtime      shape  max abs err  max rel err  ok",
        "-----------  -----  -----------  -----------  ---",
        "onnx         2x33   1.50e-07     3.00e-05     yes",
        "saved_model  1x1    2.00e-03     5.00e-01     NO",
        "tolerance: |err| <= 1e-05 + 0.0001 * |keras|",
    ]
    assert not report.ok and report.failures == (report.rows[1],)


def test_report_table_with_rows_judged_against_float64():
    report = ParityReport(
        (
            ParityRow("onnx", "1x1", 1.5e-7, 3e-5, True),
            ParityRow(
                "onnx",
                "2x512",
                2e-3,
                0.5,
                True,
                None,
                None,
                "",
                None,
                1.1,
                2.2e-3,
                2e-3,
            ),
        ),  # fmt: skip
        atol=1e-5,
        rtol=1e-4,
    )
    lines = report.table().splitlines()
    assert lines[0].endswith("ok   vs float64  keras vs float64  rms ratio")
    assert lines[2].split()[-3:] == ["-", "-", "-"]
    assert lines[3].split()[-4:] == ["yes", "2.20e-03", "2.00e-03", "1.10"]
    assert lines[-1] == (
        "rows beyond it judged against the model in float64, over all the shapes: "
        "rms <= 1.5 x keras's own (rms ratio) + 1e-05, each element <= 3 x keras's "
        "largest + 1e-05 + 0.0001 * |float64|"
    )


def test_custom_shapes(classifier_exports):
    model, _, onnx_path = classifier_exports
    report = verify(model, onnx_path=onnx_path, shapes=[(1, 7), (5, 3)])
    assert [(r.runtime, r.shape) for r in report.rows] == [
        ("onnx", "1x7"),
        ("onnx", "5x3 padded"),
    ]


@pytest.mark.slow  # 9 s: eight runs of both files; the padding case is fast
def test_export_of_other_weights_is_caught(classifier_exports):
    _, version_dir, onnx_path = classifier_exports
    other = model_zoo.masked_classifier(seed=1)
    with pytest.raises(ParityError, match="differ from Keras") as caught:
        verify(other, version_dir, onnx_path)
    message = str(caught.value)
    assert "\n" not in message and "max abs err" in message
    report = caught.value.report
    assert len(report.rows) == 8 and not any(row.ok for row in report.rows)
    assert min(row.max_abs_err for row in report.rows) > 1e-3


def test_export_that_ignores_padding_fails_only_on_padded_shapes(tmp_path):
    # An export that drops the padding mask equals Keras on unpadded inputs:
    # only the padded shapes can reveal it, and they must.
    model = model_zoo.masked_classifier(seed=0)
    path = export_onnx(_unmasked_twin(model), tmp_path / "unmasked.onnx", check=False)
    with pytest.raises(ParityError) as caught:
        verify(model, onnx_path=path)
    rows = {row.shape: row.ok for row in caught.value.report.rows}
    assert rows == {
        "1x1": True,
        "2x33 padded": False,
        "3x128 padded": False,
        "2x512 padded": False,
    }


def _shift_initializer(source, target, value: np.ndarray, delta: float) -> str:
    """Copies ONNX file `source` to `target` with the initializer equal to
    `value` shifted by `delta`: an export that is wrong by a known amount."""
    proto = onnx.load(os.fspath(source))
    matches = [
        init
        for init in proto.graph.initializer
        if np.array_equal(numpy_helper.to_array(init), value)
    ]
    assert len(matches) == 1, f"{len(matches)} initializers equal {value}"
    (init,) = matches
    shifted = (numpy_helper.to_array(init) + delta).astype(value.dtype)
    init.CopyFrom(numpy_helper.from_array(shifted, init.name))
    onnx.save(proto, os.fspath(target))
    return os.fspath(target)


@pytest.fixture(scope="module")
def causal_onnx(tmp_path_factory):
    """causal_multihead (seed 0) as ONNX."""
    model = model_zoo.causal_multihead(seed=0)
    base = tmp_path_factory.mktemp("causal")
    return model, export_onnx(model, base / "exact.onnx", check=False)


def test_tolerance_is_applied(causal_onnx, tmp_path):
    # The output bias is added last (no mask, no activation): shifting it by
    # DELTA in the ONNX file shifts every output element by DELTA, so verify
    # must see DELTA itself, whatever either runtime rounds.
    delta = 2.0**-10
    model, path = causal_onnx
    bias = keras.ops.convert_to_numpy(model.get_layer("causal_attention").output_bias)
    shifted = _shift_initializer(path, tmp_path / "shifted.onnx", bias, delta)
    shapes = [(3, 40)]

    loose = verify(model, onnx_path=shifted, shapes=shapes, atol=2 * delta, rtol=0)
    (row,) = loose.rows
    assert row.ok and abs(row.max_abs_err - delta) < 1e-6, row
    for atol, rtol in ((delta / 2, 0.0), (0.0, 0.0)):
        with pytest.raises(ParityError, match="differ from Keras") as caught:
            verify(model, onnx_path=shifted, shapes=shapes, atol=atol, rtol=rtol)
        (strict,) = caught.value.report.rows
        assert not strict.ok and strict.max_abs_err == row.max_abs_err
        # Nor does the float64 reference accept it: Keras is ~1e-7 from it.
        assert strict.keras_float64_err < 1e-6 < delta / 2 < strict.float64_err
    # The unshifted export is within the default tolerance, far below DELTA.
    (exact,) = verify(model, onnx_path=path, shapes=shapes).rows
    assert exact.ok and exact.max_abs_err < delta / 100
    assert exact.float64_err is None  # the tolerance sufficed


def test_rows_beyond_the_tolerance_are_judged_against_float64(causal_onnx, monkeypatch):
    """With no tolerance at all, ONNX Runtime's float32 rounding is beyond
    it; the export passes as no further from the model in float64 than
    Keras is, the reference built once for every run."""
    model, path = causal_onnx
    built = _count_float64_views(monkeypatch)
    report = verify(model, onnx_path=path, shapes=[(3, 40), (2, 9)], atol=0, rtol=0)
    assert report.ok, report.table()
    assert len(built) == 1
    for row in report.rows:
        assert row.max_abs_err > 0 and row.float64_err is not None, row
        assert 0 < row.keras_float64_err < 1e-5 and row.float64_err < 1e-5, row
    assert "vs float64" in report.table()


def test_an_unavailable_float64_reference_leaves_the_tolerance(
    causal_onnx, monkeypatch
):
    from keras_selfattn.export import precision

    def refuse(model):
        raise ValueError("no float64 kernel")

    monkeypatch.setattr(precision, "float64_view", refuse)
    model, path = causal_onnx
    with pytest.raises(ParityError, match="differ from Keras") as caught:
        verify(model, onnx_path=path, shapes=[(2, 9)], atol=0, rtol=0)
    report = caught.value.report
    assert [row.float64_err for row in report.rows] == [None]
    assert report.notes == (
        "rows beyond the tolerance, no float64 reference: no float64 kernel",
    )
    assert str(report).endswith(report.notes[0])


def test_attention_outputs_are_compared(tmp_path):
    model = model_zoo.causal_multihead(seed=0)
    path = export_onnx(model, tmp_path / "m.onnx", attention_outputs="causal_attention")
    report = verify(model, onnx_path=path, attention_outputs="causal_attention")
    assert report.ok
    with pytest.raises(ParityError, match="lacks the model's outputs"):
        verify(model, onnx_path=path, attention_outputs={"causal_attention": "w"})


def test_input_name_mismatch_is_reported(classifier_exports):
    _, _, onnx_path = classifier_exports
    tokens = keras.Input((None,), dtype="int32", name="ids")
    x = keras.layers.Embedding(model_zoo.VOCAB, 8, mask_zero=True)(tokens)
    renamed = keras.Model(tokens, keras.layers.Dense(3, name="probabilities")(x[:, 0]))
    with pytest.raises(ParityError, match=r"lacks the model's inputs \['ids'\]"):
        verify(renamed, onnx_path=onnx_path)


def test_bad_arguments(classifier_exports, tmp_path):
    model, _, onnx_path = classifier_exports
    with pytest.raises(ValueError, match="saved_model_dir=None, onnx_path=None"):
        verify(model)
    for shapes in ([(0, 3)], [(2,)], [], [(1.5, 2)], "1x1"):
        with pytest.raises(ValueError, match="shapes"):
            verify(model, onnx_path=onnx_path, shapes=shapes)
    with pytest.raises(ValueError, match="atol=-1"):
        verify(model, onnx_path=onnx_path, atol=-1)
    with pytest.raises(ValueError, match="finite.*rtol=nan"):
        verify(model, onnx_path=onnx_path, rtol=float("nan"))
    with pytest.raises(FileNotFoundError, match="missing.onnx"):
        verify(model, onnx_path=tmp_path / "missing.onnx")
    with pytest.raises(FileNotFoundError, match="nowhere"):
        verify(model, saved_model_dir=tmp_path / "nowhere")


def test_runtime_that_fails_where_keras_runs(tmp_path):
    # Same names, but the ONNX graph wants int64 tokens: onnxruntime refuses
    # the model's int32 inputs, which verify reports as a parity failure.
    model = model_zoo.masked_classifier(seed=0)
    tokens = keras.Input((None,), dtype="int64", name="tokens")
    x = keras.layers.Embedding(model_zoo.VOCAB, model_zoo.FEATURES)(tokens)
    x = keras.layers.GlobalAveragePooling1D()(x)
    int64_model = keras.Model(tokens, keras.layers.Dense(3, name="probabilities")(x))
    path = export_onnx(int64_model, tmp_path / "int64.onnx", check=False)
    with pytest.raises(ParityError, match="onnx failed on 1x1 inputs where Keras runs"):
        verify(model, onnx_path=path)


@pytest.mark.slow  # broken files of every format: 9 s
def test_unloadable_artifacts(classifier_exports, tmp_path):
    model, version_dir, _ = classifier_exports
    (tmp_path / "garbage.onnx").write_bytes(b"not a protobuf")
    with pytest.raises(ValueError, match="Cannot load ONNX model .*garbage.onnx"):
        verify(model, onnx_path=tmp_path / "garbage.onnx")
    base_dir = os.path.dirname(os.path.dirname(version_dir))
    with pytest.raises(FileNotFoundError, match="pass a version folder"):
        verify(model, saved_model_dir=base_dir)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "saved_model.pb").write_bytes(b"not a protobuf")
    with pytest.raises(ValueError, match="Cannot load SavedModel .*broken"):
        verify(model, saved_model_dir=broken)


def test_fixed_length_model_reports_the_shapes_it_ran(tmp_path):
    rows = keras.Input((8, 4), name="rows")
    model = keras.Model(rows, SelfAttention(num_heads=2, name="attention")(rows))
    path = export_onnx(model, tmp_path / "fixed.onnx", check=False)
    report = verify(model, onnx_path=path)
    assert [row.shape for row in report.rows] == ["1x8", "2x8", "3x8"]
