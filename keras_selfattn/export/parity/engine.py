"""The check engine of `verify`, `verify_decode_step` and the generator's
check: their arguments checked (ValueErrors naming the argument and the
value), artifacts found on disk, run in fresh processes, compared with
Keras's outputs by the rules (`rules`)."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from keras_selfattn.export import formats
from keras_selfattn.export.formats import one_line
from keras_selfattn.export.parity import rules, runner
from keras_selfattn.export.parity.report import ParityError, ParityReport
from keras_selfattn.export.parity.rules import ParityRow
from keras_selfattn.export.signature import Signature
from keras_selfattn_runtimes import table

# The argument of `verify` (and `verify_decode_step`) naming each format's artifact.
PATH_ARGUMENT = {row.name: row.path_argument for row in table.ROWS}


def is_shape(shape: object) -> bool:
    """Whether `shape` is a (batch, time) pair of positive ints."""
    return (
        isinstance(shape, Sequence)
        and len(shape) == 2
        and all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape)
    )


def check_shapes(shapes) -> tuple[tuple[int, int], ...]:
    if not all(is_shape(shape) for shape in shapes):
        raise ValueError(
            "`shapes` must be a sequence of (batch, time) pairs of positive "
            f"ints. Received: shapes={shapes!r}"
        )
    if not shapes:
        raise ValueError(f"`shapes` must not be empty. Received: shapes={shapes!r}")
    return tuple((shape[0], shape[1]) for shape in shapes)


def artifact_paths(
    keywords: Mapping[str, object],
    paths: Mapping[str, str | os.PathLike | None] | None = None,
    formats: Sequence[str] = table.NAMES,
) -> dict[str, str | os.PathLike | None]:
    """{format: path or None} of a check's artifacts, every format a key.

    Args:
        keywords: The check's path keywords, {argument: path or None}, by
            the names in `PATH_ARGUMENT` (`onnx_path`, ...), passed
            explicitly; a format needs no keyword of its own.
        paths: The check's `paths` argument, {format: artifact}: any format
            of `formats`, with or without a keyword of its own.
        formats: The formats the check runs (`paths` may name only these).

    Raises:
        ValueError: if `paths` is not a mapping of formats the check runs,
            or names a format whose keyword was given too.
    """
    merged = {name: keywords.get(arg) for name, arg in PATH_ARGUMENT.items()}
    if paths is None:
        return merged
    if not isinstance(paths, Mapping):
        raise ValueError(
            f"`paths` must be a mapping {{format: path}}. Received: paths={paths!r}"
        )
    for name, path in paths.items():
        if name not in formats:
            raise ValueError(
                f"`paths` must name formats among {tuple(formats)}; "
                f"{name!r} is not one. Received: paths={dict(paths)!r}"
            )
        if path is None:
            continue
        if merged[name] is not None:
            raise ValueError(
                f"The {name!r} artifact is given twice: by `{PATH_ARGUMENT[name]}` "
                f"and by `paths`. Received: {PATH_ARGUMENT[name]}="
                f"{merged[name]!r}, paths={dict(paths)!r}"
            )
        merged[name] = path
    return merged


def check_paths(paths: Mapping[str, str | os.PathLike | None]) -> None:
    """Raises ValueError if every path of {format: path or None} is None."""
    if all(path is None for path in paths.values()):
        given = ", ".join(f"{PATH_ARGUMENT[name]}=None" for name in paths)
        raise ValueError(
            "Pass at least one of "
            + ", ".join(f"`{PATH_ARGUMENT[name]}`" for name in paths)
            + f". Received: {given}"
        )


def check_tolerance(name: str, value: object) -> float:
    """Returns `value` as a float if it is a finite non-negative number.

    Raises:
        ValueError: naming the argument and the value otherwise.
    """
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value < 0
    ):
        raise ValueError(
            f"`{name}` must be a finite non-negative number. Received: {name}={value!r}"
        )
    return float(value)


def collect_artifacts(
    paths: Mapping[str, str | os.PathLike | None],
    runtime_keywords: Mapping[str, object] | None = None,
) -> dict[str, runner.Artifact]:
    """{runtime label: Artifact} of the paths given, each found on disk.

    Args:
        paths: {format: path or None}.
        runtime_keywords: The check's keywords for the runtimes (`verify`'s
            `openvino_precision`): each format reads its own
            (`Format.runtime_options`), which also name its label
            (`Format.runtime_label`: "openvino_bf16").

    Raises:
        ValueError: if every path is None or a keyword's value is refused.
        FileNotFoundError: if an artifact is missing.
    """
    check_paths(paths)
    keywords = runtime_keywords or {}
    # Each format that reads a keyword given checks it, whether its artifact
    # is given or not; the formats of the artifacts read theirs.
    options = {
        row.name: formats.get(row.name).runtime_options(keywords)
        for row in table.ROWS
        if paths.get(row.name) is not None
        or any(keyword in keywords for keyword in row.runtime_keywords)
    }
    artifacts = {}
    for export_format, path in paths.items():
        if path is not None:
            label = formats.get(export_format).runtime_label(options[export_format])
            artifacts[label] = artifact(export_format, path, options[export_format])
    return artifacts


def artifact(
    export_format: str,
    path: str | os.PathLike,
    options: Mapping[str, object] | None = None,
) -> runner.Artifact:
    """The `Artifact` at `path` (run with its runtime module's `options`),
    once it is found on disk.

    Raises:
        FileNotFoundError: if it is missing.
    """
    path = os.fspath(path)
    formats.get(export_format).check_artifact(path)
    return runner.Artifact(export_format, path, options or {})


def run_checked(
    target: Signature,
    artifacts: Mapping[str, runner.Artifact],
    runs: Sequence[runner.Run],
    labels: Sequence[str],
    action: str = "on {label} inputs",
    atol: float = 0.0,
    rtol: float = 0.0,
) -> dict[str, runner.Outcome]:
    """Runs each artifact in a fresh process; returns what each computed.

    Args:
        target: The export target the artifacts were made from.
        artifacts: {runtime label: artifact}.
        runs: The calls (`runner.Run`).
        labels: Each run's label, for errors.
        action: How a failing run is described ("{label}" is filled in).
        atol, rtol: The tolerances the (empty) report of a failure states.

    Returns:
        {runtime label: `runner.Outcome`}, each with every run's outputs.

    Raises:
        ValueError: if a runtime cannot load its artifact.
        ParityError: if an artifact's names differ or it fails on a run.
        RuntimeError: if a runtime process imported keras or keras_selfattn.
    """
    outcomes = runner.run_artifacts(target, artifacts, runs)
    for runtime, outcome in outcomes.items():
        row_of_format = table.BY_NAME[artifacts[runtime].format]
        what = f"{row_of_format.artifact} {artifacts[runtime].path}"
        if outcome.stage in ("load", "process"):
            raise ValueError(f"Cannot load {what}: {one_line(outcome.error)}")
        if outcome.stage == "bind":
            raise ParityError(f"{what} {outcome.error}", ParityReport((), 0.0, 0.0))
        if outcome.imported:  # the check would not prove the artifact stands alone
            raise RuntimeError(
                f"the runtime process of {what} imported {list(outcome.imported)}"
            )
        if outcome.stage == "run":
            raise ParityError(
                f"{runtime} failed {action.format(label=labels[outcome.run])} "
                f"where Keras runs: {one_line(outcome.error)}",
                ParityReport((), atol, rtol),
            )
    return outcomes


def check_artifacts(
    target: Signature,
    artifacts: Mapping[str, runner.Artifact],
    runs: Sequence[runner.Run],
    expected: Sequence[Sequence[Mapping[str, np.ndarray]]],
    labels: Sequence[str],
    atol: float,
    rtol: float,
    action: str = "on {label} inputs",
    dequantized: Sequence[Sequence[Mapping[str, np.ndarray]]] | None = None,
    model_outputs: Sequence[Sequence[Mapping[str, np.ndarray]]] | None = None,
    half: str | None = None,
    float64: Callable[[Sequence[int]], Mapping[int, Sequence[Mapping]]] | None = None,
) -> tuple[ParityRow, ...]:
    """Runs each artifact in a fresh process and compares it with `expected`.

    Args:
        target: The export target the artifacts were made from.
        artifacts: {runtime label: artifact}.
        runs: The calls (`runner.Run`), one report row each per artifact.
        expected: Keras's outputs per run, per step, keyed by output name.
        labels: Each run's label in the report.
        atol, rtol: The tolerances.
        action: How a failing run is described ("{label}" is filled in).
        dequantized: A quantized model's dequantized-float outputs, as
            `expected` (None for a float model).
        model_outputs: A half-precision model's own outputs, as `expected`,
            when `expected` is its float32 view's (reported, not judged).
        half: The half dtype the artifacts compute in: each output's atol
            is then at least `precision.half_tolerance` of it.
        float64: A float32 model's second reference (`exact.Float64Reference`):
            called once a row is beyond the tolerance, with every run, for
            their outputs in float64, as `expected`; the runtimes with rows
            beyond it are then judged by `rules.float64_judged`.

    Returns:
        The rows, run by run, each run's artifacts in `artifacts` order.

    Raises:
        ValueError: if a runtime cannot load its artifact.
        ParityError: if an artifact's names differ or it fails on a run.
        RuntimeError: if a runtime process imported keras or keras_selfattn.
    """
    outcomes = run_checked(target, artifacts, runs, labels, action, atol, rtol)
    rows = {}
    runs_triples: dict[str, list] = {}  # quantized: per runtime, per run
    float_pairs: dict[str, list] = {}  # float: per runtime, per run
    for runtime, outcome in outcomes.items():
        for index, (want, have) in enumerate(
            zip(expected, outcome.outputs, strict=True)
        ):
            pairs = [
                (step_want[name], step_have[name])
                for step_want, step_have in zip(want, have, strict=True)
                for name in target.output_names
            ]
            if dequantized is None:
                row = rules.float_row(runtime, labels[index], pairs, atol, rtol, half)
                if model_outputs is not None:
                    gap = rules.largest_gap(
                        model_outputs[index], have, target.output_names
                    )
                    row = dataclasses.replace(row, model_precision_err=gap)
                rows[(index, runtime)] = row
                float_pairs.setdefault(runtime, []).append(pairs)
                continue
            floats = [
                step[name]
                for step in dequantized[index]
                for name in target.output_names
            ]
            triples = [(k, f, a) for (k, a), f in zip(pairs, floats, strict=True)]
            runs_triples.setdefault(runtime, []).append(triples)
            rows[(index, runtime)] = rules.quantized_row(
                runtime, labels[index], triples, atol, rtol, outcome.description
            )
        if runtime in runs_triples:
            keys = [(i, runtime) for i in range(len(expected))]
            judged = rules.pooled(
                [rows[key] for key in keys],
                runs_triples[runtime],
                atol,
                rtol,
                outcome.description,
            )
            rows.update(zip(keys, judged, strict=True))
    if float64 is not None and half is None:
        rows.update(_judged_by_float64(rows, float_pairs, float64, target, atol, rtol))
    return tuple(rows[key] for key in sorted(rows, key=lambda k: k[0]))


def _judged_by_float64(rows, float_pairs, float64, target, atol, rtol) -> dict:
    """The float rows of each runtime with a row beyond the tolerance,
    judged against the float64 outputs of every run (`rules.float64_judged`);
    none when no row is beyond it or the reference is unavailable.

    Args:
        rows: {(run, runtime): row}.
        float_pairs: {runtime: per run, its (keras, actual) pairs}.
    """
    beyond = {runtime for (_, runtime), row in rows.items() if not row.ok}
    runtimes = [runtime for runtime in float_pairs if runtime in beyond]
    if not runtimes:
        return {}
    count = len(float_pairs[runtimes[0]])
    exact = float64(range(count))
    judged = {}
    for runtime in runtimes if exact else ():
        keys = [(run, runtime) for run in range(count)]
        triples = [
            _with_float64(pairs, exact[run], target.output_names)
            for run, pairs in enumerate(float_pairs[runtime])
        ]
        found = rules.float64_judged([rows[key] for key in keys], triples, atol, rtol)
        judged.update(zip(keys, found, strict=True))
    return judged


def _with_float64(pairs, steps, names) -> list[tuple]:
    """A run's (keras, actual) pairs as (keras, float64, actual) triples."""
    wanted = [step[name] for step in steps for name in names]
    return [(k, e, a) for (k, a), e in zip(pairs, wanted, strict=True)]
