"""keras-selfattn: export and verify from .keras files; one-line errors.

The cases call `main(argv)` in-process (fast); tests/test_cli_startup.py
runs the console script's entry point in subprocesses.
"""

from __future__ import annotations

import contextlib
import io
import os
import zipfile

import keras
import numpy as np
import onnxruntime
import pytest
import tensorflow as tf

from keras_selfattn import SelfAttention
from keras_selfattn_cli import main
from tests import model_zoo
from tests.files import tree_digest

pytestmark = pytest.mark.tensorflow_only("the CLI fixture exports ONNX through tf2onnx")


def run(argv, capsys) -> tuple[int, str, str]:
    status = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def assert_one_line_error(err: str, *fragments: str) -> None:
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("keras-selfattn: error: "), err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, err)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A folder with clf.keras exported once to SavedModel and ONNX by the
    CLI, with the export's exit status and printed output."""
    root = tmp_path_factory.mktemp("cli")
    model = model_zoo.masked_classifier(seed=0)
    model.save(root / "clf.keras")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        status = main(
            [
                "export",
                str(root / "clf.keras"),
                "--saved-model",
                str(root / "serving"),
                "--warmup",
                "--onnx",
                str(root / "clf.onnx"),
            ]
        )
    return root, model, status, printed.getvalue()


@pytest.fixture(scope="module")
def work(exported):
    """(folder, model, exit status) of `exported`."""
    return exported[:3]


def test_export_writes_both_and_they_match_keras(work):
    root, model, status = work
    assert status == 0
    version_dir = root / "serving" / "clf" / "1"
    assert (version_dir / "saved_model.pb").is_file()
    assert (version_dir / "assets.extra" / "tf_serving_warmup_requests").is_file()
    assert (root / "serving" / "models.config").is_file()
    tokens = model_zoo.sample_inputs(model, 3, 21, seed=7)["tokens"]
    expected = model.predict(tokens, verbose=0)
    signature = tf.saved_model.load(str(version_dir)).signatures["serving_default"]
    served = signature(tokens=tf.constant(tokens))["probabilities"].numpy()
    session = onnxruntime.InferenceSession(
        str(root / "clf.onnx"), providers=["CPUExecutionProvider"]
    )
    (from_onnx,) = session.run(None, {"tokens": tokens})
    np.testing.assert_allclose(served, expected, atol=1e-5)
    np.testing.assert_allclose(from_onnx, expected, atol=1e-5)


def test_export_prints_steps_and_parity_table(tmp_path, work, capsys):
    root, _, _ = work
    status, out, err = run(
        ["export", root / "clf.keras", "--onnx", tmp_path / "x.onnx", "--opset", "18"],
        capsys,
    )
    assert status == 0 and err == ""
    steps = [line for line in out.splitlines() if " ... " in line]
    assert steps[0].startswith(
        f"Loading {root / 'clf.keras'} (safe_mode=True) ... done"
    )
    assert steps[1].startswith("Exporting ONNX (opset 18)") and "done" in steps[1]
    assert steps[2].startswith("Verifying against Keras ... done")
    table = out[out.index("\nruntime ") + 1 :].splitlines()
    assert [line.split()[:2] for line in table[2:6]] == [
        ["onnx", "1x1"],
        ["onnx", "2x33"],
        ["onnx", "3x128"],
        ["onnx", "2x512"],
    ]
    assert all(line.split()[-1] == "yes" for line in table[2:6])


@pytest.mark.slow  # verifies both exports again in their runtimes: 20 s
def test_verify_command(work, capsys):
    root, _, _ = work
    status, out, err = run(
        [
            "verify",
            root / "clf.keras",
            "--saved-model",
            root / "serving" / "clf" / "1",
            "--onnx",
            root / "clf.onnx",
        ],
        capsys,
    )
    assert status == 0 and err == ""
    rows = [
        line.split() for line in out.splitlines() if line.startswith(("onnx", "saved"))
    ]
    assert len(rows) == 8 and {row[0] for row in rows} == {"saved_model", "onnx"}
    assert all(row[-1] == "yes" for row in rows)


