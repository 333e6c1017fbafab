"""The package as users install it: a wheel and an sdist that `twine check`
passes, installed (not editable) into a fresh virtualenv without TensorFlow.

The fast checks read pyproject.toml: the base install is keras and numpy,
every extra the code names exists, the version has one home. The slow
ones build the sdist from a copy of the checkout's files, the wheel from the
sdist (`python -m build`, no network: the virtualenv's setuptools), check
what the wheel carries, then install it with `--no-deps` into a new
virtualenv whose only other packages are keras, JAX and their requirements
(linked from this virtualenv: nothing is downloaded). There, outside the
checkout, the command line starts, `import keras_selfattn` registers the
layer, a model trains, saves and loads, and the SavedModel exporter names
the extra TensorFlow comes with.
"""

from __future__ import annotations

import email.parser
import importlib.metadata
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement

import keras_selfattn
from keras_selfattn import _tensorflow_extra
from keras_selfattn_runtimes import table

# Its slow cases in TensorFlow's slow suite (the shortest; see tests/conftest.py).
pytestmark = pytest.mark.one_suite(
    "builds the package and runs it in interpreters of its own",
    slow_suite="tensorflow",
)
REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
TIMEOUT = 600


def test_the_base_install_is_keras_and_numpy():
    names = {Requirement(r).name for r in PYPROJECT["project"]["dependencies"]}
    assert names == {"keras", "numpy"}


def test_every_extra_the_code_names_exists():
    extras = set(PYPROJECT["project"]["optional-dependencies"])
    named = {row.extra for row in table.ROWS if row.extra} | {_tensorflow_extra.EXTRA}
    assert named <= extras, named - extras
    tensorflow = PYPROJECT["project"]["optional-dependencies"][_tensorflow_extra.EXTRA]
    assert {Requirement(r).name for r in tensorflow} == {
        "tensorflow",
        "tensorflow-serving-api",
    }
    assert f"keras_selfattn[{_tensorflow_extra.EXTRA}," in " ".join(
        PYPROJECT["project"]["optional-dependencies"]["test"]
    )


def test_the_version_has_one_home():
    assert "version" not in PYPROJECT["project"]
    assert PYPROJECT["project"]["dynamic"] == ["version"]
    attr = PYPROJECT["tool"]["setuptools"]["dynamic"]["version"]["attr"]
    assert attr == "keras_selfattn.__version__"
    assert re.fullmatch(r"\d+\.\d+\.\d+", keras_selfattn.__version__)
    changelog = (REPO / "CHANGELOG.md").read_text()
    assert f"## {keras_selfattn.__version__}" in changelog


def test_tensorflow_written_generators_name_the_extra(monkeypatch):
    from keras_selfattn.export.generator import _writer as _generator_writer

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "tensorflow" else real(name, *a),
    )
    with pytest.raises(ImportError) as error:
        _generator_writer.writer("model.keras", "onnx", 8, False, {})
    message = str(error.value)
    assert message.startswith("A generator exported from ")
    assert "pip install 'keras_selfattn[tensorflow]'" in message
    assert "\n" not in message


def _run(argv, cwd, env=None, timeout=TIMEOUT) -> str:
    result = subprocess.run(
        [str(a) for a in argv],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    assert result.returncode == 0, (argv, result.stdout[-2000:], result.stderr[-3000:])
    return result.stdout


# What a copy of the checkout leaves out: virtualenvs, caches, build output.
_NOT_SOURCES = shutil.ignore_patterns(
    ".*", "__pycache__", "build", "dist", "*.egg-info", "artifacts"
)


def _source_copy(target: Path) -> Path:
    """The checkout's sources copied to `target`: building writes egg-info
    beside the sources, not in the checkout."""
    shutil.copytree(REPO, target, ignore=_NOT_SOURCES, symlinks=True)
    return target


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    """dist/ holding the sdist and the wheel built from it."""
    root = tmp_path_factory.mktemp("package")
    source = _source_copy(root / "source")
    out = root / "dist"
    env = {**os.environ, "PIP_NO_INDEX": "1"}
    _run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", out], source, env
    )
    return out


def _wheel(dist: Path) -> Path:
    (wheel,) = dist.glob("*.whl")
    return wheel


@pytest.mark.slow
def test_build_makes_a_wheel_and_an_sdist_that_twine_checks(dist):
    version = keras_selfattn.__version__
    assert _wheel(dist).name == f"keras_selfattn-{version}-py3-none-any.whl"
    assert (dist / f"keras_selfattn-{version}.tar.gz").is_file()
    assert "PASSED" in _run(
        [sys.executable, "-m", "twine", "check", "--strict", *dist.iterdir()], dist
    )


