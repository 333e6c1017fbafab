"""The `keras-selfattn` commands: export a .keras model and verify exports.

Imported once a command runs (it imports Keras, TensorFlow and the layer).
Every step is printed as it runs, then a parity table (each runtime
against Keras, each in a fresh process loading only that runtime). `export`
writes each export beside its target, verifies them all in one step and
moves them into place only when every one matched.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import time
import zipfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import keras

import keras_selfattn  # noqa: F401  (registers SelfAttention)
from keras_selfattn.export import (
    decode_step,
    formats,
    forward,
    generator,
    pipeline,
)
from keras_selfattn.export.forward.check import (
    DEFAULT_ATOL,
    DEFAULT_RTOL,
    ParityReport,
    verify,
)
from keras_selfattn.export.signature import Signature
from keras_selfattn.serving.layout import VersionExistsError
from keras_selfattn_cli._process import CLIError, check_signals, one_line
from keras_selfattn_runtimes import table


def _default_tolerances(args: argparse.Namespace) -> None:
    """Fills in `verify`'s tolerances where `--atol`/`--rtol` were not given."""
    if args.atol is None:
        args.atol = DEFAULT_ATOL
    if args.rtol is None:
        args.rtol = DEFAULT_RTOL


@contextlib.contextmanager
def _stepping(label: str) -> Iterator[None]:
    """A step as it runs: `label ...`, then `done (N s)` or `failed`."""
    check_signals()  # a signal whose exception was swallowed: stop here
    print(f"{label} ...", end=" ", flush=True)
    start = time.perf_counter()
    try:
        yield
    except BaseException:
        print("failed", flush=True)
        raise
    print(f"done ({time.perf_counter() - start:.1f} s)", flush=True)


def _step(label: str, action: Callable[[], object]) -> object:
    with _stepping(label):
        return action()


def _load_model(path: str) -> keras.Model:
    if not os.path.exists(path):
        raise CLIError(f"model file not found: {path}")
    if not os.path.isfile(path):
        raise CLIError(f"model path is not a file: {path}")
    if path.endswith(".keras") and not zipfile.is_zipfile(path):
        raise CLIError(f"{path} is corrupt or not a Keras model: not a .keras zip")

    def load():
        try:
            return keras.models.load_model(path, safe_mode=True)
        except Exception as error:
            raise CLIError(
                f"cannot load {path} as a Keras model: {one_line(error)}"
            ) from None

    model = _step(f"Loading {path} (safe_mode=True)", load)
    if not isinstance(model, keras.Model):
        raise CLIError(f"{path} holds a {type(model).__name__}, not a keras.Model")
    return model


def _describe(model: keras.Model) -> None:
    inputs = ", ".join(
        f"{t.name} {str(t.dtype)} {tuple(t.shape)}" for t in model.inputs
    )
    print(f"  model {model.name!r}: inputs {inputs}", flush=True)


def _options(row: table.FormatRow, args: argparse.Namespace, name: str) -> dict:
    """The format's options from the command's arguments (its row's
    `cli_options`)."""
    values = {**vars(args), "name": name}
    return {option: values[argument] for option, argument in row.cli_options.items()}


def _check_destinations(args: argparse.Namespace, name: str) -> dict:
    """The exporters' target checks, before the model is loaded.

    Returns:
        {format name: `formats.Destination`} for every format asked for,
        in the table's order (the SavedModel first).

    Raises:
        CLIError: if the SavedModel version exists.
    """
    destinations = {}
    for row in table.ROWS:
        path = getattr(args, row.name)
        if path is None:
            continue
        check = generator.check_destination if args.generate else None
        try:
            destinations[row.name] = (check or pipeline.check_destination)(
                row.name, path, argument=row.option, **_options(row, args, name)
            )
        except VersionExistsError as error:
            raise CLIError(
                f"version {error.version} of {error.name!r} already exists in "
                f"{error.model_dir}; it is never overwritten (pass another "
                "--version or omit it)"
            ) from None
    return destinations


@dataclasses.dataclass
class _Command(pipeline.Target):
    """The command's export as `pipeline.export` runs it: its destinations,
    checked with the command's option names before the model was loaded;
    `target`'s graphs and writers; each step printed as it runs.

    Attributes:
        target: What the command exports (`_command`).
        destinations: {format: its checked `formats.Destination`}.
        check_label: The line printed while the check runs.
        describe: The line printed of the first graph built, or None.
        verify: The check of the staged artifacts, {format: path}; None:
            the target's own (`target.check`).
        report: The check's `ParityReport`, once it ran.
    """

    target: pipeline.Target
    destinations: Mapping[str, formats.Destination]
    check_label: str
    describe: Callable[[Signature], str | None] = lambda built: None
    verify: Callable[[Mapping[str, str]], ParityReport] | None = None
    report: ParityReport | None = None
    _described: bool = False

    def destination(
        self, export_format: str, path: str | os.PathLike
    ) -> formats.Destination:
        # The target's own refusals first (a decoding step's backends, a
        # quantized model's formats), as the library's exporters make them.
        self.target.refuse(export_format)
        return self.destinations[export_format]

    def plan(self, export_formats: Sequence[str], check: bool) -> None:
        self.target.plan(export_formats, check)

    def build(self, export_format: str) -> Signature:
        built = self.target.build(export_format)
        line = None if self._described else self.describe(built)
        self._described = True
        if line is not None:
            print(line, flush=True)
        return built

    def writing(
        self, export_format: str
    ) -> contextlib.AbstractContextManager[formats.Writer | None]:
        return self.target.writing(export_format)

    @contextlib.contextmanager
    def staging(
        self,
        export_format: str,
        destination: formats.Destination,
        built: Signature,
    ) -> Iterator[None]:
        """The format's step, then the lines its write shows (e.g. which
        layers were fused), also after a failure."""
        writes = formats.get(export_format)
        with writes.messages(destination.options) as messages:
            try:
                with _stepping(writes.label(destination, built.signature_name)):
                    yield
            finally:
                for line in messages:
                    print(f"  {line}", flush=True)

    def check(self, staged: Mapping[str, str]) -> ParityReport:
        verify = self.verify or self.target.check
        self.report = _step(self.check_label, lambda: verify(staged))
        return self.report


