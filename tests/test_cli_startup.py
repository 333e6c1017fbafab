"""keras-selfattn's start: `--help` and argument errors import neither Keras
nor TensorFlow; a command prints none of TensorFlow's native log unless
`--verbose`.

The subprocesses run the console script's entry point as pyproject.toml
names it, from this checkout, on the TensorFlow backend: their result does
not depend on the suite's backend.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from keras_selfattn.export import tensorflow_env
from keras_selfattn.export.forward.check import DEFAULT_ATOL, DEFAULT_RTOL
from keras_selfattn_cli import _process, build_parser

REPO = Path(__file__).resolve().parents[1]
ENTRY_POINT = re.search(
    r'^keras-selfattn = "([\w.]+):(\w+)"$',
    (REPO / "pyproject.toml").read_text(),
    flags=re.M,
)
# The entry point called as the console script calls it.
SCRIPT = textwrap.dedent(
    f"""
    import sys
    from {ENTRY_POINT[1]} import {ENTRY_POINT[2]} as main
    sys.exit(main())
    """
)
HEAVY = ("tensorflow", "keras", "jax", "torch", "keras_selfattn")


def _console(*argv: str, probe: str = "") -> subprocess.CompletedProcess:
    """The console script with `argv` in a fresh interpreter; TensorFlow's
    log level unset. `probe` runs after it, whatever its exit status."""
    code = SCRIPT
    if probe:
        code = f"try:\n{textwrap.indent(SCRIPT, '    ')}\nfinally:\n{probe}"
    return subprocess.run(
        [sys.executable, "-c", code, *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "KERAS_BACKEND": "tensorflow"},
    )


@pytest.mark.one_suite("runs the console script in its own interpreters")
@pytest.mark.parametrize(
    "argv, status, output",
    [
        (["--help"], 0, "usage: keras-selfattn [-h] [--verbose]"),
        (["export", "--help"], 0, "--saved-model BASE_DIR"),
        (["export"], 2, "the following arguments are required: MODEL.keras"),
        (["verify", "m.keras", "--atol", "x"], 2, "--atol: not a number"),
        (["export", "m.keras"], 1, "export needs at least one of"),
        (["verify", "m.keras", "--onnx", "none.onnx"], 1, "export not found"),
    ],
)
def test_help_and_argument_errors_import_no_keras(argv, status, output):
    probe = f"    print(sorted(set({HEAVY!r}) & set(sys.modules)))"
    result = _console(*argv, probe=probe)
    assert result.returncode == status, result.stderr
    assert output in (result.stdout if status == 0 else result.stderr)
    assert result.stdout.splitlines()[-1] == "[]", result.stdout
    if status:
        assert len(result.stderr.splitlines()) == 1, result.stderr


@pytest.mark.slow  # the console script importing TensorFlow: 10 s
@pytest.mark.one_suite(
    "runs the console script in its own interpreter", slow_suite="tensorflow"
)
def test_a_command_prints_no_tensorflow_log(tmp_path):
    """The name is refused after TensorFlow is imported, before the model is
    read: stderr holds the one error line and nothing else."""
    argv = ["export", str(tmp_path / "m.keras"), "--saved-model", str(tmp_path)]
    result = _console(*argv, "--name", "../x")
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.splitlines() == [
        "keras-selfattn: error: `name` must be a single directory name without "
        "path separators. Received: name='../x'"
    ]
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("verbose", [False, True])
def test_native_log_discarded_unless_verbose(verbose, capfd, monkeypatch):
    """TensorFlow writes its native log to file descriptor 2, as this command
    does; the error line still reaches stderr."""
    monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL", raising=False)
    monkeypatch.delenv("TF_ENABLE_ONEDNN_OPTS", raising=False)
    level, onednn = [], []

    def command() -> int:
        level.append(os.environ.get("TF_CPP_MIN_LOG_LEVEL"))
        onednn.append(os.environ.get("TF_ENABLE_ONEDNN_OPTS"))
        os.write(2, b"I0000 cpu_feature_guard.cc:227] native\n")
        raise ValueError("`x` is bad")

    status = _process.run(command, prog="keras-selfattn", verbose=verbose)
    err = capfd.readouterr().err
    assert status == 1
    assert err.endswith("keras-selfattn: error: `x` is bad\n")
    if verbose:  # the native log, then the traceback that led to the line
        assert err.startswith("I0000 cpu_feature_guard.cc:227] native\n")
        assert "Traceback (most recent call last)" in err
        assert "ValueError: `x` is bad" in err
    else:
        assert err == "keras-selfattn: error: `x` is bad\n"
    assert level == [None if verbose else "2"]
    assert onednn == ["0"]  # oneDNN's allocator off either way
    assert "TF_CPP_MIN_LOG_LEVEL" not in os.environ
    assert "TF_ENABLE_ONEDNN_OPTS" not in os.environ


def test_variables_set_by_the_user_are_kept(monkeypatch):
    monkeypatch.setenv("TF_ENABLE_ONEDNN_OPTS", "1")
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "0")
    seen = []

    def command() -> int:
        seen.append(
            (os.environ["TF_ENABLE_ONEDNN_OPTS"], os.environ["TF_CPP_MIN_LOG_LEVEL"])
        )
        return 0

    assert _process.run(command, prog="keras-selfattn", verbose=False) == 0
    assert seen == [("1", "0")]
    assert tensorflow_env.writer_env(X="y")["TF_ENABLE_ONEDNN_OPTS"] == "1"
    monkeypatch.delenv("TF_ENABLE_ONEDNN_OPTS")
    assert tensorflow_env.writer_env(X="y")["TF_ENABLE_ONEDNN_OPTS"] == "0"
    assert os.environ.get("TF_ENABLE_ONEDNN_OPTS") is None
    # The LiteRT converter's process: oneDNN's ops off, whatever is set, and
    # one malloc arena.
    monkeypatch.setenv("TF_ENABLE_ONEDNN_OPTS", "1")
    converter = tensorflow_env.converter_env(X="y")
    assert converter["TF_ENABLE_ONEDNN_OPTS"] == "0"
    assert converter["MALLOC_ARENA_MAX"] == "1"
    assert converter["X"] == "y"


@pytest.mark.parametrize(
    "argv, verbose",
    [
        (["verify", "m.keras"], False),
        (["--verbose", "verify", "m.keras"], True),
        (["verify", "m.keras", "--verbose"], True),
        (["export", "m.keras", "--verbose"], True),
    ],
)
def test_verbose_before_or_after_the_command(argv, verbose):
    assert build_parser().parse_args(argv).verbose is verbose


@pytest.mark.parametrize("command", ["export", "verify"])
def test_help_states_the_default_tolerances_of_verify(command, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert f"absolute tolerance (default {DEFAULT_ATOL:g})" in text
    assert f"relative tolerance (default {DEFAULT_RTOL:g})" in text


# A command cut off by SIGINT inside an object's `__init__` (as TensorFlow's
# `ApiDefMap` can be), under a library that restores `sys.stderr` on the way
# out (`contextlib.redirect_stderr`, as the converters' log capture does).
# The half-built object's `__del__` fails ("Exception ignored in ...") when
# the interrupt is dropped, or, in a reference cycle, when it is collected.
HALF_BUILT = textwrap.dedent(
    """
    import contextlib, io, signal, sys
    from keras_selfattn_cli import _process

    class HalfBuilt:
        def __init__(self, cyclic):
            if cyclic:
                self.me = self
            signal.raise_signal(signal.SIGINT)
            self.handle = 1

        def __del__(self):
            del self.handle

    def command():
        with contextlib.redirect_stderr(io.StringIO()):
            HalfBuilt(sys.argv[1] == "cyclic")
        return 0

    sys.exit(_process.run(command, prog="keras-selfattn", verbose=False))
    """
)


@pytest.mark.parametrize("kept", ["freed", "cyclic"])
def test_an_interrupt_prints_one_line_whatever_restores_stderr(kept):
    """In its own interpreter: pytest catches unraisable exceptions itself."""
    result = subprocess.run(
        [sys.executable, "-c", HALF_BUILT, kept],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 130, result.stderr
    assert result.stderr == (
        "keras-selfattn: error: interrupted; nothing partial was left on disk\n"
    )
