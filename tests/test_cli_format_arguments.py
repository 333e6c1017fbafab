"""The command line's format arguments come from the export formats' table:
a row's `cli_arguments` become `export`'s (and `verify`'s) arguments, each
refused without its format or with an export it does not apply to."""

from __future__ import annotations

import dataclasses

import pytest

import keras_selfattn_cli as cli
from keras_selfattn_runtimes import table

# A sixth format, as a new row would declare it: one option, one argument.
SIXTH = dataclasses.replace(
    table.TORCH,
    name="sixth",
    title="Sixth",
    suffix=".six",
    path_argument="sixth_path",
    export_metavar="OUT.six",
    help="write a sixth file",
    options=("units",),
    cli_arguments=(
        table.CliArgument("sixth_units", "units", "its compute units", "text", "U"),
    ),
)


@pytest.fixture
def parser(monkeypatch):
    monkeypatch.setattr(table, "ROWS", (*table.ROWS, SIXTH))
    return cli.build_parser()


def _refusal(parser, *argv: str) -> str | None:
    args = parser.parse_args(["export", "m.keras", *argv])
    try:
        cli._check_export_options(args)
    except cli.CLIError as error:
        return str(error)
    return None


def test_a_new_rows_argument_is_parsed_and_named_in_help(parser, capsys):
    args = parser.parse_args(
        ["export", "m.keras", "--sixth", "m.six", "--sixth-units", "npu"]
    )
    assert (args.sixth, args.sixth_units) == ("m.six", "npu")
    assert SIXTH.cli_options == {"units": "sixth_units"}
    with pytest.raises(SystemExit):
        parser.parse_args(["export", "--help"])
    out = capsys.readouterr().out
    assert "--sixth OUT.six" in out and "--sixth-units U" in out
    assert "its compute units" in out
    assert _refusal(parser, "--sixth", "m.six", "--sixth-units", "npu") is None


def test_a_new_rows_argument_needs_its_format(parser):
    assert _refusal(parser, "--onnx", "m.onnx", "--sixth-units", "npu") == (
        "--sixth-units needs --sixth"
    )


@pytest.mark.parametrize(
    "argv, refusal",
    [
        (["--onnx", "m.onnx", "--warmup"], "--warmup needs --saved-model"),
        (["--saved-model", "d", "--opset", "17"], "--opset needs --onnx"),
        (
            ["--onnx", "m.onnx", "--litert-shape", "2,8"],
            "--litert-shape needs --litert",
        ),
        (
            ["--onnx", "m.onnx", "--generate", "--max-length", "8", "--jit-compile"],
            "--jit-compile needs --generate and --saved-model",
        ),
        (
            ["--saved-model", "d", "--decode-step", "--max-length", "8", "--warmup"],
            "do not apply to --decode-step",
        ),
        (
            ["--onnx", "m.onnx", "--generate", "--max-length", "8", "--fuse-attention"],
            "--fuse-attention does not apply to --generate",
        ),
    ],
)
def test_the_tables_arguments_are_refused_where_they_do_not_apply(argv, refusal):
    assert refusal in _refusal(cli.build_parser(), *argv)


def test_every_rows_argument_is_a_command_line_argument():
    export = cli.build_parser()._subparsers._group_actions[0].choices["export"]
    verify = cli.build_parser()._subparsers._group_actions[0].choices["verify"]
    flags = lambda p: {s for a in p._actions for s in a.option_strings}  # noqa: E731
    for row in table.ROWS:
        for arg in row.cli_arguments:
            assert (arg.flag in flags(export)) == bool(arg.exports), arg
            assert (arg.flag in flags(verify)) == arg.verify, arg


def test_int4_inputs_need_generate_and_onnx(capsys):
    parser = cli.build_parser()
    onnx = ["--onnx", "m.onnx", "--int4-inputs", "int8"]
    assert _refusal(parser, *onnx) == "--int4-inputs needs --generate and --onnx"
    assert _refusal(parser, *onnx, "--generate", "--max-length", "8") is None
    args = parser.parse_args(["export", "m.keras", *onnx])
    assert table.ONNX.cli_options["int4_inputs"] == "int4_inputs"
    assert args.int4_inputs == "int8"
    with pytest.raises(SystemExit):
        parser.parse_args(["export", "m.keras", "--onnx", "m", "--int4-inputs", "int4"])
    assert "invalid choice: 'int4'" in capsys.readouterr().err
