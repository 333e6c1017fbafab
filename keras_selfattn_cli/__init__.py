"""The `keras-selfattn` command: export a .keras model and verify exports.

    keras-selfattn [--verbose] export MODEL.keras [--saved-model BASE_DIR
                   [--name NAME] [--version N] [--warmup]] [--onnx OUT.onnx
                   [--opset N] [--fuse-attention] [--int8-matmul KERNEL]]
                   [--litert OUT.tflite
                   [--litert-shape B,T]] [--openvino OUT.xml] [--torch OUT.pt2]
                   [--decode-step --max-length N]
                   [--generate --max-length N [--jit-compile]]
    keras-selfattn [--verbose] verify MODEL.keras [--saved-model VERSION_DIR]
                   [--onnx PATH] [--litert PATH [--litert-shape B,T]]
                   [--openvino PATH [--openvino-precision f32|bf16]]
                   [--torch PATH]
    keras-selfattn [--verbose] convert MODEL.keras OUT.keras

`export-decode-step ...` is the same as `export --decode-step ...`.
This package is the command line's one home: the parser and dispatch here,
the process (signals, exit status, TensorFlow's log) in `_process`, the
commands in `_commands`. It lives outside `keras_selfattn` because importing
that package imports Keras and TensorFlow (it must: it registers the layer
for `keras.saving.load_model`, which imports no module of a package outside
Keras to find a class), and `--help` or an argument error should not wait for
them: they are imported once a command runs, with TensorFlow's native log
discarded unless `--verbose` (see `_process`). The format options come from
the export formats' table (`_table`). Any failure prints one line,
`keras-selfattn: error: ...`, on stderr and exits with status 1 (2 for usage
errors, 130 when interrupted, 143 when terminated by SIGTERM); with
`--verbose`, the traceback and the converter's log come before it.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Sequence

from keras_selfattn_cli import _convert, _process, _table
from keras_selfattn_cli._process import CLIError

PROG = "keras-selfattn"
TABLE = _table.load()


class _Parser(argparse.ArgumentParser):
    """argparse with one-line usage errors (exit status 2)."""

    def error(self, message: str):
        self.exit(2, f"{PROG}: error: {message} (see {PROG} --help)\n")


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


def _add_verbose(parser: argparse.ArgumentParser, default) -> None:
    parser.add_argument(
        "--verbose",
        action="store_true",
        default=default,
        help="show TensorFlow's native log (oneDNN, CUDA, CPU-feature notices)",
    )


def _add_tolerances(sub: argparse.ArgumentParser) -> None:
    # None: keras_selfattn.export.verify's defaults, which the help repeats
    # (tests/test_cli_startup.py checks they agree) without importing it.
    sub.add_argument(
        "--atol",
        type=_tolerance,
        help="absolute tolerance (default 1e-05)",
    )
    sub.add_argument(
        "--rtol",
        type=_tolerance,
        help="relative tolerance (default 0.0001)",
    )


def _add_command(
    commands,
    name: str,
    summary: str,
    *,
    options: Callable[[argparse.ArgumentParser], None],
    **defaults,
) -> None:
    """A command: MODEL.keras, `options`, the tolerances and --verbose;
    `defaults` name the command to run."""
    sub = commands.add_parser(name, help=summary)
    sub.add_argument("model", metavar="MODEL.keras", help="model saved with model.save")
    options(sub)
    _add_tolerances(sub)
    _add_verbose(sub, argparse.SUPPRESS)
    sub.set_defaults(**defaults)


def _argument_type(kind: str) -> Callable[[str], object] | None:
    """argparse's `type` for a `CliArgument.kind` (None: text)."""
    return {"int": int, "positive_int": _positive_int, "shape": _shape}.get(kind)


def _add_format_arguments(sub: argparse.ArgumentParser, command: str) -> None:
    """Each format's option (`--onnx OUT.onnx`), then the arguments holding
    the formats' own options (the table's `cli_arguments`) that `command`
    ("export" or "verify") takes."""
    for row in TABLE.ROWS:
        if command == "export":
            metavar, what = row.export_metavar, row.help
        else:
            metavar = row.verify_metavar
            what = (
                "a SavedModel version folder (BASE_DIR/NAME/VERSION)"
                if row.suffix is None
                else f"a {row.artifact} ({row.suffix})"
            )
        sub.add_argument(row.option, dest=row.name, metavar=metavar, help=what)
    for row in TABLE.ROWS:
        for arg in row.cli_arguments:
            if not (arg.exports if command == "export" else arg.verify):
                continue
            what = (arg.verify_help if command == "verify" else None) or arg.help
            if arg.kind == "flag":
                sub.add_argument(arg.flag, action="store_true", help=what)
                continue
            sub.add_argument(
                arg.flag,
                type=_argument_type(arg.kind),
                metavar=arg.metavar,
                default=arg.default,
                help=what,
                **({"choices": arg.choices} if arg.choices else {}),
            )


def _add_export_options(sub: argparse.ArgumentParser) -> None:
    _add_format_arguments(sub, "export")
    sub.add_argument(
        "--decode-step",
        action="store_true",
        help="export the decoding step (inputs + key/value caches + index) "
        "instead of the forward pass, verified step by step",
    )
    sub.add_argument(
        "--generate",
        action="store_true",
        help="export the whole generation as one call (signature 'generate': "
        "prompts in, tokens out; --saved-model, --onnx, --litert), verified "
        "against keras_selfattn.generate",
    )
    sub.add_argument(
        "--max-length",
        type=_positive_int,
        help="with --decode-step or --generate: the caches' length (longest sequence)",
    )