@pytest.mark.slow  # a second SavedModel export and check: 18 s
def test_name_and_version_options(tmp_path, work, capsys):
    root, _, _ = work
    status, out, _ = run(
        [
            "export",
            root / "clf.keras",
            "--saved-model",
            tmp_path,
            "--name",
            "classifier",
            "--version",
            "4",
        ],
        capsys,
    )
    assert status == 0
    assert f"wrote {tmp_path / 'classifier' / '4'}" in out
    assert sorted(os.listdir(tmp_path / "classifier")) == ["4"]


def test_verify_reports_a_model_that_differs(work, tmp_path, capsys):
    root, _, _ = work
    model_zoo.masked_classifier(seed=1).save(tmp_path / "other.keras")
    status, out, err = run(
        ["verify", tmp_path / "other.keras", "--onnx", root / "clf.onnx"], capsys
    )
    assert status == 1
    assert "NO" in out  # the table is still printed
    assert_one_line_error(err, "differ from Keras", "max abs err")


# ---------------------------------------------------------------- bad input
@pytest.fixture(scope="module")
def bad_files(work):
    root, model, _ = work
    bad = root / "bad"
    bad.mkdir()
    (bad / "garbage.keras").write_text("this is not a model")
    data = (root / "clf.keras").read_bytes()
    (bad / "truncated.keras").write_bytes(data[: len(data) // 2])
    with zipfile.ZipFile(bad / "notes.keras", "w") as archive:
        archive.writestr("README.txt", "a zip, but not a Keras model")
    layer = keras.layers.Dense(2)
    layer.build((None, 3))
    keras.saving.save_model(layer, bad / "layer.keras")
    inputs = keras.Input((4,), name="x")
    lambda_model = keras.Model(inputs, keras.layers.Lambda(lambda t: t * 2)(inputs))
    lambda_model.save(bad / "lambda.keras")
    (bad / "a_file").write_text("blocks a directory")
    return bad


@pytest.mark.parametrize(
    "argv, fragments",
    [
        (
            ["export", "{bad}/missing.keras", "--onnx", "{tmp}/m.onnx"],
            ["model file not found", "missing.keras"],
        ),
        (["export", "{bad}", "--onnx", "{tmp}/m.onnx"], ["model path is not a file"]),
        (
            ["export", "{bad}/garbage.keras", "--onnx", "{tmp}/m.onnx"],
            ["garbage.keras is corrupt or not a Keras model"],
        ),
        (
            ["verify", "{bad}/truncated.keras", "--onnx", "{root}/clf.onnx"],
            ["truncated.keras is corrupt"],
        ),
        (
            ["export", "{bad}/notes.keras", "--onnx", "{tmp}/m.onnx"],
            ["cannot load", "notes.keras as a Keras model"],
        ),
        (
            ["export", "{bad}/layer.keras", "--onnx", "{tmp}/m.onnx"],
            ["holds a Dense, not a keras.Model"],
        ),
        (
            ["export", "{bad}/lambda.keras", "--onnx", "{tmp}/m.onnx"],
            ["cannot load", "safe_mode"],
        ),
        (
            [
                "export",
                "{root}/clf.keras",
                "--saved-model",
                "{root}/serving",
                "--version",
                "1",
            ],
            ["version 1 of 'clf' already exists"],
        ),
        (
            ["export", "{root}/clf.keras", "--onnx", "{root}/clf.onnx"],
            ["already exists", "clf.onnx"],
        ),
        (
            ["export", "{root}/clf.keras", "--saved-model", "{bad}/a_file/serving"],
            ["Not a directory", "a_file"],
        ),
        (
            ["export", "{root}/clf.keras", "--onnx", "{bad}/a_file/m.onnx"],
            ["Not a directory", "a_file"],
        ),
        (
            ["export", "{root}/clf.keras", "--onnx", "{tmp}/m.onnx", "--opset", "19"],
            ["Unsupported ONNX opset 19", "13 to 18"],
        ),
        (
            ["export", "{root}/clf.keras", "--onnx", "{tmp}/m.onnx", "--opset", "12"],
            ["Unsupported ONNX opset 12"],
        ),
        (
            [
                "export",
                "{root}/clf.keras",
                "--saved-model",
                "{tmp}",
                "--name",
                "../escape",
            ],
            ["`name`", "'../escape'"],
        ),
        (
            ["export", "{root}/clf.keras", "--saved-model", "{tmp}", "--name", "a/b"],
            ["`name`", "'a/b'"],
        ),
        (
            ["export", "{root}/clf.keras", "--saved-model", "{tmp}", "--name", ".."],
            ["`name`", "'..'"],
        ),
        (
            ["export", "{root}/clf.keras", "--saved-model", "{tmp}", "--name", ""],
            ["`name`"],
        ),
        (
            ["verify", "{root}/clf.keras", "--onnx", "{bad}/garbage.keras"],
            ["Cannot load ONNX model", "garbage.keras"],
        ),
        (
            ["verify", "{root}/clf.keras", "--saved-model", "{root}/serving"],
            ["pass a version folder"],
        ),
        (
            ["export", "{root}/clf.keras", "--saved-model", ""],
            ["`--saved-model` must be a non-empty path"],
        ),
        (
            ["export", "{root}/clf.keras", "--onnx", ""],
            ["`--onnx` must be a non-empty"],
        ),
        (
            ["export", "{root}/clf.keras"],
            ["export needs at least one of --saved-model BASE_DIR, --onnx"],
        ),
        (
            ["export", "{root}/clf.keras", "--onnx", "{tmp}/m.onnx", "--warmup"],
            ["need --saved-model"],
        ),
        (
            ["export", "{root}/clf.keras", "--saved-model", "{tmp}", "--generate"],
            ["--generate needs --max-length N"],
        ),
        (
            [
                "export",
                "{root}/clf.keras",
                "--openvino",
                "{tmp}/m.xml",
                "--generate",
                "--max-length",
                "8",
            ],
            ["--generate writes --saved-model, --onnx and --litert", "--openvino"],
        ),
        (
            [
                "export",
                "{root}/clf.keras",
                "--saved-model",
                "{tmp}",
                "--generate",
                "--decode-step",
                "--max-length",
                "8",
            ],
            ["pick one"],
        ),
        (
            ["export", "{root}/clf.keras", "--saved-model", "{tmp}", "--jit-compile"],
            ["--jit-compile needs --generate and --saved-model"],
        ),
        (
            [
                "export",
                "{root}/clf.keras",
                "--saved-model",
                "{tmp}",
                "--generate",
                "--max-length",
                "8",
            ],
            ["Cannot generate with model", "masked_classifier"],
        ),
        (["verify", "{root}/clf.keras"], ["verify needs"]),
        (
            ["verify", "{root}/clf.keras", "--onnx", "{tmp}/none.onnx"],
            ["export not found", "none.onnx"],
        ),
    ],
)
def test_bad_input_one_line_error_nothing_written(
    work, bad_files, tmp_path, capsys, argv, fragments
):
    root, _, _ = work
    places = {"bad": bad_files, "root": root, "tmp": tmp_path}
    before = tree_digest(root), tree_digest(tmp_path)
    status, _, err = run([arg.format(**places) for arg in argv], capsys)
    assert status == 1
    assert_one_line_error(err, *fragments)
    assert "Traceback" not in err
    assert (tree_digest(root), tree_digest(tmp_path)) == before


def test_interrupt_exits_130_and_leaves_nothing(work, tmp_path, capsys, monkeypatch):
    from keras_selfattn.export.formats import saved_model as saved_model_module

    def interrupted(target, directory):
        open(os.path.join(directory, "saved_model.pb"), "wb").close()
        raise KeyboardInterrupt

    monkeypatch.setattr(saved_model_module, "write_saved_model", interrupted)
    root, _, _ = work
    status, _, err = run(
        ["export", root / "clf.keras", "--saved-model", tmp_path / "serving"], capsys
    )
    assert status == 130
    assert_one_line_error(err, "interrupted")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    "argv, fragment",
    [
        ([], "the following arguments are required"),
        (["export"], "MODEL.keras"),
        (["launch", "m.keras"], "invalid choice"),
        (["export", "m.keras", "--version", "0"], "--version: must be positive"),
        (["export", "m.keras", "--version", "x"], "--version: not an integer"),
        (["export", "m.keras", "--opset", "abc"], "--opset"),
        (["verify", "m.keras", "--atol", "-1"], "--atol: must be >= 0"),
    ],
)
def test_usage_errors_exit_2_with_one_line(capsys, argv, fragment):
    with pytest.raises(SystemExit) as caught:
        main(argv)
    assert caught.value.code == 2
    assert_one_line_error(capsys.readouterr().err, fragment)


# ------------------------------------------------------- staged, verified once
def test_export_verifies_every_export_once_before_moving_them_in(exported):
    root, _, status, out = exported
    assert status == 0
    steps = [line.split(" ... ")[0] for line in out.splitlines() if " ... " in line]
    assert [step.split()[0] for step in steps] == [
        "Loading",
        "Exporting",
        "Exporting",
        "Verifying",
    ]
    wrote = [line.split()[1] for line in out.splitlines() if line.startswith("  wrote")]
    assert wrote == [
        str(root / "serving" / "clf" / "1"),
        str(root / "clf.onnx"),
    ]
    assert out.index("Verifying") < out.index("  wrote")
    table = [
        line.split() for line in out.splitlines() if line.startswith(("saved", "onnx"))
    ]
    assert len(table) == 8 and all(row[-1] == "yes" for row in table)


def test_a_failed_export_step_leaves_no_export_at_all(
    work, tmp_path, capsys, monkeypatch
):
    """The SavedModel is staged, the ONNX step fails: neither appears."""
    import onnx

    def disk_full(proto, path):
        raise OSError(28, "No space left on device", path)

    monkeypatch.setattr(onnx, "save", disk_full)
    root, _, _ = work
    argv = ["export", root / "clf.keras", "--saved-model", tmp_path / "serving"]
    status, out, err = run(argv + ["--onnx", tmp_path / "clf.onnx"], capsys)
    assert status == 1
    assert_one_line_error(err, "No space left on device")
    assert "wrote" not in out
    assert os.listdir(tmp_path) == []


@pytest.mark.slow  # two CLI exports racing
def test_a_lost_version_race_leaves_no_secondary_export(
    work, tmp_path, capsys, monkeypatch
):
    """Another export takes the version while this one stages: its rename
    fails, and the ONNX file staged with it never appears either."""
    from keras_selfattn.export.formats import saved_model as saved_model_module

    real_write = saved_model_module.write_saved_model
    version = tmp_path / "serving" / "clf" / "1"

    def write_while_another_export_takes_the_version(target, directory):
        real_write(target, directory)
        version.mkdir(parents=True)
        (version / "saved_model.pb").write_bytes(b"the other export")

    monkeypatch.setattr(
        saved_model_module,
        "write_saved_model",
        write_while_another_export_takes_the_version,
    )
    root, _, _ = work
    argv = ["export", root / "clf.keras", "--saved-model", tmp_path / "serving"]
    status, out, err = run(argv + ["--onnx", tmp_path / "clf.onnx"], capsys)
    assert status == 1
    assert_one_line_error(err, "already exists")
    assert "wrote" not in out
    assert sorted(os.listdir(tmp_path)) == ["serving"]
    assert os.listdir(version) == ["saved_model.pb"]


def test_a_quantized_models_decoding_step_is_refused_in_one_line(tmp_path, capsys):
    """The command makes the library's refusals before any work: a LiteRT
    decoding step of a quantized model (LiteRT has no int8 batch matmul)."""
    model = keras.Sequential(
        [
            keras.Input((None, 8), name="features"),
            keras.layers.Dense(8, name="inner"),
            SelfAttention(num_heads=2, key_dim=4, causal=True),
        ]
    )
    model.quantize("int8")
    model.save(tmp_path / "quantized.keras")
    out = tmp_path / "step.tflite"
    status, _, err = run(
        [
            "export-decode-step",
            str(tmp_path / "quantized.keras"),
            "--max-length",
            "4",
            "--litert",
            str(out),
        ],
        capsys,
    )
    assert status == 1
    assert_one_line_error(err, "decoding step of a quantized model", "LiteRT")
    assert not out.exists()
