"""Hostile and broken input to the `keras-selfattn` CLI and the export API.

What is guaranteed, and tested here:
- every failure is one line `keras-selfattn: error: ...` on stderr (no
  traceback) with a non-zero status: 1 for errors, 130 for SIGINT, 143 for
  SIGTERM;
- nothing partial is left on disk and earlier exports are byte-identical
  (hash of the whole tree, hidden entries included), for: corrupt, truncated
  or bit-flipped .keras files, archives with path-traversal member names,
  Lambda layers (refused by safe_mode without running their code), hostile
  layer configs, unsafe model names, a target under a file, a read-only
  target (a read-only bind mount: root ignores permission bits, so chmod
  cannot make a directory read-only for root; a mount can), a full target
  (a 64 KiB tmpfs, and a file-size limit, RLIMIT_FSIZE), and SIGINT / SIGTERM
  at several moments of an export;
- after SIGKILL (which no program can handle) only a hidden `.N.tmp-*`
  folder can remain; it is not a version, and the next export works;
- exports get the modes the umask gives ordinary files (readable by a TF
  Serving process running as another user).

The console script runs in real subprocesses (each bounded by a timeout and
killed with its process group); the cheaper cases call `cli.main`.
The namespace tests need `unshare` with user namespaces (else skipped).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from pathlib import Path

import keras
import numpy as np
import pytest

import keras_selfattn_cli as cli
from keras_selfattn import SelfAttention
from keras_selfattn.export import export_onnx, export_saved_model

pytestmark = pytest.mark.tensorflow_only("the fixtures export ONNX through tf2onnx")

SCRIPT = shutil.which("keras-selfattn", path=os.path.dirname(sys.executable))
TIMEOUT = 180  # seconds per CLI subprocess; a normal export takes 15-25 s here
ERROR_PREFIX = "keras-selfattn: error: "


# ------------------------------------------------------------------ helpers
def tree_digest(root: Path) -> dict[str, str]:
    """{relative path: sha256 or "dir"} of everything under root."""
    digest = {}
    for directory, dirs, files in os.walk(root):
        for name in dirs:
            path = Path(directory, name)
            digest[str(path.relative_to(root))] = "dir"
        for name in files:
            path = Path(directory, name)
            digest[str(path.relative_to(root))] = hashlib.sha256(
                path.read_bytes()
            ).hexdigest()
    return digest


def assert_one_line_error(stderr: str, *fragments: str) -> str:
    """The CLI's error is one line at the end, with no traceback before it."""
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert lines, "no error message"
    ours = [line for line in lines if line.startswith("keras-selfattn:")]
    assert ours == [lines[-1]], stderr
    assert lines[-1].startswith(ERROR_PREFIX), stderr
    for fragment in fragments:
        assert fragment in lines[-1], (fragment, lines[-1])
    return lines[-1]


def _env() -> dict[str, str]:
    return dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", KERAS_BACKEND="tensorflow")


class _Cli:
    """A console-script subprocess whose stdout is read as it comes."""

    def __init__(self, argv: list[str], prefix: list[str] = (), preexec=None):
        self.process = subprocess.Popen(
            [*prefix, SCRIPT, *argv],
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # own process group, killed as a whole
            preexec_fn=preexec,
        )
        self.stdout = b""
        self.stderr = b""
        self._threads = [
            threading.Thread(target=self._drain, args=(stream, name), daemon=True)
            for stream, name in (
                (self.process.stdout, "stdout"),
                (self.process.stderr, "stderr"),
            )
        ]
        for thread in self._threads:
            thread.start()

    def _drain(self, stream, name: str) -> None:
        for chunk in iter(lambda: stream.read1(4096), b""):
            setattr(self, name, getattr(self, name) + chunk)

    def wait_for(self, text: str, timeout: float = TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while text.encode() not in self.stdout:
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.kill()
                pytest.fail(f"never printed {text!r}: {self.stdout!r} {self.stderr!r}")
            time.sleep(0.02)

    def finish(self, timeout: float = TIMEOUT) -> tuple[int, str, str]:
        try:
            code = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"CLI did not stop within {timeout} s")
        for thread in self._threads:
            thread.join(10)
        return code, self.stdout.decode(), self.stderr.decode()

    def kill(self) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()


