"""`keras-selfattn convert MODEL.keras OUT.keras`: a saved model's
MultiHeadAttention and GroupQueryAttention self-attention calls as
SelfAttention (`keras_selfattn.convert`), saved, with the conversion's summary.

`add` registers the command without importing Keras; `run` imports it (and
the layer, not TensorFlow on the other backends). The converted model is
written beside OUT.keras, then moved in: an existing OUT.keras is never
replaced, and nothing is left on failure. A model saved from keras-hub's
classes (its config names `keras_hub`) loads with keras-hub imported, which
registers them.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import zipfile

from keras_selfattn_cli._process import CLIError, one_line


def add(commands) -> None:
    """Adds `convert` to the subcommands of `keras-selfattn`."""
    sub = commands.add_parser(
        "convert",
        help="MultiHeadAttention/GroupQueryAttention self-attention calls of a "
        "model as SelfAttention, with their weights (then: export as usual)",
    )
    sub.add_argument("model", metavar="MODEL.keras", help="model saved with model.save")
    sub.add_argument("output", metavar="OUT.keras", help="where the new model goes")
    sub.add_argument(
        "--verbose",
        action="store_true",
        default=argparse.SUPPRESS,
        help="show TensorFlow's native log",
    )
    sub.set_defaults(run="convert")


def _check_paths(model: str, output: str) -> None:
    if not os.path.isfile(model):
        raise CLIError(f"model file not found: {model}")
    if not zipfile.is_zipfile(model):
        raise CLIError(f"{model} is corrupt or not a Keras model: not a .keras zip")
    if not output.endswith(".keras"):
        raise CLIError(f"the converted model's file must end in .keras: {output}")
    if os.path.lexists(output):
        raise CLIError(f"{output} exists: convert never replaces a file")


def _import_keras_hub_if_named(model: str) -> None:
    """keras-hub registers its classes when imported: a file naming them
    needs it, and only then is it imported."""
    with zipfile.ZipFile(model) as archive:
        names = archive.namelist()
        config = archive.read("config.json") if "config.json" in names else b""
    if b'"keras_hub' not in config:
        return
    try:
        import keras_hub  # noqa: F401  (registers keras-hub's classes)
    except ImportError as error:
        raise CLIError(
            f"{model} holds keras-hub's classes: install keras-hub ({one_line(error)})"
        ) from None


def run(args: argparse.Namespace) -> int:
    """Loads, converts, saves; prints the summary. Returns 0."""
    _check_paths(args.model, args.output)
    _import_keras_hub_if_named(args.model)
    import keras

    import keras_selfattn

    try:
        model = keras.models.load_model(args.model, safe_mode=True)
    except Exception as error:
        raise CLIError(
            f"cannot load {args.model} as a Keras model: {one_line(error)}"
        ) from None
    try:
        converted = keras_selfattn.convert(model)
    except ValueError as error:
        raise CLIError(one_line(error)) from None
    print(converted.conversion_report, flush=True)
    directory, name = os.path.split(os.path.abspath(args.output))
    staged = os.path.join(directory, f".{name}.{secrets.token_hex(6)}.keras")
    try:
        converted.save(staged)
        # link, then unlink: fails rather than replace a file made meanwhile.
        os.link(staged, args.output)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(staged)
    print(f"wrote {args.output}", flush=True)
    return 0
