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
import os
import time
import zipfile
from collections.abc import Callable, Mapping
from typing import Any

import keras

import keras_selfattn  # noqa: F401  (registers SelfAttention)
from keras_selfattn.export import (
    decode_step,
    formats,
    generator,
    generator_graph,
    pipeline,
)
from keras_selfattn.export.endpoint import build_endpoint
from keras_selfattn.export.formats import table
from keras_selfattn.export.verify import (
    DEFAULT_ATOL,
    DEFAULT_RTOL,
    ParityReport,
    verify,
)
from keras_selfattn.serving.layout import VersionExistsError
from keras_selfattn_cli._process import CLIError, check_signals, one_line


def _default_tolerances(args: argparse.Namespace) -> None:
    """Fills in `verify`'s tolerances where `--atol`/`--rtol` were not given."""
    if args.atol is None:
        args.atol = DEFAULT_ATOL
    if args.rtol is None:
        args.rtol = DEFAULT_RTOL


def _step(label: str, action: Callable[[], object]) -> object:
    check_signals()  # a signal whose exception was swallowed: stop here
    print(f"{label} ...", end=" ", flush=True)
    start = time.perf_counter()
    try:
        result = action()
    except BaseException:
        print("failed", flush=True)
        raise
    print(f"done ({time.perf_counter() - start:.1f} s)", flush=True)
    return result


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


def run_export(args: argparse.Namespace) -> int:
    """Stages each export, verifies them in one step, then moves them in.

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
    writers: dict[str, formats.Writer | None] = {}
    if args.decode_step:
        step = decode_step.build_decode_step(model, args.max_length)
        print(
            f"  decode step: caches {', '.join(step.cache_names)} "
            f"(max_length {args.max_length})",
            flush=True,
        )
        target = step.target()
    elif args.generate:
        built = generator_graph.build_generator(
            model, args.max_length, args.jit_compile
        )
        target = built.target()
        model_path = os.path.abspath(args.model)
        writers = {f: generator.writer(built, model_path, f) for f in destinations}
        print(
            f"  generator: inputs {', '.join(target.input_names)}; outputs "
            f"{', '.join(target.output_names)} (max_length {args.max_length})",
            flush=True,
        )
    else:
        target = build_endpoint(model).target()
    # Files are linked in by the outer stack, after the inner one renamed
    # the SavedModel's version folder (the one folder format) into place.
    with contextlib.ExitStack() as files, contextlib.ExitStack() as folders:
        staged = {}
        for fmt, destination in destinations.items():
            export_format = formats.get(fmt)
            stack = files if export_format.row.suffix else folders
            writer = writers.get(fmt)
            with export_format.messages(destination.options) as messages:
                try:
                    staged[fmt] = _step(
                        export_format.label(destination, target.signature_name),
                        lambda d=destination, s=stack, w=writer: s.enter_context(
                            pipeline.stage(target, d, w)
                        ),
                    )
                finally:  # e.g. which layers were fused, also after a failure
                    for line in messages:
                        print(f"  {line}", flush=True)
        paths = {table.BY_NAME[f].path_argument: s.path for f, s in staged.items()}
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
        elif args.generate:
            report = _step(
                "Generating against keras_selfattn.generate",
                lambda: generator.verify_generator(
                    model, max_length=args.max_length, **paths
                ),
            )
        else:
            report = _step(
                "Verifying against Keras", lambda: _verify_paths(model, paths, args)
            )
    for export in staged.values():
        print(f"  wrote {export.target}", flush=True)
    print(report, flush=True)
    return 0


def _verify_paths(
    model: keras.Model, paths: Mapping[str, str], args: argparse.Namespace
) -> ParityReport:
    """`verify` of every path; a fixed-shape LiteRT file at its one shape."""
    shape = args.litert_shape
    fixed_rows = {r.path_argument for r in table.ROWS if "shape" in r.cli_options}
    fixed = {k: v for k, v in paths.items() if k in fixed_rows and shape}
    dynamic = {k: v for k, v in paths.items() if k not in fixed}
    precision = getattr(args, "openvino_precision", "f32")
    rows: list[Any] = []
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


def run_verify(args: argparse.Namespace) -> int:
    """Compares the given exports with the model (options checked already)."""
    _default_tolerances(args)
    paths = {
        row.path_argument: getattr(args, row.name)
        for row in table.ROWS
        if getattr(args, row.name) is not None
    }
    model = _load_model(args.model)
    _describe(model)
    report = _step("Verifying against Keras", lambda: _verify_paths(model, paths, args))
    print(report, flush=True)
    return 0
