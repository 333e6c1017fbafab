"""The `keras-selfattn` command: export a .keras model and verify exports.

    keras-selfattn export MODEL.keras --saved-model BASE_DIR [--name NAME]
                   [--version N] [--warmup] [--onnx OUT.onnx] [--opset N]
                   [--fuse-attention]
    keras-selfattn verify MODEL.keras [--saved-model VERSION_DIR] [--onnx PATH]
    keras-selfattn export-decode-step MODEL.keras --max-length N
                   [--saved-model BASE_DIR [--name NAME] [--version N]]
                   [--onnx OUT.onnx [--opset N]]

Every step is printed as it runs, then a parity table (each runtime against
Keras). `export` writes each export beside its target, verifies them all in
one step and moves them into place only when every one matched. Any
failure prints one line, `keras-selfattn: error: ...`, on stderr and exits
with status 1 (2 for usage errors, 130 when interrupted, 143 when
terminated by SIGTERM).
While a command runs, TensorFlow's native (C++) log lines, which it writes
straight to file descriptor 2, are discarded so they cannot bury that line.
(The few TensorFlow prints while it is imported come before `main` runs.)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import sys
import threading
import time
import zipfile
from collections.abc import Callable, Mapping, Sequence
from typing import Any

PROG = "keras-selfattn"
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


class CLIError(Exception):
    """A failure reported as one line, without a traceback."""


class _Terminated(BaseException):
    """SIGTERM, raised like KeyboardInterrupt so every cleanup runs."""


# Exit status and message per signal. Python swallows an exception raised
# while a `__del__` runs ("Exception ignored in ..."), and libraries may wrap
# it in their own error, so the received signal is also recorded and decides
# the outcome whatever the work ended with.
_SIGNALS = {
    signal.SIGINT: (130, "interrupted", KeyboardInterrupt),
    signal.SIGTERM: (143, "terminated", _Terminated),
}
# The signals received during the current `main` (checked between steps too).
_RECEIVED: list[int] = []


@contextlib.contextmanager
def _signals_recorded(received: list[int]):
    """Appends SIGINT/SIGTERM to `received` and raises their exception.

    Yields a function that stops the raising (once the work is over, a
    signal is only recorded, so it cannot escape `main` as a traceback).
    After a signal, `sys.stderr` is silenced until the end: what Python and
    libraries print about the cut-off work (an exception ignored in a
    `__del__`, a SystemError from a C callback) would bury the one line that
    `main` prints to the stream it saved.
    """
    armed = [True]
    if threading.current_thread() is not threading.main_thread():
        yield armed.clear
        return
    original = sys.stderr
    quiet = open(os.devnull, "w")

    def handler(signum, frame):
        received.append(signum)
        sys.stderr = quiet
        if armed:
            raise _SIGNALS[signum][2]

    previous = {signum: signal.signal(signum, handler) for signum in _SIGNALS}
    try:
        yield armed.clear
    finally:
        for signum, action in previous.items():
            signal.signal(signum, action)
        sys.stderr = original
        quiet.close()


class _Parser(argparse.ArgumentParser):
    """argparse with one-line usage errors (exit status 2)."""

    def error(self, message: str):
        self.exit(2, f"{PROG}: error: {message} (see {PROG} --help)\n")


def one_line(error: BaseException) -> str:
    """A one-line description of `error` for the command line."""
    if isinstance(error, OSError) and error.strerror and error.filename:
        text = f"{error.strerror}: {error.filename}"
    else:
        text = str(error) or type(error).__name__
    return " ".join(_ANSI.sub("", text).split())


@contextlib.contextmanager
def _native_stderr_discarded():
    """Points fd 2 at /dev/null; Python's `sys.stderr` keeps the real one."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        python_uses_fd2 = sys.stderr.fileno() == 2
    except (AttributeError, OSError, ValueError):  # e.g. replaced by pytest
        python_uses_fd2 = False
    original = sys.stderr
    if python_uses_fd2:
        sys.stderr = os.fdopen(os.dup(saved), "w", buffering=1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        if python_uses_fd2:
            sys.stderr.close()
            sys.stderr = original


def _step(label: str, action: Callable[[], object]) -> object:
    if _RECEIVED:  # a signal whose exception was swallowed: stop here
        raise KeyboardInterrupt
    print(f"{label} ...", end=" ", flush=True)
    start = time.perf_counter()
    try:
        result = action()
    except BaseException:
        print("failed", flush=True)
        raise
    print(f"done ({time.perf_counter() - start:.1f} s)", flush=True)
    return result


def _load_model(path: str):
    if not os.path.exists(path):
        raise CLIError(f"model file not found: {path}")
    if not os.path.isfile(path):
        raise CLIError(f"model path is not a file: {path}")

    if path.endswith(".keras") and not zipfile.is_zipfile(path):
        raise CLIError(f"{path} is corrupt or not a Keras model: not a .keras zip")

    def load():
        import keras

        import keras_selfattn  # noqa: F401  (registers SelfAttention)

        try:
            return keras.models.load_model(path, safe_mode=True)
        except Exception as error:
            raise CLIError(
                f"cannot load {path} as a Keras model: {one_line(error)}"
            ) from None

    model = _step(f"Loading {path} (safe_mode=True)", load)
    import keras

    if not isinstance(model, keras.Model):
        raise CLIError(f"{path} holds a {type(model).__name__}, not a keras.Model")
    return model


def _describe(model) -> None:
    inputs = ", ".join(
        f"{t.name} {str(t.dtype)} {tuple(t.shape)}" for t in model.inputs
    )
    print(f"  model {model.name!r}: inputs {inputs}", flush=True)


def _check_targets(args: argparse.Namespace, name: str) -> int | None:
    """The exporters' target checks, before the model is loaded.

    Checks `--saved-model` (with model `name` and `--version`) and `--onnx`
    (with `--opset`) when given.

    Returns:
        The ONNX opset to use, or None without `--onnx`.

    Raises:
        CLIError: if the SavedModel version exists.
    """
    from keras_selfattn.export import onnx_export_module, saved_model
    from keras_selfattn.serving.layout import VersionExistsError

    if args.saved_model is not None:
        try:
            saved_model.check_target(
                args.saved_model, name, args.version, argument="--saved-model"
            )
        except VersionExistsError as error:
            raise CLIError(
                f"version {error.version} of {error.name!r} already exists in "
                f"{error.model_dir}; it is never overwritten (pass another "
                "--version or omit it)"
            ) from None
    if args.onnx is None:
        return None
    onnx_export = onnx_export_module()
    opset = onnx_export.check_opset(args.opset)
    onnx_export.check_target(args.onnx, argument="--onnx")
    return opset


def _staged_paths(staged: Mapping[str, Any]) -> tuple[str | None, str | None]:
    """The staged SavedModel's and ONNX file's paths (None when not staged)."""
    saved = staged["saved_model"].path if "saved_model" in staged else None
    onnx = staged["onnx"].path if "onnx" in staged else None
    return saved, onnx


def _print_written(staged: Mapping[str, Any], report: object) -> int:
    """Prints the moved-in exports and the parity report; returns status 0."""
    for export in staged.values():
        print(f"  wrote {export.target}", flush=True)
    print(report, flush=True)
    return 0


def _export(args: argparse.Namespace) -> int:
    """Stages each export, verifies them in one step, then moves them in.

    The exporters' own argument checks run before the model is loaded; an
    export appears only once every export of the command matched Keras.
    """
    from keras_selfattn.export import onnx_export_module, saved_model, verify

    if args.saved_model is None and args.onnx is None:
        raise CLIError("export needs --saved-model BASE_DIR, --onnx OUT.onnx or both")
    if args.saved_model is None and (args.name or args.version or args.warmup):
        raise CLIError("--name, --version and --warmup need --saved-model")
    if args.onnx is None and args.opset is not None:
        raise CLIError("--opset needs --onnx")
    if args.onnx is None and args.fuse_attention:
        raise CLIError("--fuse-attention needs --onnx")
    name = args.name
    if name is None:
        name = os.path.splitext(os.path.basename(args.model))[0]
    opset = _check_targets(args, name)

    model = _load_model(args.model)
    _describe(model)
    with contextlib.ExitStack() as staging:
        staged = {}
        if args.saved_model is not None:
            staged["saved_model"] = _step(
                f"Exporting SavedModel {name!r} under {args.saved_model}"
                + (" with warmup requests" if args.warmup else ""),
                lambda: staging.enter_context(
                    saved_model.stage_saved_model(
                        model, args.saved_model, name, args.version, warmup=args.warmup
                    )
                ),
            )
        if args.onnx is not None:
            from keras_selfattn.export.fused_attention import FUSED_OPSET, collect_log

            onnx_export = onnx_export_module()

            fused = f" -> {FUSED_OPSET}, fused Attention" if args.fuse_attention else ""
            with collect_log() as fusion_log:
                try:
                    staged["onnx"] = _step(
                        f"Exporting ONNX (opset {opset}{fused}) to {args.onnx}",
                        lambda: staging.enter_context(
                            onnx_export.stage_onnx(
                                model,
                                args.onnx,
                                opset,
                                fuse_attention=args.fuse_attention,
                            )
                        ),
                    )
                finally:  # which layers were fused, also when the export failed
                    for line in fusion_log:
                        print(f"  {line}", flush=True)
        report = _step(
            "Verifying against Keras",
            lambda: verify(
                model,
                *_staged_paths(staged),
                atol=args.atol,
                rtol=args.rtol,
            ),
        )
    return _print_written(staged, report)


def _export_decode_step(args: argparse.Namespace) -> int:
    """Like `_export`, for the decoding step (`export.decode_step`)."""
    from keras_selfattn.export import decode_step

    if args.saved_model is None and args.onnx is None:
        raise CLIError(
            "export-decode-step needs --saved-model BASE_DIR, --onnx OUT.onnx or both"
        )
    if args.saved_model is None and (args.name or args.version):
        raise CLIError("--name and --version need --saved-model")
    if args.onnx is None and args.opset is not None:
        raise CLIError("--opset needs --onnx")
    decode_step.require_tensorflow()
    name = args.name or os.path.splitext(os.path.basename(args.model))[0]
    opset = _check_targets(args, name)

    model = _load_model(args.model)
    _describe(model)
    step = decode_step.build_decode_step(model, args.max_length)
    print(
        f"  decode step: caches {', '.join(step.cache_names)} "
        f"(max_length {args.max_length})",
        flush=True,
    )
    with contextlib.ExitStack() as staging:
        staged = {}
        if args.saved_model is not None:
            staged["saved_model"] = _step(
                f"Exporting SavedModel {name!r} (signature "
                f"{decode_step.SIGNATURE_NAME!r}) under {args.saved_model}",
                lambda: staging.enter_context(
                    decode_step.stage_saved_model(
                        model,
                        args.saved_model,
                        name,
                        args.version,
                        max_length=args.max_length,
                    )
                ),
            )
        if args.onnx is not None:
            staged["onnx"] = _step(
                f"Exporting ONNX (opset {opset}) to {args.onnx}",
                lambda: staging.enter_context(
                    decode_step.stage_onnx(
                        model, args.onnx, max_length=args.max_length, opset=opset
                    )
                ),
            )
        report = _step(
            "Decoding step by step against Keras",
            lambda: decode_step.verify_decode_step(
                model,
                *_staged_paths(staged),
                max_length=args.max_length,
                atol=args.atol,
                rtol=args.rtol,
            ),
        )
    return _print_written(staged, report)


def _verify(args: argparse.Namespace) -> int:
    if args.saved_model is None and args.onnx is None:
        raise CLIError("verify needs --saved-model VERSION_DIR, --onnx PATH or both")
    for path in (args.saved_model, args.onnx):
        if path is not None and not os.path.exists(path):
            raise CLIError(f"export not found: {path}")
    model = _load_model(args.model)
    _describe(model)
    from keras_selfattn.export import verify

    report = _step(
        "Verifying against Keras",
        lambda: verify(
            model, args.saved_model, args.onnx, atol=args.atol, rtol=args.rtol
        ),
    )
    print(report, flush=True)
    return 0


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be positive: {text!r}")
    return value


def _tolerance(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0: {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of `keras-selfattn`."""
    from keras_selfattn.export.verify import DEFAULT_ATOL, DEFAULT_RTOL

    parser = _Parser(prog=PROG, description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(
        dest="command", required=True, parser_class=_Parser
    )

    def add_tolerances(sub):
        sub.add_argument(
            "--atol",
            type=_tolerance,
            default=DEFAULT_ATOL,
            help=f"absolute tolerance (default {DEFAULT_ATOL:g})",
        )
        sub.add_argument(
            "--rtol",
            type=_tolerance,
            default=DEFAULT_RTOL,
            help=f"relative tolerance (default {DEFAULT_RTOL:g})",
        )

    def add_saved_model_target(sub: argparse.ArgumentParser, what: str) -> None:
        """Adds --saved-model BASE_DIR (`what` is written), --name, --version."""
        sub.add_argument(
            "--saved-model",
            metavar="BASE_DIR",
            help=f"write BASE_DIR/NAME/VERSION/ ({what})",
        )
        sub.add_argument("--name", help="model name (default: MODEL file name)")
        sub.add_argument(
            "--version",
            type=_positive_int,
            help="version number (default: highest existing + 1)",
        )

    def add_onnx_target(sub: argparse.ArgumentParser) -> None:
        """--onnx OUT.onnx and --opset."""
        sub.add_argument("--onnx", metavar="OUT.onnx", help="write an ONNX file")
        sub.add_argument("--opset", type=int, help="ONNX opset, 13 to 18 (default 17)")

    export = commands.add_parser(
        "export", help="export to a TF Serving SavedModel and/or ONNX, then verify"
    )
    export.add_argument(
        "model", metavar="MODEL.keras", help="model saved with model.save"
    )
    add_saved_model_target(export, "TF Serving layout")
    export.add_argument(
        "--warmup",
        action="store_true",
        help="add assets.extra/tf_serving_warmup_requests",
    )
    add_onnx_target(export)
    export.add_argument(
        "--fuse-attention",
        action="store_true",
        help="make each SelfAttention one ONNX Attention node (upgrades to opset 23)",
    )
    add_tolerances(export)
    export.set_defaults(run=_export)

    verify = commands.add_parser("verify", help="compare exports with the Keras model")
    verify.add_argument(
        "model", metavar="MODEL.keras", help="model saved with model.save"
    )
    verify.add_argument(
        "--saved-model",
        metavar="VERSION_DIR",
        help="a SavedModel version folder (BASE_DIR/NAME/VERSION)",
    )
    verify.add_argument("--onnx", metavar="PATH", help="an ONNX file")
    add_tolerances(verify)
    verify.set_defaults(run=_verify)

    step = commands.add_parser(
        "export-decode-step",
        help="export the decoding step (inputs + key/value caches + index), "
        "then verify it step by step",
    )
    step.add_argument(
        "model", metavar="MODEL.keras", help="model saved with model.save"
    )
    step.add_argument(
        "--max-length",
        type=_positive_int,
        required=True,
        help="the caches' length (longest sequence decoded)",
    )
    add_saved_model_target(step, "signature decode_step")
    add_onnx_target(step)
    add_tolerances(step)
    step.set_defaults(run=_export_decode_step)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs `keras-selfattn` with `argv` (default: sys.argv[1:]).

    Returns:
        The exit status: 0 success, 1 failure, 2 usage error, 130 interrupt
        (SIGINT), 143 terminated (SIGTERM).
    """
    args = build_parser().parse_args(argv)
    received = _RECEIVED
    received.clear()
    status, message = 0, ""
    with _native_stderr_discarded(), _signals_recorded(received) as disarm:
        stderr = sys.stderr
        try:
            status = args.run(args)
        except (KeyboardInterrupt, _Terminated):
            if not received:  # raised without our handler (not the main thread)
                received.append(signal.SIGINT)
        except Exception as error:  # every failure ends in one line, no traceback
            if not received:
                if getattr(getattr(error, "report", None), "rows", ()):
                    print(error.report, flush=True)
                status, message = 1, one_line(error)
        finally:
            disarm()
        if received:  # whatever the work ended with (see _SIGNALS)
            status, word, _ = _SIGNALS[received[0]]
            message = f"{word}; nothing partial was left on disk"
        if status:
            print(f"{PROG}: error: {message}", file=stderr, flush=True)
        return status


if __name__ == "__main__":
    sys.exit(main())
