"""One pipeline for every format and target: check, stage, verify, move in.

`check_destination` runs before any work (the command line runs it before
loading the model): the backend, the packages, the path and the format's
options (`formats.Format.destination`). `stage` writes a `Signature`
(the model's forward endpoint, its decoding step or its generator) into a
hidden temporary beside the destination and moves it into place when its
`with` block ends without error; verification goes in that block.
`export(target, {format: path})` is the three steps for any `Target` (the
forward pass's in `exporters`, the decoding step's in `decode_step`, the
generator's in `generator`) and any formats; between staging and the
check, `formats.released` drops what tracing the artifacts kept.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping, Sequence

from keras_selfattn.export import _files, formats
from keras_selfattn.export.formats import Destination, Writer, released
from keras_selfattn.export.signature import Signature
from keras_selfattn_runtimes import table


def check_destination(
    export_format: str,
    path: str | os.PathLike,
    *,
    argument: str | None = None,
    backend: str | None = None,
    **options: object,
) -> Destination:
    """Checks a destination before any work (backend, path, options).

    Args:
        export_format: One of `formats.NAMES`.
        path: SavedModel base dir, or the file to create.
        argument: How the caller names `path` in errors (default
            "base_dir" for a SavedModel, else "path").
        backend: The backend that writes the artifact, when another
            process writes it (`export.generator._writer`); default this process's.
        **options: The format's options (`name`, `version`, `warmup`,
            `models_config` for a SavedModel; `opset`, `fuse_attention` for
            ONNX; `shape` for LiteRT).

    Raises:
        ValueError: for a format the backend cannot export (one line naming
            the backend that can), or an invalid argument.
        FileExistsError, layout.VersionExistsError: if the target exists.
        ImportError: if the format's packages are missing (with the extra).
    """
    export = formats.get(export_format)
    if argument is None:
        argument = "path" if export.row.suffix else "base_dir"
    return export.destination(path, argument, options, backend)


@contextlib.contextmanager
def stage(
    target: Signature, destination: Destination, writer: Writer | None = None
) -> Iterator[_files.Staged]:
    """Writes `target` beside its destination; moves it in after the block.

    Args:
        target: What to export (`Endpoint.target()`, `DecodeStep.target()`).
        destination: From `check_destination`.
        writer: Writes the staged artifact instead of the format's own
            `write` (`export.generator._writer`).

    Yields:
        The `_files.Staged` export (verify `staged.path` in the block).
    """
    export_format = formats.get(destination.format)
    with contextlib.ExitStack() as stack:
        # What tracing kept goes back before the block verifies.
        with released(target.model):
            staged = stack.enter_context(
                export_format.stage(target, destination, writer)
            )
        yield staged


def format_options(
    export_format: str, given: Mapping[str, object]
) -> dict[str, object]:
    """The options of `given` that the format takes (its row's `options`);
    none for an unknown format (`check_destination` refuses it)."""
    row = table.BY_NAME.get(export_format)
    return {k: v for k, v in given.items() if row is not None and k in row.options}


class Target:
    """What a model exports (its forward pass, its decoding step, its
    generator), as `export` runs it; each module of one says what it
    exports, what it refuses and what it is checked against.

    Subclasses implement `destination`, `build` and `check`, `writing`
    where another process writes the artifact, and `staging` to show each
    artifact's staging.
    """

    def refuse(self, export_format: str) -> None:
        """Raises ValueError (one line) if this target cannot export in the
        format: nothing by default."""

    def destination(self, export_format: str, path: str | os.PathLike) -> Destination:
        """Refuses what this target cannot export in the format (`refuse`),
        then checks the destination (`check_destination`), before any work."""
        raise NotImplementedError

    def plan(self, export_formats: Sequence[str], check: bool) -> None:
        """Told by `export` after every destination's check, before any
        artifact is built: the formats it writes, in order, and whether it
        checks them (a generator's check computes its references while a
        converter runs): nothing by default."""

    def build(self, export_format: str) -> Signature:
        """The graph written in the format (after every destination's check)."""
        raise NotImplementedError

    def check(self, staged: Mapping[str, str]) -> object:
        """Checks the staged artifacts, {format: path}, against Keras in
        fresh processes of their runtimes (one check for them all).

        Raises:
            ParityError: if one differs.
        """
        raise NotImplementedError

    def writing(
        self, export_format: str
    ) -> contextlib.AbstractContextManager[Writer | None]:
        """A context yielding who writes the format's artifact: None (the
        format's own `write`) by default."""
        return contextlib.nullcontext()

    def staging(
        self, export_format: str, destination: Destination, built: Signature
    ) -> contextlib.AbstractContextManager[None]:
        """A context around the staging of `built` at `destination` (the
        command line prints its step and the format's messages there):
        nothing by default."""
        return contextlib.nullcontext()


def export(
    target: Target, paths: Mapping[str, str | os.PathLike], check: bool = True
) -> dict[str, str]:
    """Exports `target` in every format of `paths` ({format: path}).

    Every destination is checked (or refused) before any work; then each
    artifact is staged beside its destination, all are checked together
    against Keras (`Target.check`, when `check`) and moved into place,
    folders (the SavedModel's version) before files.

    Returns:
        {format: where its artifact is}.

    Raises:
        ValueError: if `paths` is empty, or as `Target.destination` refuses.
        Whatever `Target.check` raises (ParityError): nothing is then left.
    """
    if not paths:
        raise ValueError(
            f"`paths` must name at least one format. Received: paths={paths!r}"
        )
    destinations = {f: target.destination(f, path) for f, path in paths.items()}
    target.plan(list(destinations), check)
    with contextlib.ExitStack() as files, contextlib.ExitStack() as folders:
        staged = {}
        for export_format, destination in destinations.items():
            stack = files if table.BY_NAME[export_format].suffix else folders
            built = target.build(export_format)
            writer = stack.enter_context(target.writing(export_format))
            with target.staging(export_format, destination, built):
                staged[export_format] = stack.enter_context(
                    stage(built, destination, writer)
                )
        if check:
            target.check({f: artifact.path for f, artifact in staged.items()})
    return {f: artifact.target for f, artifact in staged.items()}
