"""The `keras-selfattn` commands: export a .keras model and verify exports.

The command line itself (arguments, dispatch, signals, exit statuses) is the
`keras_selfattn_cli` package, which imports this module only once a command
runs. Every step is printed as it runs, then a parity table (each runtime
against Keras, each in a fresh process loading only that runtime). `export`
writes each export beside its target, verifies them all in one step and
moves them into place only when every one matched.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
import zipfile
from collections.abc import Callable, Mapping
from typing import Any

# `main` and `build_parser` are the console script's, kept importable here.
from keras_selfattn_cli import FILE_FORMATS, CLIError, build_parser, main
from keras_selfattn_cli._process import check_signals, one_line

__all__ = ["CLIError", "build_parser", "main", "one_line", "run_export", "run_verify"]


def _default_tolerances(args: argparse.Namespace) -> None:
    """Fills in `verify`'s tolerances where `--atol`/`--rtol` were not given."""
    from keras_selfattn.export.verify import DEFAULT_ATOL, DEFAULT_RTOL

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
    for fmt, _ in FILE_FORMATS:
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


def run_export(args: argparse.Namespace) -> int:
    """Stages each export, verifies them in one step, then moves them in.

    Its options were checked when it was dispatched; the exporters' own
    argument checks run before the model is loaded; an
    export appears only once every export of the command matched Keras.
    The SavedModel's version rename (the step that can lose a race with
    another export) runs before any file is linked in: if it fails, no file
    appears either.
    """
    from keras_selfattn.export import decode_step, pipeline
    from keras_selfattn.export._endpoint import build_endpoint
    from keras_selfattn.export.saved_model import write_warmup
    from keras_selfattn.export.verify import PATH_ARGUMENT

    _default_tolerances(args)
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


def run_verify(args: argparse.Namespace) -> int:
    """Compares the given exports with the model (options checked already)."""
    _default_tolerances(args)
    paths = {
        "saved_model_dir": args.saved_model,
        **{f"{fmt}_path": getattr(args, fmt) for fmt, _ in FILE_FORMATS},
    }
    paths = {k: v for k, v in paths.items() if v is not None}
    model = _load_model(args.model)
    _describe(model)
    report = _step("Verifying against Keras", lambda: _verify_paths(model, paths, args))
    print(report, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
