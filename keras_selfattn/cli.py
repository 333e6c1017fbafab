"""The `keras-selfattn` command: export a .keras model and verify exports.

    keras-selfattn export MODEL.keras [--saved-model BASE_DIR [--name NAME]
                   [--version N] [--warmup]] [--onnx OUT.onnx [--opset N]
                   [--fuse-attention]] [--litert OUT.tflite
                   [--litert-shape B,T]] [--openvino OUT.xml] [--torch OUT.pt2]
                   [--decode-step --max-length N]
    keras-selfattn verify MODEL.keras [--saved-model VERSION_DIR] [--onnx PATH]
                   [--litert PATH [--litert-shape B,T]] [--openvino PATH
                   [--openvino-precision f32|bf16]] [--torch PATH]

`export-decode-step ...` is the same as `export --decode-step ...`.
Every step is printed as it runs, then a parity table (each runtime against
Keras, each in a fresh process loading only that runtime). `export` writes
each export beside its target, verifies them all in one step and moves them
into place only when every one matched. Any
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


def _print_written(staged: Mapping[str, Any], report: object) -> int:
    """Prints the moved-in exports and the parity report; returns status 0."""
    for export in staged.values():
        print(f"  wrote {export.target}", flush=True)
    print(report, flush=True)
    return 0


# The file formats' options and metavars, in staging order.
_FILE_FORMATS = (
    ("onnx", "OUT.onnx"),
    ("litert", "OUT.tflite"),
    ("openvino", "OUT.xml"),
    ("torch", "OUT.pt2"),
)
_TITLE = {"onnx": "ONNX", "litert": "LiteRT", "openvino": "OpenVINO", "torch": "torch"}


def _check_destinations(args: argparse.Namespace, name: str) -> dict:
    """The exporters' target checks, before the model is loaded.

    Returns:
        {format: `pipeline.Destination`} for every format asked for, the
        SavedModel first.

    Raises:
        CLIError: if the SavedModel version exists.
    """
    from keras_selfattn.export import pipeline
    from keras_selfattn.serving.layout import VersionExistsError

    destinations = {}
    if args.saved_model is not None:
        try:
            destinations["saved_model"] = pipeline.check_destination(
                "saved_model",
                args.saved_model,
                name=name,
                version=args.version,
                argument="--saved-model",
            )
        except VersionExistsError as error:
            raise CLIError(
                f"version {error.version} of {error.name!r} already exists in "
                f"{error.model_dir}; it is never overwritten (pass another "
                "--version or omit it)"
            ) from None
    for fmt, _ in _FILE_FORMATS:
        path = getattr(args, fmt)
        if path is not None:
            destinations[fmt] = pipeline.check_destination(
                fmt,
                path,
                opset=args.opset,
                shape=args.litert_shape,
                argument=f"--{fmt}",
            )
    return destinations


def _check_export_options(args: argparse.Namespace) -> None:
    asked = [fmt for fmt, _ in _FILE_FORMATS if getattr(args, fmt) is not None]
    if args.saved_model is None and not asked:
        raise CLIError(
            "export needs at least one of --saved-model BASE_DIR, --onnx OUT.onnx, "
            "--litert OUT.tflite, --openvino OUT.xml, --torch OUT.pt2"
        )
    if args.saved_model is None and (args.name or args.version or args.warmup):
        raise CLIError("--name, --version and --warmup need --saved-model")
    if args.onnx is None and args.opset is not None:
        raise CLIError("--opset needs --onnx")
    if args.onnx is None and args.fuse_attention:
        raise CLIError("--fuse-attention needs --onnx")
    if args.litert is None and args.litert_shape is not None:
        raise CLIError("--litert-shape needs --litert")
    if args.decode_step and args.max_length is None:
        raise CLIError("--decode-step needs --max-length N")
    if not args.decode_step and args.max_length is not None:
        raise CLIError("--max-length needs --decode-step")
    if args.decode_step and (args.warmup or args.fuse_attention):
        raise CLIError("--warmup and --fuse-attention do not apply to --decode-step")


def _stage_label(destination, decode_step: bool) -> str:
    if destination.format == "saved_model":
        signature = " (signature 'decode_step')" if decode_step else ""
        return (
            f"Exporting SavedModel {destination.name!r}{signature} "
            f"under {destination.path}"
        )
    detail = ""
    if destination.format == "onnx":
        detail = f" (opset {destination.opset or 'default'})"
    if destination.shape:
        detail = f" (fixed shape {destination.shape[0]}x{destination.shape[1]})"
    return f"Exporting {_TITLE[destination.format]}{detail} to {destination.path}"


def _export(args: argparse.Namespace) -> int:
    """Stages each export, verifies them in one step, then moves them in.

    The exporters' own argument checks run before the model is loaded; an
    export appears only once every export of the command matched Keras.
    The SavedModel's version rename (the step that can lose a race with
    another export) runs before any file is linked in: if it fails, no file
    appears either.
    """
    from keras_selfattn.export import decode_step, pipeline
    from keras_selfattn.export._endpoint import build_endpoint
    from keras_selfattn.export.saved_model import write_warmup
    from keras_selfattn.export.verify import PATH_ARGUMENT

    _check_export_options(args)
    name = args.name
    if name is None:
        name = os.path.splitext(os.path.basename(args.model))[0]
    destinations = _check_destinations(args, name)

    model = _load_model(args.model)
    _describe(model)
    if args.decode_step:
        step = decode_step.build_decode_step(model, args.max_length)
        print(
            f"  decode step: caches {', '.join(step.cache_names)} "
            f"(max_length {args.max_length})",
            flush=True,
        )
        target, endpoint = step.target(), None
    else:
        endpoint = build_endpoint(model)
        target = endpoint.target()
    # Files are linked in by the outer stack, after the inner one renamed
    # the SavedModel's version folder into place.
    with contextlib.ExitStack() as files, contextlib.ExitStack() as saved_model:
        staged = {}
        for fmt, destination in destinations.items():
            label = _stage_label(destination, args.decode_step)
            options: dict[str, Any] = {}
            if fmt == "saved_model" and args.warmup:
                label += " with warmup requests"
                options["warmup"] = lambda d: write_warmup(endpoint, d, name)
            fusion_log: list[str] = []
            with contextlib.ExitStack() as logging:
                if fmt == "onnx" and args.fuse_attention:
                    from keras_selfattn.export import fused_attention

                    opset = fused_attention.FUSED_OPSET
                    label = label.replace(")", f" -> {opset}, fused Attention)")
                    options["fuse"] = endpoint
                    fusion_log = logging.enter_context(fused_attention.collect_log())
                stack = saved_model if fmt == "saved_model" else files
                try:
                    staged[fmt] = _step(
                        label,
                        lambda d=destination, o=options, s=stack: s.enter_context(
                            pipeline.stage(target, d, **o)
                        ),
                    )
                finally:  # which layers were fused, also when the export failed
                    for line in fusion_log:
                        print(f"  {line}", flush=True)
        paths = {PATH_ARGUMENT[f]: s.path for f, s in staged.items()}
        if args.decode_step:
            report = _step(
                "Decoding step by step against Keras",
                lambda: decode_step.verify_decode_step(
                    model,
                    max_length=args.max_length,
                    atol=args.atol,
                    rtol=args.rtol,
                    **paths,
                ),
            )
        else:
            report = _step(
                "Verifying against Keras", lambda: _verify_paths(model, paths, args)
            )
    return _print_written(staged, report)


def _verify_paths(model, paths: Mapping[str, str], args: argparse.Namespace):
    """`verify` of every path; a fixed-shape LiteRT file at its one shape."""
    from keras_selfattn.export import ParityReport, verify

    shape = args.litert_shape
    fixed = {k: v for k, v in paths.items() if k == "litert_path" and shape}
    dynamic = {k: v for k, v in paths.items() if k not in fixed}
    precision = getattr(args, "openvino_precision", "f32")
    rows = []
    for group, shapes in ((dynamic, None), (fixed, [shape])):
        if group:
            report = verify(
                model,
                atol=args.atol,
                rtol=args.rtol,
                shapes=shapes,
                openvino_precision=precision,
                **group,
            )
            rows.extend(report.rows)
    return ParityReport(tuple(rows), args.atol, args.rtol)


def _verify(args: argparse.Namespace) -> int:
    paths = {
        "saved_model_dir": args.saved_model,
        **{f"{fmt}_path": getattr(args, fmt) for fmt, _ in _FILE_FORMATS},
    }
    paths = {k: v for k, v in paths.items() if v is not None}
    if not paths:
        raise CLIError(
            "verify needs at least one of --saved-model VERSION_DIR, --onnx, "
            "--litert, --openvino, --torch"
        )
    for path in paths.values():
        if not os.path.exists(path):
            raise CLIError(f"export not found: {path}")
    model = _load_model(args.model)
    _describe(model)
    report = _step("Verifying against Keras", lambda: _verify_paths(model, paths, args))
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


def _shape(text: str) -> tuple[int, int]:
    parts = text.split(",")
    if len(parts) != 2:
        raise argparse.ArgumentTypeError(f"not BATCH,TIME: {text!r}")
    return (_positive_int(parts[0]), _positive_int(parts[1]))


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

    def add_export(sub: argparse.ArgumentParser) -> None:
        sub.add_argument(
            "model", metavar="MODEL.keras", help="model saved with model.save"
        )
        sub.add_argument(
            "--saved-model",
            metavar="BASE_DIR",
            help="write BASE_DIR/NAME/VERSION/ (TF Serving layout)",
        )
        sub.add_argument("--name", help="model name (default: MODEL file name)")
        sub.add_argument(
            "--version",
            type=_positive_int,
            help="version number (default: highest existing + 1)",
        )
        sub.add_argument(
            "--warmup",
            action="store_true",
            help="add assets.extra/tf_serving_warmup_requests",
        )
        sub.add_argument("--onnx", metavar="OUT.onnx", help="write an ONNX file")
        sub.add_argument(
            "--opset",
            type=int,
            help="ONNX opset, 13 to 18 (default 17 on TensorFlow, the "
            "converter's own on JAX and torch)",
        )
        sub.add_argument(
            "--fuse-attention",
            action="store_true",
            help="make each SelfAttention one ONNX Attention node (upgrades to "
            "opset 23; TensorFlow)",
        )
        sub.add_argument(
            "--litert", metavar="OUT.tflite", help="write a LiteRT (.tflite) file"
        )
        sub.add_argument(
            "--litert-shape",
            type=_shape,
            metavar="BATCH,TIME",
            help="fix the LiteRT file's input shape (required on torch)",
        )
        sub.add_argument(
            "--openvino", metavar="OUT.xml", help="write OpenVINO IR (.xml + .bin)"
        )
        sub.add_argument(
            "--torch", metavar="OUT.pt2", help="write a torch.export program (torch)"
        )
        sub.add_argument(
            "--decode-step",
            action="store_true",
            help="export the decoding step (inputs + key/value caches + index) "
            "instead of the forward pass, verified step by step",
        )
        sub.add_argument(
            "--max-length",
            type=_positive_int,
            help="with --decode-step: the caches' length (longest sequence)",
        )
        add_tolerances(sub)
        sub.set_defaults(run=_export)

    add_export(
        commands.add_parser(
            "export",
            help="export to SavedModel, ONNX, LiteRT, OpenVINO and/or torch, "
            "verify, then move into place",
        )
    )
    # The earlier name of `export --decode-step` (docs/decoding.md uses it).
    alias = commands.add_parser(
        "export-decode-step", help="the same as: export --decode-step"
    )
    add_export(alias)
    alias.set_defaults(decode_step=True)

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
    verify.add_argument("--litert", metavar="PATH", help="a LiteRT (.tflite) file")
    verify.add_argument(
        "--litert-shape",
        type=_shape,
        metavar="BATCH,TIME",
        help="the LiteRT file's fixed input shape, if it has one",
    )
    verify.add_argument("--openvino", metavar="PATH", help="an OpenVINO .xml file")
    verify.add_argument(
        "--openvino-precision",
        choices=("f32", "bf16"),
        default="f32",
        help="OpenVINO's inference precision (default f32; bf16 is OpenVINO's "
        "default on CPUs with AVX512-BF16: pass tolerances that fit it)",
    )
    verify.add_argument("--torch", metavar="PATH", help="a torch .pt2 file")
    add_tolerances(verify)
    verify.set_defaults(run=_verify)
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