@contextlib.contextmanager
def cli_process(argv, prefix=(), preexec=None):
    process = _Cli(argv, list(prefix), preexec)
    try:
        yield process
    finally:
        process.kill()


def run_cli(argv, prefix=(), preexec=None) -> tuple[int, str, str]:
    with cli_process(argv, prefix, preexec) as process:
        return process.finish()


def run_main(argv: list[str], capsys) -> tuple[int, str, str]:
    status = cli.main(argv)
    captured = capsys.readouterr()
    return status, captured.out, captured.err


# ----------------------------------------------------------------- fixtures
def _model() -> keras.Model:
    inputs = keras.Input((None,), dtype="int32", name="tokens")
    x = keras.layers.Embedding(50, 16, mask_zero=True)(inputs)
    x = SelfAttention(num_heads=2, output_dim=16, use_bias=True, name="attention")(x)
    x = keras.layers.GlobalAveragePooling1D()(x)
    return keras.Model(inputs, keras.layers.Dense(3, name="score")(x))


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """(root, model file, base dir with version 1 of 'clf', an ONNX file)."""
    root = tmp_path_factory.mktemp("hostile")
    model = _model()
    model_file = root / "clf.keras"
    model.save(model_file)
    base = root / "serving"
    export_saved_model(model, base, "clf", check=False)
    onnx_file = export_onnx(model, root / "onnx" / "clf.onnx")
    return root, model_file, base, Path(onnx_file)


@pytest.fixture()
def earlier(work, tmp_path):
    """A private copy of the earlier exports, and its digest."""
    _, _, base, onnx_file = work
    copy = tmp_path / "serving"
    shutil.copytree(base, copy)
    onnx_dir = tmp_path / "onnx"
    onnx_dir.mkdir()
    shutil.copy(onnx_file, onnx_dir / "clf.onnx")
    return copy, onnx_dir, tree_digest(tmp_path)


def _assert_untouched(tmp_path: Path, digest: dict[str, str]) -> None:
    after = tree_digest(tmp_path)
    assert after == digest, sorted(set(after.items()) ^ set(digest.items()))


