"""One rule each for export/ and serving/: names, versions, folders, modes.

The exporters, `models.config`, warmup files and the clients share
`keras_selfattn.serving.layout` and the umask rule for modes; these tests
hold every user of a rule to the same answer.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest

from keras_selfattn.export import _files as export_files
from keras_selfattn.export import export_saved_model, pipeline
from keras_selfattn.serving import (
    RestClient,
    build_models_config,
    build_predict_request,
    layout,
    read_warmup_file,
    write_models_config,
    write_warmup_file,
)
from tests import model_zoo
from tests.files import atomic_file

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAVED_MODEL_BACKENDS = ("tensorflow", "jax")
needs_saved_model_backend = pytest.mark.skipif(
    keras.backend.backend() not in SAVED_MODEL_BACKENDS,
    reason="SavedModel export runs on the tensorflow and jax backends",
)

BAD_NAMES = ["", "  ", "a/b", "../x", "..", ".", ".hidden", "a\\b", "x\0y", "a\nb"]


# ------------------------------------------------------------- model names
@pytest.mark.parametrize("name", BAD_NAMES)
def test_every_user_refuses_the_same_model_names(tmp_path, name):
    examples = [{"x": np.zeros((1, 2), "float32")}]
    users = {
        "layout": lambda: layout.check_model_name(name),
        "models.config": lambda: build_models_config(str(tmp_path), [name]),
        "warmup": lambda: write_warmup_file(str(tmp_path / "w"), name, examples),
        "rest client": lambda: RestClient("http://localhost:8501", name),
        "predict request": lambda: build_predict_request(name, examples[0]),
    }
    if keras.backend.backend() in SAVED_MODEL_BACKENDS:
        users["export"] = lambda: pipeline.check_destination(
            "saved_model", tmp_path, name=name
        )
    for user, call in users.items():
        with pytest.raises(ValueError, match="name") as caught:
            call()
        assert repr(name) in str(caught.value), user
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("name", ["clf", "digits-v2", "a b", "Model_1"])
def test_every_user_accepts_the_same_model_names(tmp_path, name):
    assert layout.check_model_name(name) == name
    assert build_models_config(str(tmp_path), [name]).model_config_list.config
    assert RestClient("http://localhost:8501", name).model_name == name


@pytest.mark.parametrize("version", [0, -1, 1.5, "2", True])
def test_exporter_and_clients_refuse_the_same_versions(tmp_path, version):
    message = rf"`version` must be a positive integer or None\. .*version={version!r}"
    with pytest.raises(ValueError, match=message):
        RestClient("http://localhost:8501", "clf", version=version)
    with pytest.raises(ValueError, match=message):
        layout.check_version(version)
    if keras.backend.backend() in SAVED_MODEL_BACKENDS:
        with pytest.raises(ValueError, match=message):
            pipeline.check_destination(
                "saved_model", tmp_path, name="clf", version=version
            )


# ------------------------------------------------- served and taken versions
def _model_dir(root, entries: dict[str, bool]) -> str:
    """A model folder with numbered folders, each with saved_model.pb or not."""
    model_dir = root / "m"
    for entry, has_saved_model in entries.items():
        (model_dir / entry).mkdir(parents=True)
        if has_saved_model:
            (model_dir / entry / layout.SAVED_MODEL_FILE).write_bytes(b"")
    return str(model_dir)


def test_served_versions_hold_a_saved_model_taken_ones_any_number(tmp_path):
    model_dir = _model_dir(
        tmp_path, {"1": True, "2": False, "007": True, ".9.tmp-x": True, "v3": True}
    )
    (tmp_path / "m" / "12").write_text("a file, not a folder")
    assert layout.served_versions(model_dir) == [1, 7]
    assert layout.taken_versions(model_dir) == [1, 2, 7]
    assert layout.new_version(model_dir, "m") == 8
    assert layout.new_version(model_dir, "m", 3) == 3
    for taken in (1, 2, 7):
        with pytest.raises(layout.VersionExistsError, match=f"Version {taken} "):
            layout.new_version(model_dir, "m", taken)
    assert layout.taken_versions(str(tmp_path / "missing")) == []
    assert layout.new_version(str(tmp_path / "missing"), "m") == 1


def test_a_numbered_folder_without_saved_model_is_never_served_nor_reused(tmp_path):
    _model_dir(tmp_path, {"1": False})
    (tmp_path / "other" / "4").mkdir(parents=True)
    (tmp_path / "other" / "4" / layout.SAVED_MODEL_FILE).write_bytes(b"")
    assert layout.served_model_names(tmp_path) == ["other"]
    assert layout.new_version(str(tmp_path / "m"), "m") == 2


@needs_saved_model_backend
def test_export_follows_the_layout(tmp_path):
    """A real export: next free version past an empty numbered folder,
    models.config lists only models with a served version, warmup records
    at `layout.WARMUP_PATH`."""
    base = tmp_path / "serving"
    _model_dir(base, {"3": False})  # model "m": a folder without a SavedModel
    model = model_zoo.attention_only(seed=0)
    version_dir = export_saved_model(model, base, "clf", warmup=True, check=False)
    assert version_dir == os.path.join(base, "clf", "1")
    config = (base / "models.config").read_text()
    assert 'name: "clf"' in config and 'name: "m"' not in config
    requests = read_warmup_file(os.path.join(version_dir, layout.WARMUP_PATH))
    assert [r.inputs["features"].tensor_shape.dim[1].size for r in requests] == [
        1,
        8,
        32,
    ]
    assert export_saved_model(model, base, "m", check=False).endswith(
        os.path.join("m", "4")
    )
    assert 'name: "m"' in (base / "models.config").read_text()


# ------------------------------------------------------------------- modes
def test_one_umask_rule_for_export_and_serving_files(tmp_path):
    previous = os.umask(0o027)
    try:
        with atomic_file(str(tmp_path / "exported")) as tmp:
            open(tmp, "w").close()
        with export_files.atomic_directory(str(tmp_path / "version")):
            pass
        config = write_models_config(str(tmp_path), ["clf"])
    finally:
        os.umask(previous)
    assert (tmp_path / "exported").stat().st_mode & 0o777 == 0o640
    assert (tmp_path / "version").stat().st_mode & 0o777 == 0o750
    assert os.stat(config).st_mode & 0o777 == 0o640


# --------------------------------------------------------- requests without gRPC
# A fresh interpreter importing TensorFlow: 22 s under make test's load.
@pytest.mark.one_suite("a fresh interpreter without gRPC", slow_suite="tensorflow")
@pytest.mark.slow
def test_warmup_and_predict_requests_need_no_grpc(tmp_path):
    """With gRPC unimportable, requests and warmup files still work."""
    script = textwrap.dedent(
        f"""
        import importlib.abc, sys
        class _NoGrpc(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "grpc":
                    raise ModuleNotFoundError(f"No module named {{name!r}}")
        sys.meta_path.insert(0, _NoGrpc())
        import numpy as np
        from keras_selfattn.serving import (
            build_predict_request, read_warmup_file, write_warmup_file)
        example = {{"tokens": np.ones((1, 4), "int32")}}
        assert build_predict_request("clf", example).model_spec.name == "clf"
        path = write_warmup_file({str(tmp_path / "warmup")!r}, "clf", [example])
        print(len(read_warmup_file(path)), "grpc" in sys.modules)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["1", "False"]