def _add_verify_options(sub: argparse.ArgumentParser) -> None:
    _add_format_arguments(sub, "verify")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of `keras-selfattn`."""
    parser = _Parser(prog=PROG, description=__doc__.split("\n")[0])
    _add_verbose(parser, False)
    commands = parser.add_subparsers(
        dest="command", required=True, parser_class=_Parser
    )
    export = {"options": _add_export_options, "run": "export"}
    _add_command(
        commands,
        "export",
        "export to SavedModel, ONNX, LiteRT, OpenVINO and/or torch, verify, "
        "then move into place",
        **export,
    )
    # The earlier name of `export --decode-step` (docs/decoding.md uses it).
    _add_command(
        commands,
        "export-decode-step",
        "the same as: export --decode-step",
        **export,
        decode_step=True,
    )
    _add_command(
        commands,
        "verify",
        "compare exports with the Keras model",
        options=_add_verify_options,
        run="verify",
    )
    _convert.add(commands)
    return parser


def _asked(args: argparse.Namespace) -> list:
    """The table's rows whose option was given, in staging order."""
    return [row for row in TABLE.ROWS if getattr(args, row.name) is not None]


def _check_export_options(args: argparse.Namespace) -> None:
    if not _asked(args):
        raise CLIError(
            "export needs at least one of "
            + ", ".join(f"{row.option} {row.export_metavar}" for row in TABLE.ROWS)
        )
    _check_format_arguments(args)
    if args.decode_step and args.generate:
        raise CLIError("--decode-step and --generate export different things: pick one")
    looping = "--decode-step" if args.decode_step else "--generate"
    if (args.decode_step or args.generate) and args.max_length is None:
        raise CLIError(f"{looping} needs --max-length N")
    if not (args.decode_step or args.generate) and args.max_length is not None:
        raise CLIError("--max-length needs --decode-step or --generate")
    other = [row.option for row in _asked(args) if not row.generator]
    if args.generate and other:
        writes = [row.option for row in TABLE.ROWS if row.generator]
        raise CLIError(
            f"--generate writes {_listed(writes)} (the loop stays in the graph); "
            f"not {', '.join(other)}"
        )


def _listed(flags: list[str]) -> str:
    """ "--a", "--a and --b", "--a, --b and --c"."""
    return flags[0] if len(flags) == 1 else f"{', '.join(flags[:-1])} and {flags[-1]}"


def _check_format_arguments(args: argparse.Namespace) -> None:
    """The formats' arguments (the table's `cli_arguments`): each needs its
    format and an export it applies to."""
    export = "decode_step" if args.decode_step else "forward"
    export = "generate" if args.generate else export
    asked = _asked(args)
    for row in TABLE.ROWS:
        arguments = [a for a in row.cli_arguments if a.exports]
        given = [a for a in arguments if getattr(args, a.dest) not in (None, False)]
        looped = [a for a in given if a.exports == ("generate",)]
        for arg in looped:
            if export != "generate" or row not in asked:
                raise CLIError(f"{arg.flag} needs --generate and {row.option}")
            if len(asked) > 1:
                others = [r.option for r in asked if r is not row]
                raise CLIError(
                    f"{arg.flag} applies to {row.option} alone: export "
                    f"{_listed(others)} in a command of their own"
                )
        if row not in asked and len(given) > len(looped):
            flags = [a.flag for a in given if a not in looped]
            verb = "needs" if len(flags) == 1 else "need"
            every = [a.flag for a in arguments if a.exports != ("generate",)]
            also = (
                f" ({_listed(every)} all need {row.option})" if len(every) > 1 else ""
            )
            raise CLIError(f"{_listed(flags)} {verb} {row.option}{also}")
    # An export's arguments that do not apply to it (the generator's own
    # were refused above).
    off = [
        arg
        for row in TABLE.ROWS
        for arg in row.cli_arguments
        if arg.exports not in ((), ("generate",)) and export not in arg.exports
    ]
    if any(getattr(args, arg.dest) not in (None, False) for arg in off):
        verb = "does" if len(off) == 1 else "do"
        flags = _listed([arg.flag for arg in off])
        raise CLIError(f"{flags} {verb} not apply to --{export.replace('_', '-')}")


def _check_verify_options(args: argparse.Namespace) -> None:
    asked = _asked(args)
    if not asked:
        raise CLIError(
            "verify needs at least one of "
            + ", ".join(f"{row.option} {row.verify_metavar}" for row in TABLE.ROWS)
        )
    for row in asked:
        if not os.path.exists(getattr(args, row.name)):
            raise CLIError(f"export not found: {getattr(args, row.name)}")


def _dispatch(args: argparse.Namespace) -> int:
    """Checks the options, then runs the command (importing Keras)."""
    if args.run == "convert":
        return _convert.run(args)
    if args.run == "export":
        _check_export_options(args)
    else:
        _check_verify_options(args)
    from keras_selfattn_cli import _commands  # imports Keras and the layer

    if args.run == "export":
        return _commands.run_export(args)
    return _commands.run_verify(args)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs `keras-selfattn` with `argv` (default: sys.argv[1:]).

    Returns:
        The exit status: 0 success, 1 failure (invalid combinations of
        options included), 2 arguments that cannot be parsed, 130 interrupt
        (SIGINT), 143 terminated (SIGTERM).
    """
    args = build_parser().parse_args(argv)
    return _process.run(lambda: _dispatch(args), prog=PROG, verbose=args.verbose)