# ------------------------------------------------- corrupt / unsafe models
def _corrupt_files(model_file: Path, folder: Path) -> dict[str, Path]:
    data = model_file.read_bytes()
    files = {}

    def put(name: str, content: bytes) -> None:
        files[name] = folder / f"{name}.keras"
        files[name].write_bytes(content)

    put("empty", b"")
    put("truncated_header", data[:30])
    put("truncated_tail", data[:-200])
    flipped = bytearray(data)
    for offset in np.random.default_rng(0).integers(0, len(data), size=40):
        flipped[offset] ^= 0xFF
    put("bit_flips", bytes(flipped))

    def rezip(name: str, change) -> None:
        out = io.BytesIO()
        with (
            zipfile.ZipFile(model_file) as src,
            zipfile.ZipFile(out, "w") as dst,
        ):
            for info in src.infolist():
                change(dst, info.filename, src.read(info.filename))
        put(name, out.getvalue())

    rezip(
        "garbage_weights",
        lambda z, n, b: z.writestr(n, b"\0" * 64 if n.endswith(".h5") else b),
    )
    rezip(
        "broken_config_json",
        lambda z, n, b: z.writestr(n, b[: len(b) // 2] if n == "config.json" else b),
    )
    hostile_layer = (
        b'"class_name": "SelfAttention", "config": {"name": "attention", '
        b'"trainable": true, "dtype": "int32"'
    )

    def hostile_config(z, n, b):
        if n == "config.json":
            start = b.index(b'"class_name": "SelfAttention"')
            end = b.index(b'"num_heads"', start)
            b = b[:start] + hostile_layer + b", " + b[end:]
        z.writestr(n, b)

    rezip("int32_selfattention", hostile_config)
    return files


@pytest.fixture(scope="module")
def bad_models(work):
    root, model_file, _, _ = work
    folder = root / "bad"
    folder.mkdir()
    files = _corrupt_files(model_file, folder)
    # A Lambda whose code, if it ever ran, would leave a marker file.
    marker = root / "lambda_ran"
    inputs = keras.Input((4,), name="x")
    outputs = keras.layers.Lambda(
        lambda t, path=str(marker): (open(path, "w").close(), t)[1]
    )(inputs)
    keras.Model(inputs, outputs).save(folder / "lambda.keras")
    if marker.exists():
        marker.unlink()  # saving traced the function once; start clean
    files["lambda"] = folder / "lambda.keras"
    return files, marker


@pytest.mark.parametrize(
    "name",
    [
        "empty",
        "truncated_header",
        "truncated_tail",
        "bit_flips",
        "garbage_weights",
        "broken_config_json",
        "int32_selfattention",
        "lambda",
    ],
)
def test_broken_model_files_give_one_line_errors(
    name, bad_models, earlier, tmp_path, capsys
):
    files, marker = bad_models
    base, onnx_dir, digest = earlier
    argv = ["export", str(files[name]), "--saved-model", str(base), "--name", "clf"]
    status, _, err = run_main(argv + ["--onnx", str(onnx_dir / "new.onnx")], capsys)
    assert status == 1
    line = assert_one_line_error(err, files[name].name)
    if name == "lambda":
        assert "safe_mode" in line
        assert not marker.exists(), "safe_mode let the Lambda's code run"
    if name == "int32_selfattention":
        assert "dtype" in line
    _assert_untouched(tmp_path, digest)


@pytest.mark.slow  # an export, then a crafted archive
def test_path_traversal_members_are_not_extracted(work, tmp_path, capsys):
    """A .keras archive with a '../../' member loads (Keras skips the member)
    and nothing is written outside the targets."""
    _, model_file, _, _ = work
    escaped = f"escaped-{os.getpid()}-{time.time_ns()}.txt"
    hostile = tmp_path / "in" / "deep" / "model.keras"
    hostile.parent.mkdir(parents=True)
    with zipfile.ZipFile(model_file) as src, zipfile.ZipFile(hostile, "w") as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info.filename))
        for depth in range(1, 8):
            dst.writestr("../" * depth + escaped, b"escaped")
        dst.writestr("/tmp/" + escaped, b"escaped")
    cwd = Path.cwd()
    argv = ["export", str(hostile), "--saved-model", str(tmp_path / "out")]
    status, _, err = run_main(argv, capsys)
    assert status == 0, err
    candidates = [Path("/tmp", escaped), Path("/", escaped), cwd / escaped]
    candidates += [parent / escaped for parent in hostile.parents]
    candidates += [Path(tempfile.gettempdir(), escaped)]
    assert not [path for path in candidates if path.exists()]
    assert (tmp_path / "out" / "model" / "1" / "saved_model.pb").is_file()


@pytest.mark.parametrize(
    "name",
    ["..", ".", "../clf", "a/b", "/etc", "a\\b", ".hidden", "", " ", "x\0y"],
)
def test_unsafe_names_are_refused_by_api_and_cli(name, work, earlier, tmp_path, capsys):
    _, model_file, _, _ = work
    base, _, digest = earlier
    with pytest.raises(ValueError, match="`name`"):
        export_saved_model(_model(), base, name, check=False)
    if "\0" not in name:  # argv cannot carry NUL
        argv = ["export", str(model_file), "--saved-model", str(base), "--name", name]
        status, _, err = run_main(argv, capsys)
        assert status == 1
        assert_one_line_error(err, "`name`")
    _assert_untouched(tmp_path, digest)


def test_target_under_a_file_is_refused(work, tmp_path, capsys):
    _, model_file, _, _ = work
    blocker = tmp_path / "blocker"
    blocker.write_text("a file, not a folder")
    digest = tree_digest(tmp_path)
    for target in (["--saved-model", str(blocker)], ["--onnx", str(blocker)]):
        status, _, err = run_main(["export", str(model_file), *target], capsys)
        assert status == 1
        assert_one_line_error(err, "blocker")
    for target in (
        ["--saved-model", str(blocker / "serving")],
        ["--onnx", str(blocker / "m.onnx")],
    ):
        status, _, err = run_main(["export", str(model_file), *target], capsys)
        assert status == 1
        assert_one_line_error(err, "blocker")
    _assert_untouched(tmp_path, digest)


# ------------------------------------------- read-only and full file systems
def _unshare_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "true"],
        capture_output=True,
        timeout=30,
    )
    return probe.returncode == 0