@pytest.mark.slow
def test_the_wheel_carries_every_module_the_marker_and_the_command(dist):
    with zipfile.ZipFile(_wheel(dist)) as wheel:
        names = set(wheel.namelist())
        (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        meta = email.parser.Parser().parsestr(wheel.read(metadata).decode())
        (entry_points,) = [n for n in names if n.endswith("entry_points.txt")]
        scripts = wheel.read(entry_points).decode()
    modules = {
        str(path.relative_to(REPO))
        for package in ("keras_selfattn", "keras_selfattn_cli")
        for path in (REPO / package).rglob("*.py")
    }
    assert modules <= names, sorted(modules - names)
    assert "keras_selfattn/py.typed" in names
    assert not any(n.startswith("tests/") for n in names)
    assert "keras-selfattn = keras_selfattn_cli:main" in scripts
    assert meta["Version"] == keras_selfattn.__version__
    unconditional = [r for r in meta.get_all("Requires-Dist") if "extra ==" not in r]
    assert {Requirement(r).name for r in unconditional} == {"keras", "numpy"}
    assert not any("tensorflow" in r for r in unconditional)


def _requirements_of(names) -> dict[str, importlib.metadata.Distribution]:
    """`names` and everything they require (no extras), as installed here."""
    found, todo = {}, list(names)
    while todo:
        distribution = importlib.metadata.distribution(todo.pop())
        key = re.sub(r"[-_.]+", "-", distribution.metadata["Name"]).lower()
        if key in found:
            continue
        found[key] = distribution
        for text in distribution.requires or []:
            requirement = Requirement(text)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    return found


def _jax_only_site(target: Path) -> Path:
    """A folder of links to keras, JAX and what they require, from this
    virtualenv's site-packages: TensorFlow is not among them."""
    target.mkdir()
    for distribution in _requirements_of(["keras", "jax"]).values():
        site = Path(distribution.locate_file(""))
        for top in {f.parts[0] for f in distribution.files or []}:
            if top not in ("..", "__pycache__") and not (target / top).exists():
                (target / top).symlink_to(site / top)
    return target


@pytest.fixture(scope="module")
def venv(dist, tmp_path_factory) -> Path:
    """A fresh virtualenv: the wheel, then keras and JAX linked in."""
    root = tmp_path_factory.mktemp("venv")
    venv = root / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv], root)
    python = venv / "bin" / "python"
    _run(
        [sys.executable, "-m", "pip", "--python", python, "install", "--quiet"]
        + ["--no-deps", "--no-index", _wheel(dist)],
        root,
    )
    purelib = _run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        root,
    ).strip()
    site = _jax_only_site(root / "jax_site")
    Path(purelib, "keras_jax_links.pth").write_text(f"{site}\n")
    return venv


_ROUND_TRIP = textwrap.dedent(
    """
    import importlib.util, os, sys
    import numpy as np, keras
    import keras_selfattn
    from keras_selfattn import SelfAttention
    assert importlib.util.find_spec("tensorflow") is None
    assert keras_selfattn.__file__.startswith(sys.prefix), keras_selfattn.__file__
    model = keras.Sequential([
        keras.Input((None,), dtype="int32"),
        keras.layers.Embedding(20, 8, mask_zero=True),
        SelfAttention(num_heads=2, output_dim=8, causal=True),
        keras.layers.GlobalAveragePooling1D(),
        keras.layers.Dense(2),
    ])
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(True))
    tokens = np.array([[3, 4, 5, 0], [6, 7, 8, 9]])
    model.fit(tokens, np.array([0, 1]), epochs=1, verbose=0)
    model.save("model.keras")
    np.save("expected.npy", model.predict(tokens, verbose=0))
    try:
        from keras_selfattn.export import export_saved_model
        export_saved_model(model, "sm", "m")
    except ImportError as error:
        print("saved_model:", error)
    from keras_selfattn import serving
    assert serving.RestClient  # TF Serving's REST client needs no TensorFlow
    try:
        serving.build_predict_request
    except ImportError as error:
        print("serving:", error)
    print("trained on", keras.backend.backend(), keras_selfattn.__version__)
    """
)
_LOAD = textwrap.dedent(
    """
    import numpy as np, keras
    import keras_selfattn
    model = keras.models.load_model("model.keras")
    tokens = np.array([[3, 4, 5, 0], [6, 7, 8, 9]])
    np.testing.assert_array_equal(model.predict(tokens, verbose=0),
                                  np.load("expected.npy"))
    print("loaded", type(model.layers[1]).__name__)
    """
)


@pytest.mark.slow
def test_the_wheel_runs_outside_the_checkout_without_tensorflow(venv, tmp_path):
    env = {"PATH": "/usr/bin:/bin", "KERAS_BACKEND": "jax", "HOME": str(tmp_path)}
    out = _run([venv / "bin" / "keras-selfattn", "--help"], tmp_path, env)
    assert "convert" in out and "export" in out
    python = venv / "bin" / "python"
    out = _run([python, "-c", _ROUND_TRIP], tmp_path, env)
    assert f"trained on jax {keras_selfattn.__version__}" in out
    extra = "pip install 'keras_selfattn[tensorflow]'"
    for line in ("saved_model: SavedModel export needs tensorflow", "serving: "):
        (printed,) = [x for x in out.splitlines() if x.startswith(line)]
        assert extra in printed, out
    assert "loaded SelfAttention" in _run([python, "-c", _LOAD], tmp_path, env)