def _command(
    model: keras.Model,
    args: argparse.Namespace,
    destinations: Mapping[str, formats.Destination],
) -> _Command:
    """The command's export: the forward pass (`forward.Forward`), the
    decoding step (`decode_step.DecodeStepExport`) or the generator
    (`generator.GeneratorExport`, written from the command's .keras file)."""
    if args.decode_step:
        step = decode_step.DecodeStepExport(
            model, args.max_length, {}, {"atol": args.atol, "rtol": args.rtol}
        )
        # A step's inputs: the model's, its caches, the index (decode_step).
        return _Command(
            step,
            destinations,
            "Decoding step by step against Keras",
            lambda built: (
                f"  decode step: caches {', '.join(built.input_names[1:-1])} "
                f"(max_length {args.max_length})"
            ),
        )
    if args.generate:
        keras_path = os.path.abspath(args.model)
        loop = generator.GeneratorExport(
            model, args.max_length, args.jit_compile, {}, keras_path
        )
        return _Command(
            loop,
            destinations,
            "Generating against keras_selfattn.generate",
            lambda built: (
                f"  generator: inputs {', '.join(built.input_names)}; outputs "
                f"{', '.join(built.output_names)} (max_length {args.max_length})"
            ),
        )
    passes = forward.Forward(model, None, args.atol, args.rtol, "float32", {})
    return _Command(
        passes,
        destinations,
        "Verifying against Keras",
        verify=lambda staged: _verify_paths(model, staged, args, passes),
    )


def run_export(args: argparse.Namespace) -> int:
    """Stages each export, verifies them in one step, then moves them in
    (`pipeline.export`).

    Its options were checked when it was dispatched; the exporters' own
    argument checks run before the model is loaded; an export appears only
    once every export of the command matched Keras. The SavedModel's
    version rename (the step that can lose a race with another export)
    runs before any file is linked in: if it fails, no file appears either.
    """
    _default_tolerances(args)
    name = args.name
    if name is None:
        name = os.path.splitext(os.path.basename(args.model))[0]
    destinations = _check_destinations(args, name)

    model = _load_model(args.model)
    _describe(model)
    command = _command(model, args, destinations)
    paths = {f: destination.path for f, destination in destinations.items()}
    for path in pipeline.export(command, paths).values():
        print(f"  wrote {path}", flush=True)
    print(command.report, flush=True)
    return 0


def _verify_paths(
    model: keras.Model,
    paths: Mapping[str, str],
    args: argparse.Namespace,
    exported: forward.Forward | None = None,
) -> ParityReport:
    """`verify` of every path; a fixed-shape LiteRT file at its one shape.
    An export's check runs on the endpoint its export built (`exported`)."""
    shape = args.litert_shape
    fixed_shape = {r.name for r in table.ROWS if "shape" in r.cli_options}
    fixed = {f: path for f, path in paths.items() if f in fixed_shape and shape}
    dynamic = {f: path for f, path in paths.items() if f not in fixed}
    precision = getattr(args, "openvino_precision", "f32")
    rows: list[Any] = []
    for group, shapes in ((dynamic, None), (fixed, [shape])):
        if group and exported is not None:
            runtime = {"openvino_precision": precision}
            rows.extend(exported.check_at(group, shapes, runtime).rows)
        elif group:
            report = verify(
                model,
                atol=args.atol,
                rtol=args.rtol,
                shapes=shapes,
                openvino_precision=precision,
                paths=group,
            )
            rows.extend(report.rows)
    return ParityReport(tuple(rows), args.atol, args.rtol)


def run_verify(args: argparse.Namespace) -> int:
    """Compares the given exports with the model (options checked already)."""
    _default_tolerances(args)
    paths = {
        row.name: getattr(args, row.name)
        for row in table.ROWS
        if getattr(args, row.name) is not None
    }
    model = _load_model(args.model)
    _describe(model)
    report = _step("Verifying against Keras", lambda: _verify_paths(model, paths, args))
    print(report, flush=True)
    return 0