needs_unshare = pytest.mark.skipif(
    not _unshare_works(), reason="needs `unshare --user --mount` (user namespaces)"
)

# Runs "$@" in a private mount namespace where $1 is bind-mounted read-only.
READ_ONLY = (
    'dir="$1"; shift; mount --bind "$dir" "$dir" && '
    'mount -o remount,bind,ro "$dir" && exec "$@"'
)
# Mounts a 64 KiB tmpfs on $1, copies $2 into it, runs "$@", lists the tmpfs.
SMALL_DISK = (
    'dir="$1"; seed="$2"; shift 2; mount -t tmpfs -o size=64k tmpfs "$dir" && '
    'cp -a "$seed/." "$dir/" && "$@"; status=$?; '
    'find "$dir" -mindepth 1 | sort > "$seed.listing"; exit $status'
)


def _namespace(script: str, *args: str) -> list[str]:
    return [
        "unshare",
        "--user",
        "--map-root-user",
        "--mount",
        "sh",
        "-c",
        script,
        "sh",
        *args,
    ]


@pytest.mark.slow  # an export in a read-only namespace
@needs_unshare
def test_read_only_target(work, earlier, tmp_path):
    _, model_file, _, _ = work
    base, onnx_dir, digest = earlier
    argv = ["export", str(model_file), "--saved-model", str(base), "--name", "clf"]
    status, _, err = run_cli(argv, prefix=_namespace(READ_ONLY, str(tmp_path)))
    assert status == 1
    assert_one_line_error(err, "Read-only file system")
    argv = ["export", str(model_file), "--onnx", str(onnx_dir / "new.onnx")]
    status, _, err = run_cli(argv, prefix=_namespace(READ_ONLY, str(tmp_path)))
    assert status == 1
    assert_one_line_error(err, "Read-only file system")
    _assert_untouched(tmp_path, digest)


@pytest.mark.slow
@needs_unshare
def test_full_target_file_system(work, tmp_path):
    """A 64 KiB tmpfs holds models.config but not a SavedModel."""
    _, model_file, _, _ = work
    seed = tmp_path / "seed"
    (seed / "other").mkdir(parents=True)
    (seed / "other" / "keep.txt").write_text("earlier content")
    disk = tmp_path / "disk"
    disk.mkdir()
    argv = ["export", str(model_file), "--saved-model", str(disk), "--name", "clf"]
    status, _, err = run_cli(argv, prefix=_namespace(SMALL_DISK, str(disk), str(seed)))
    assert status == 1
    assert_one_line_error(err, "No space left on device")
    listing = Path(f"{seed}.listing").read_text().split()
    assert listing == [f"{disk}/other", f"{disk}/other/keep.txt"]


def _file_size_limit(limit: int):
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


@pytest.mark.slow  # an export under a file size limit
def test_file_size_limit_fails_cleanly(work, earlier, tmp_path):
    """RLIMIT_FSIZE makes the kernel refuse writes past 20 KB (EFBIG), as a
    nearly full disk would; the SavedModel's files are larger."""
    _, model_file, _, _ = work
    base, onnx_dir, digest = earlier
    argv = ["export", str(model_file), "--saved-model", str(base), "--name", "clf"]
    argv += ["--onnx", str(onnx_dir / "new.onnx")]
    status, out, err = run_cli(argv, preexec=_file_size_limit(20_000))
    assert status == 1, out
    assert_one_line_error(err)
    _assert_untouched(tmp_path, digest)


# ------------------------------------------------------------- interruption
def _interrupt(work, earlier, tmp_path, step: str, delay: float, sig: int):
    _, model_file, _, _ = work
    base, onnx_dir, digest = earlier
    onnx_file = onnx_dir / "new.onnx"
    argv = ["export", str(model_file), "--saved-model", str(base), "--name", "clf"]
    argv += ["--onnx", str(onnx_file)]
    with cli_process(argv) as process:
        process.wait_for(step)
        time.sleep(delay)
        process.process.send_signal(sig)
        status, out, err = process.finish()
    return status, out, err, base, onnx_file, digest


def _assert_interrupted_cleanly(result, tmp_path, status_wanted, word) -> None:
    status, out, err, base, onnx_file, digest = result
    if "tolerance:" in out:
        # The signal landed after the last step (a fast moment of this
        # shared machine): the run may exit 0, or by the signal at shutdown.
        assert status in (0, status_wanted, -signal.SIGINT, -signal.SIGTERM), err
    else:
        assert status == status_wanted, (out, err)
        assert_one_line_error(err, word, "nothing partial was left on disk")
    after = tree_digest(tmp_path)
    added = sorted(set(after) - set(digest))
    assert not any(Path(path).name.startswith(".") for path in added), added
    for path, value in digest.items():
        if path != "serving/models.config":  # rewritten after a new version
            assert after.get(path) == value, path
    # Whatever was added is complete: a finished version and/or ONNX file.
    if "wrote " + str(base / "clf" / "2") in out:
        assert (base / "clf" / "2" / "saved_model.pb").is_file()
    else:
        assert not (base / "clf" / "2").exists()
    assert onnx_file.exists() == ("wrote " + str(onnx_file) in out)


@pytest.mark.slow  # interrupted exports in their own interpreters: 10 s
def test_sigint_during_saved_model_export(work, earlier, tmp_path):
    result = _interrupt(
        work, earlier, tmp_path, "Exporting SavedModel", 0.1, signal.SIGINT
    )
    _assert_interrupted_cleanly(result, tmp_path, 130, "interrupted")
    # It stops within the step, or at the latest before the next one (an
    # interrupt can be swallowed by Python inside a library's `__del__`).
    assert "Exporting ONNX" not in result[1], result[1]


@pytest.mark.slow
@pytest.mark.parametrize(
    "step, delay",
    [
        ("Exporting SavedModel", 0.0),
        ("Exporting SavedModel", 0.4),
        ("Exporting ONNX", 0.0),
        ("Exporting ONNX", 0.3),
        ("Verifying", 0.0),
    ],
)
def test_sigint_at_other_moments(work, earlier, tmp_path, step, delay):
    result = _interrupt(work, earlier, tmp_path, step, delay, signal.SIGINT)
    _assert_interrupted_cleanly(result, tmp_path, 130, "interrupted")


@pytest.mark.slow  # an interrupted export in its own interpreter: 9 s
def test_sigterm_during_export_cleans_up(work, earlier, tmp_path):
    result = _interrupt(
        work, earlier, tmp_path, "Exporting SavedModel", 0.1, signal.SIGTERM
    )
    _assert_interrupted_cleanly(result, tmp_path, 143, "terminated")
    assert "Exporting ONNX" not in result[1], result[1]


@pytest.mark.slow
def test_after_sigkill_only_a_hidden_temporary_remains(work, earlier, tmp_path):
    result = _interrupt(
        work, earlier, tmp_path, "Exporting SavedModel", 0.1, signal.SIGKILL
    )
    status, _, _, base, _, digest = result
    assert status == -signal.SIGKILL
    added = sorted(set(tree_digest(tmp_path)) - set(digest))
    assert all(path.startswith("serving/clf/.2.tmp-") for path in added), (
        added
    )  # nothing visible: no version 2, no ONNX file
    _, model_file, _, _ = work
    argv = ["export", str(model_file), "--saved-model", str(base), "--name", "clf"]
    status, out, err = run_cli(argv)
    assert status == 0, err
    assert (base / "clf" / "2" / "saved_model.pb").is_file()


# -------------------------------------------------------------- permissions
def test_exports_are_readable_like_ordinary_files(work, tmp_path):
    """A server running as another user can read the exports: modes follow
    the umask (here 022) like files written with open(), not tempfile's
    private 0700/0600 of the temporaries they are renamed from."""
    _, model_file, _, _ = work
    model = keras.models.load_model(model_file)
    previous = os.umask(0o022)
    try:
        version_dir = export_saved_model(
            model, tmp_path / "serving", "clf", check=False
        )
        onnx_file = export_onnx(model, tmp_path / "m.onnx", check=False)
    finally:
        os.umask(previous)
    paths = [Path(version_dir), Path(onnx_file), tmp_path / "serving/models.config"]
    paths += list(Path(version_dir).rglob("*"))
    for path in paths:
        mode = path.stat().st_mode & 0o777
        assert mode == (0o755 if path.is_dir() else 0o644), (path, oct(mode))
