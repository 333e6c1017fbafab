"""Numeric parity of exported models with Keras: `verify` and its report.

A float model's artifact passes when every output element is within
|err| <= atol + rtol |keras|. A quantized model's artifact is compared with
two references Keras computes on the same inputs: the quantized model, and
the float model whose kernels are the dequantized integers
(`quantization`). A runtime may quantize activations its own way (per
tensor, asymmetric, dynamic range), so, per output:

- its error against the dequantized-float model is at most
  `QUANTIZED_MARGIN` times Keras's own (the quantized model against that
  reference), both as root mean squares over all of the call's shapes: the
  typical size of each scheme's error, which the largest element of a few
  outputs (one token, a classifier's logits) measures too noisily; and no
  element is further from that reference than `LARGEST_MARGIN` times Keras's
  own largest error (plus the float tolerance in both);
- an artifact that computes Keras's own scheme (it says so in its metadata)
  must also match the quantized model: its root mean square error against it
  (over all the shapes) at most `ROUNDING_SHARE` of Keras's own, and no
  element further from it than Keras's own largest error, plus the float
  tolerance. Activations whose float value differs by an ulp before a
  quantizer (the runtime's attention or softmax rounds differently) can
  round to the neighbouring integer: sparse steps, one quantization step
  each, while a model that quantizes otherwise has errors independent of
  Keras's, about 1.4 times Keras's own away from it.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping, Sequence

import keras
import numpy as np

from keras_selfattn.export import _runtimes, precision, quantization
from keras_selfattn.export._endpoint import Endpoint, build_endpoint, keras_reference
from keras_selfattn.export._inputs import example_inputs, is_padded
from keras_selfattn.export._target import ExportTarget
from keras_selfattn.export.formats import table

# (batch, time): a single step, an odd length, and two long ones. Rows after
# the first are padded when the model has integer or boolean inputs.
DEFAULT_SHAPES: tuple[tuple[int, int], ...] = ((1, 1), (2, 33), (3, 128), (2, 512))
DEFAULT_ATOL = 1e-5
DEFAULT_RTOL = 1e-4
# A quantized model's artifact may be this many times as far from the
# dequantized-float reference as Keras's own quantized model is (root mean
# squares), and each element this many times Keras's largest error.
QUANTIZED_MARGIN = 1.25
LARGEST_MARGIN = 2.0
# A quantized model's root mean square rules need this many elements of
# each output over a call (a classifier's few logits a row give too few):
# `verify` adds rows of `QUANTIZED_TIME` to its default shapes, or repeats
# the shapes it is given with other inputs.
QUANTIZED_ELEMENTS = 256
QUANTIZED_TIME = 16
# The share of Keras's own quantization error (root mean square) an
# artifact computing Keras's scheme may differ from it by (activations
# rounding the other way).
ROUNDING_SHARE = 0.25
# OpenVINO's INFERENCE_PRECISION_HINT values `verify` accepts.
OPENVINO_PRECISIONS = ("f32", "bf16")
# The argument of `verify` (and `verify_decode_step`) naming each format's artifact.
PATH_ARGUMENT = {row.name: row.path_argument for row in table.ROWS}


@dataclasses.dataclass(frozen=True)
class ParityRow:
    """One runtime on one input shape, compared with Keras.

    Attributes:
        runtime: "saved_model", "onnx", "litert", "openvino" (at f32;
            "openvino_bf16" at bf16) or "torch"; for decoding steps also
            "keras_cache" (Keras's cached decode against its full forward);
            for a LiteRT generator also "litert prefill/decode" (its greedy
            tokens through those signatures).
        shape: Input shape label, "BATCHxTIME", with " padded" when rows
            carry padding.
        max_abs_err: Largest |runtime - keras| over all outputs.
        max_rel_err: Largest |runtime - keras| / |keras| over elements where
            |keras| > atol (smaller ones are judged by atol alone).
        ok: Whether every element satisfies
            |runtime - keras| <= atol + rtol * |keras| (and shapes match);
            for a quantized model, the rule in the module docstring.
        dequantized_err: Quantized models: largest |runtime - dequantized
            float reference|; None for float models.
        quantization_err: Quantized models: Keras's own largest |quantized
            Keras - dequantized float reference| on the same inputs.
        scheme: Quantized models: how the artifact computes (its activation
            scheme), as it says or as its runtime shows; "" if unknown.
        model_precision_err: A half-precision model exported in float32:
            largest |runtime - the model's own half-precision outputs|.
        rms_ratio: Quantized models: root mean square of |runtime -
            dequantized float| over Keras's own (the worst output).
    """

    runtime: str
    shape: str
    max_abs_err: float
    max_rel_err: float
    ok: bool
    dequantized_err: float | None = None
    quantization_err: float | None = None
    scheme: str = ""
    model_precision_err: float | None = None
    rms_ratio: float | None = None


@dataclasses.dataclass(frozen=True)
class ParityReport:
    """All `ParityRow`s of a `verify` call and the tolerances used.

    `str(report)` (or `report.table()`) renders a text table.

    Attributes:
        rows: The rows.
        atol, rtol: The float tolerances.
        notes: Lines rendered below the table (how a half-precision model
            or artifact was judged).
    """

    rows: tuple[ParityRow, ...]
    atol: float
    rtol: float
    notes: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        """True when every row is within tolerance."""
        return all(row.ok for row in self.rows)

    @property
    def failures(self) -> tuple[ParityRow, ...]:
        """The rows beyond tolerance."""
        return tuple(row for row in self.rows if not row.ok)

    @property
    def quantized(self) -> bool:
        """Whether the rows compare a quantized model (two references)."""
        return any(row.dequantized_err is not None for row in self.rows)

    def table(self) -> str:
        """The report as an aligned text table."""
        if self.quantized:
            return self._quantized_table()
        half = any(row.model_precision_err is not None for row in self.rows)
        header = ("runtime", "shape", "max abs err", "max rel err", "ok")
        header += ("vs model's own dtype",) if half else ()
        lines = [header] + [
            (
                row.runtime,
                row.shape,
                f"{row.max_abs_err:.2e}",
                f"{row.max_rel_err:.2e}",
                "yes" if row.ok else "NO",
            )
            + ((f"{row.model_precision_err:.2e}",) if half else ())
            for row in self.rows
        ]
        widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
        text = [
            "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip()
            for line in lines
        ]
        text.insert(1, "  ".join("-" * width for width in widths))
        text.append(f"tolerance: |err| <= {self.atol:g} + {self.rtol:g} * |keras|")
        text.extend(self.notes)
        return "\n".join(text)

    def _quantized_table(self) -> str:
        header = (
            "runtime",
            "shape",
            "vs quantized keras",
            "vs dequantized float",
            "keras's own",
            "rms ratio",
            "ok",
        )
        lines = [header] + [
            (
                row.runtime,
                row.shape,
                f"{row.max_abs_err:.2e}",
                f"{row.dequantized_err:.2e}",
                f"{row.quantization_err:.2e}",
                f"{row.rms_ratio:.2f}",
                "yes" if row.ok else "NO",
            )
            for row in self.rows
        ]
        widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
        text = [
            "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip()
            for line in lines
        ]
        text.insert(1, "  ".join("-" * width for width in widths))
        schemes = {}
        for row in self.rows:
            schemes.setdefault(row.runtime, row.scheme or "not stated")
        text += [f"{runtime}: {scheme}" for runtime, scheme in schemes.items()]
        text.append(
            "errors are largest |difference|; rms ratio: root mean square error "
            "vs dequantized float over keras's own, over all the shapes"
        )
        text.append(
            f"tolerance: rms ratio <= {QUANTIZED_MARGIN:g} and each element vs "
            f"dequantized <= {LARGEST_MARGIN:g} x keras's own, + {self.atol:g} + "
            f"{self.rtol:g} * |reference|; Keras's own scheme also rms vs quantized "
            f"keras <= {ROUNDING_SHARE:g} x keras's own rms, each element <= keras's "
            "own"
        )
        text.extend(self.notes)
        return "\n".join(text)

    def __str__(self) -> str:
        return self.table()


class ParityError(RuntimeError):
    """An export computes something other than its Keras model.

    Attributes:
        report: The `ParityReport` (rows so far; may be empty when the
            export's inputs or outputs do not match the model's).
    """

    def __init__(self, message: str, report: ParityReport):
        super().__init__(message)
        self.report = report


def compare(expected: np.ndarray, actual: np.ndarray, atol: float, rtol: float):
    """(max abs err, max rel err, ok) of `actual` against `expected`."""
    expected = np.asarray(expected, dtype=np.float64)
    actual = np.asarray(actual, dtype=np.float64)
    if expected.shape != actual.shape:
        return np.inf, np.inf, False
    diff = np.abs(actual - expected)
    same_nan = np.isnan(actual) & np.isnan(expected)
    diff = np.where(same_nan, 0.0, np.nan_to_num(diff, nan=np.inf))
    if diff.size == 0:
        return 0.0, 0.0, True
    significant = np.abs(expected) > atol  # elsewhere atol is what applies
    rel = diff[significant] / np.abs(expected[significant])
    ok = bool(np.all(diff <= atol + rtol * np.nan_to_num(np.abs(expected))))
    return float(diff.max()), float(rel.max()) if rel.size else 0.0, ok


def parity_row(
    runtime: str, label: str, pairs: Sequence[tuple], atol: float, rtol: float
) -> ParityRow:
    """One row over (expected, actual) pairs: the worst errors, all ok."""
    results = [compare(want, have, atol, rtol) for want, have in pairs]
    return ParityRow(
        runtime,
        label,
        max(r[0] for r in results),
        max(r[1] for r in results),
        all(r[2] for r in results),
    )


def _within(diff: np.ndarray, allowed: np.ndarray) -> bool:
    return bool(np.all(np.nan_to_num(diff, nan=np.inf) <= allowed))


def _gap(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        return np.full((1,), np.inf)
    same_nan = np.isnan(a) & np.isnan(b)
    return np.where(same_nan, 0.0, np.abs(a - b))


def _rms(values: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(values)))) if values.size else 0.0


def quantized_row(
    runtime: str,
    label: str,
    triples: Sequence[tuple],
    atol: float,
    rtol: float,
    description: Mapping[str, object],
) -> ParityRow:
    """One row of a quantized model over (keras, dequantized, actual) triples
    (one per output): the largest errors and the rules on each element (the
    root mean square rules pool a call's rows: `pooled`)."""
    exact = bool(description.get("exact"))
    errors, dequantized, own, relative, ok = [], [], [], [], True
    for keras_out, float_out, actual in triples:
        keras_gap = _gap(actual, keras_out)
        float_gap = _gap(actual, float_out)
        own_largest = float(_gap(keras_out, float_out).max(initial=0.0))
        ok &= _within(
            float_gap, LARGEST_MARGIN * own_largest + atol + rtol * np.abs(float_out)
        )
        if exact:
            ok &= _within(keras_gap, own_largest + atol + rtol * np.abs(keras_out))
        errors.append(float(keras_gap.max(initial=0.0)))
        dequantized.append(float(float_gap.max(initial=0.0)))
        own.append(own_largest)
        relative.append(compare(keras_out, actual, atol, rtol)[1])
    return ParityRow(
        runtime,
        label,
        max(errors),
        max(relative),
        ok,
        max(dequantized),
        max(own),
        str(description.get("scheme", "")),
    )


def pooled(
    rows: Sequence[ParityRow],
    triples: Sequence[Sequence[tuple]],
    atol: float,
    rtol: float,
    description: Mapping[str, object],
) -> list[ParityRow]:
    """`rows` (one runtime's, one per run) judged by the root mean square
    rules over all their runs together, per output (a few outputs of one run
    are too few to tell one scheme's typical error from another's).

    Args:
        rows: From `quantized_row`, in run order.
        triples: Per run, the (keras, dequantized, actual) triple of each
            output.
    """
    exact = bool(description.get("exact"))
    ok, ratios = True, []
    for output in zip(*triples, strict=True):
        keras_out, float_out, actual = (
            np.concatenate([np.ravel(np.asarray(t[i], np.float64)) for t in output])
            for i in range(3)
        )
        own_rms = _rms(_gap(keras_out, float_out))
        float_rms = _rms(_gap(actual, float_out))
        ok &= float_rms <= QUANTIZED_MARGIN * own_rms + atol + rtol * _rms(float_out)
        if exact:
            ok &= _rms(_gap(actual, keras_out)) <= ROUNDING_SHARE * own_rms + atol
        ratios.append(float_rms / own_rms if own_rms else 0.0)
    ratio = max(ratios, default=0.0)
    return [dataclasses.replace(r, ok=r.ok and ok, rms_ratio=ratio) for r in rows]


def _float_row(
    runtime: str,
    label: str,
    pairs: Sequence[tuple],
    atol: float,
    rtol: float,
    half: str | None,
) -> ParityRow:
    """`parity_row`, each pair's atol raised to `precision.half_tolerance`
    of its expected output for a half-precision artifact."""
    if half is None:
        return parity_row(runtime, label, pairs, atol, rtol)
    rows = [
        parity_row(
            runtime,
            label,
            [(want, have)],
            max(atol, precision.half_tolerance(half, np.asarray(want))),
            rtol,
        )
        for want, have in pairs
    ]
    return ParityRow(
        runtime,
        label,
        max(row.max_abs_err for row in rows),
        max(row.max_rel_err for row in rows),
        all(row.ok for row in rows),
    )


def _largest_gap(
    wanted: Sequence[Mapping[str, np.ndarray]],
    produced: Sequence[Mapping[str, np.ndarray]],
    names: Sequence[str],
) -> float:
    """The largest |produced - wanted| over the outputs `wanted` has."""
    gaps = [
        float(_gap(step_have[name], step_want[name]).max(initial=0.0))
        for step_want, step_have in zip(wanted, produced, strict=True)
        for name in names
        if name in step_want
    ]
    return max(gaps, default=0.0)


def brief(error: BaseException | str, limit: int = 300) -> str:
    """The error's message on one line, at most `limit` characters."""
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def require_saved_model_pb(directory: str) -> None:
    """Raises FileNotFoundError unless `directory` holds a saved_model.pb."""
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"SavedModel directory not found: {directory}")
    if not os.path.isfile(os.path.join(directory, "saved_model.pb")):
        raise FileNotFoundError(
            f"No saved_model.pb in {directory}: pass a version folder "
            "(BASE_DIR/NAME/VERSION)"
        )


def artifact(
    export_format: str, path: str | os.PathLike, openvino_precision: str = "f32"
) -> _runtimes.Artifact:
    """The `Artifact` at `path`, once it is found on disk.

    Raises:
        FileNotFoundError: if it is missing.
    """
    path = os.fspath(path)
    if export_format == table.SAVED_MODEL.name:
        require_saved_model_pb(path)
    elif not os.path.isfile(path):
        artifact_title = table.BY_NAME[export_format].artifact
        raise FileNotFoundError(f"{artifact_title} file not found: {path}")
    return _runtimes.Artifact(export_format, path, openvino_precision)


def run_checked(
    target: ExportTarget,
    artifacts: Mapping[str, _runtimes.Artifact],
    runs: Sequence[_runtimes.Run],
    labels: Sequence[str],
    action: str = "on {label} inputs",
    atol: float = 0.0,
    rtol: float = 0.0,
) -> dict[str, _runtimes.Outcome]:
    """Runs each artifact in a fresh process; returns what each computed.

    Args:
        target: The export target the artifacts were made from.
        artifacts: {runtime label: artifact}.
        runs: The calls (`_runtimes.Run`).
        labels: Each run's label, for errors.
        action: How a failing run is described ("{label}" is filled in).
        atol, rtol: The tolerances the (empty) report of a failure states.

    Returns:
        {runtime label: `_runtimes.Outcome`}, each with every run's outputs.

    Raises:
        ValueError: if a runtime cannot load its artifact.
        ParityError: if an artifact's names differ or it fails on a run.
        RuntimeError: if a runtime process imported keras_selfattn (or keras,
            outside TensorFlow's runtime).
    """
    outcomes = _runtimes.run_artifacts(target, artifacts, runs)
    for runtime, outcome in outcomes.items():
        row_of_format = table.BY_NAME[artifacts[runtime].format]
        what = f"{row_of_format.artifact} {artifacts[runtime].path}"
        if outcome.stage in ("load", "process"):
            raise ValueError(f"Cannot load {what}: {brief(outcome.error)}")
        if outcome.stage == "bind":
            raise ParityError(f"{what} {outcome.error}", ParityReport((), 0.0, 0.0))
        allowed = ("keras",) if row_of_format is table.SAVED_MODEL else ()
        foreign = [name for name in outcome.imported if name not in allowed]
        if foreign:  # the check would not prove that the artifact stands alone
            raise RuntimeError(f"the runtime process of {what} imported {foreign}")
        if outcome.stage == "run":
            raise ParityError(
                f"{runtime} failed {action.format(label=labels[outcome.run])} "
                f"where Keras runs: {brief(outcome.error)}",
                ParityReport((), atol, rtol),
            )
    return outcomes


def check_artifacts(
    target: ExportTarget,
    artifacts: Mapping[str, _runtimes.Artifact],
    runs: Sequence[_runtimes.Run],
    expected: Sequence[Sequence[Mapping[str, np.ndarray]]],
    labels: Sequence[str],
    atol: float,
    rtol: float,
    action: str = "on {label} inputs",
    dequantized: Sequence[Sequence[Mapping[str, np.ndarray]]] | None = None,
    model_outputs: Sequence[Sequence[Mapping[str, np.ndarray]]] | None = None,
    half: str | None = None,
) -> tuple[ParityRow, ...]:
    """Runs each artifact in a fresh process and compares it with `expected`.

    Args:
        target: The export target the artifacts were made from.
        artifacts: {runtime label: artifact}.
        runs: The calls (`_runtimes.Run`), one report row each per artifact.
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

    Returns:
        The rows, run by run, each run's artifacts in `artifacts` order.

    Raises:
        ValueError: if a runtime cannot load its artifact.
        ParityError: if an artifact's names differ or it fails on a run.
    """
    outcomes = run_checked(target, artifacts, runs, labels, action, atol, rtol)
    rows = {}
    runs_triples: dict[str, list] = {}  # quantized: per runtime, per run
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
                row = _float_row(runtime, labels[index], pairs, atol, rtol, half)
                if model_outputs is not None:
                    gap = _largest_gap(model_outputs[index], have, target.output_names)
                    row = dataclasses.replace(row, model_precision_err=gap)
                rows[(index, runtime)] = row
                continue
            floats = [
                step[name]
                for step in dequantized[index]
                for name in target.output_names
            ]
            triples = [(k, f, a) for (k, a), f in zip(pairs, floats, strict=True)]
            runs_triples.setdefault(runtime, []).append(triples)
            rows[(index, runtime)] = quantized_row(
                runtime, labels[index], triples, atol, rtol, outcome.description
            )
        if runtime in runs_triples:
            keys = [(i, runtime) for i in range(len(expected))]
            judged = pooled(
                [rows[key] for key in keys],
                runs_triples[runtime],
                atol,
                rtol,
                outcome.description,
            )
            rows.update(zip(keys, judged, strict=True))
    return tuple(rows[key] for key in sorted(rows, key=lambda k: k[0]))


def finish_report(
    rows: Sequence[ParityRow],
    atol: float,
    rtol: float,
    what: str,
    hint: str = "",
    notes: Sequence[str] = (),
) -> ParityReport:
    """The report of `rows`; raises ParityError when one is beyond tolerance.

    Args:
        rows: The report's rows.
        atol, rtol: The tolerances they were judged by.
        what: What the rows compare, e.g. "checks differ from Keras".
        hint: Appended to the message when the worst row is not ok.
        notes: The report's notes.
    """
    report = ParityReport(tuple(rows), atol, rtol, tuple(notes))
    if not report.ok:
        worst = max(report.failures, key=lambda row: row.max_abs_err)
        raise ParityError(
            f"{len(report.failures)} of {len(rows)} {what} beyond "
            f"atol={atol:g}, rtol={rtol:g}; worst: {worst.runtime} on "
            f"{worst.shape}, max abs err {worst.max_abs_err:.3g}{hint}",
            report,
        )
    return report


def is_shape(shape: object) -> bool:
    """Whether `shape` is a (batch, time) pair of positive ints."""
    return (
        isinstance(shape, Sequence)
        and len(shape) == 2
        and all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape)
    )


def _check_shapes(shapes) -> tuple[tuple[int, int], ...]:
    if not all(is_shape(shape) for shape in shapes):
        raise ValueError(
            "`shapes` must be a sequence of (batch, time) pairs of positive "
            f"ints. Received: shapes={shapes!r}"
        )
    if not shapes:
        raise ValueError(f"`shapes` must not be empty. Received: shapes={shapes!r}")
    return tuple((shape[0], shape[1]) for shape in shapes)


def artifact_paths(*paths: str | os.PathLike | None) -> dict:
    """{format: path or None} of the artifact arguments of `verify` and
    `verify_decode_step`, given in `PATH_ARGUMENT`'s order."""
    return dict(zip(PATH_ARGUMENT, paths, strict=True))


def collect_artifacts(
    paths: Mapping[str, str | os.PathLike | None], openvino_precision: str = "f32"
) -> dict[str, _runtimes.Artifact]:
    """{runtime label: Artifact} of the paths given, each found on disk.

    Args:
        paths: {format: path or None}.
        openvino_precision: OpenVINO's INFERENCE_PRECISION_HINT; off "f32"
            its label is "openvino_<precision>".

    Raises:
        ValueError: if every path is None or the precision is unknown.
        FileNotFoundError: if an artifact is missing.
    """
    if all(path is None for path in paths.values()):
        given = ", ".join(f"{PATH_ARGUMENT[name]}=None" for name in paths)
        raise ValueError(
            "Pass at least one of "
            + ", ".join(f"`{PATH_ARGUMENT[name]}`" for name in paths)
            + f". Received: {given}"
        )
    if openvino_precision not in OPENVINO_PRECISIONS:
        raise ValueError(
            f"`openvino_precision` must be one of {OPENVINO_PRECISIONS}. "
            f"Received: openvino_precision={openvino_precision!r}"
        )
    artifacts = {}
    for export_format, path in paths.items():
        if path is not None:
            label = export_format
            if export_format == table.OPENVINO.name and openvino_precision != "f32":
                label = f"openvino_{openvino_precision}"
            artifacts[label] = artifact(export_format, path, openvino_precision)
    return artifacts


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


@dataclasses.dataclass(frozen=True)
class _References:
    """What `verify` compares artifacts with, per run (one step each).

    Attributes:
        expected: Keras's outputs (the float32 view's, for a half model).
        dequantized: A quantized model's dequantized-float outputs, or None.
        model_outputs: A half model's own outputs when `expected` is its
            float32 view's, or None.
    """

    expected: list
    dequantized: list | None
    model_outputs: list | None


def _elements(endpoint: Endpoint, batch: int, time: int) -> int:
    """The fewest elements any of the endpoint's outputs has at this shape."""
    specs = [
        keras.KerasTensor(
            (batch, *(time if d is None else d for d in spec.shape[1:])),
            dtype=spec.dtype,
        )
        for spec in endpoint.inputs
    ]
    outputs = keras.tree.flatten(endpoint.model.compute_output_spec(specs))
    return min(math.prod(output.shape) for output in outputs)


def quantized_shapes(
    endpoint: Endpoint, shapes: Sequence[tuple[int, int]], default: bool
) -> list[tuple[int, int]]:
    """A quantized model's shapes: `shapes`, then enough to reach
    `QUANTIZED_ELEMENTS` of each output, as rows of `QUANTIZED_TIME` (after
    the default shapes) or as the given shapes again (an artifact of fixed
    shapes takes only those)."""
    shapes = list(shapes)
    given = list(shapes)
    total = sum(_elements(endpoint, batch, time) for batch, time in shapes)
    if total >= QUANTIZED_ELEMENTS:
        return shapes
    if default:
        per_row = _elements(endpoint, 1, QUANTIZED_TIME)
        rows = -(-(QUANTIZED_ELEMENTS - total) // per_row)
        return shapes + [(rows, QUANTIZED_TIME)]
    each = sum(_elements(endpoint, batch, time) for batch, time in given)
    return shapes + given * -(-(QUANTIZED_ELEMENTS - total) // each)


def forward_runs(
    endpoint: Endpoint, shapes: Sequence[tuple[int, int]], seed: int
) -> tuple[list[_runtimes.Run], list[str], _References]:
    """The one-step runs of `verify`, their labels, and the references.

    A model with a fixed length keeps it (the label says the shape run).
    Shapes that come out the same are run once, but a quantized model's
    repeated shapes run with other inputs (labelled "#2", "#3", ...).
    """
    target = endpoint.target()
    runs, expected, labels = [], [], []
    dequantized = [] if target.quantized else None
    model_outputs = [] if endpoint.original is not None else None
    for index, (batch, time) in enumerate(shapes):
        arrays = example_inputs(target, batch, time, seed=seed + index)
        time = next((a.shape[1] for a in arrays.values() if a.ndim > 1), time)
        label = f"{batch}x{time}" + (
            " padded" if is_padded(target, batch, time) else ""
        )
        if label in labels and dequantized is None:
            continue
        copies = sum(1 for known in labels if known.split(" #")[0] == label)
        labels.append(label if not copies else f"{label} #{copies + 1}")
        runs.append(_runtimes.Run((arrays,)))
        expected.append([keras_reference(endpoint, arrays)])
        if dequantized is not None:
            with target.traced(quantization.CONSTANTS):
                dequantized.append([keras_reference(endpoint, arrays)])
        if model_outputs is not None:
            model_outputs.append(
                [keras_reference(endpoint, arrays, source=endpoint.original)]
            )
    return runs, labels, _References(expected, dequantized, model_outputs)


def verify(
    model: keras.Model,
    saved_model_dir: str | os.PathLike | None = None,
    onnx_path: str | os.PathLike | None = None,
    *,
    litert_path: str | os.PathLike | None = None,
    openvino_path: str | os.PathLike | None = None,
    torch_path: str | os.PathLike | None = None,
    shapes: Sequence[tuple[int, int]] | None = None,
    attention_outputs: str | Mapping[str, str] | None = None,
    atol: float = DEFAULT_ATOL,
    rtol: float = DEFAULT_RTOL,
    seed: int = 0,
    openvino_precision: str = "f32",
    precision: str = "float32",
) -> ParityReport:
    """Checks that exported models compute what the Keras model computes.

    Every artifact runs in a fresh process that imports only its own
    runtime (TensorFlow for the SavedModel's `serving_default` signature,
    onnxruntime, ai_edge_litert, openvino, `torch.export.load`), never keras
    or keras_selfattn; the runtimes start together. Each and Keras get the
    same random inputs for every (batch, time) in `shapes`: float inputs are
    standard normal, integer token and boolean mask inputs have rows padded
    at the end (the report's "padded" shapes). Artifacts Keras's own
    `model.export` wrote work too: outputs named only by position
    ("output_0", ...) are matched by position.

    Args:
        model: The Keras model that was exported.
        saved_model_dir: A SavedModel version directory, or None.
        onnx_path: An ONNX file, or None.
        litert_path: A LiteRT (.tflite) file, or None.
        openvino_path: An OpenVINO IR (.xml, with its .bin beside it), or None.
        torch_path: A torch.export program (.pt2), or None.
        shapes: (batch, time) pairs. Defaults to
            ((1, 1), (2, 33), (3, 128), (2, 512)). A quantized model's rules
            compare typical errors: where its outputs have fewer than 256
            elements over the shapes (a classifier's logits), rows of time 16
            are added to the default shapes, or given shapes repeated with
            other inputs.
        attention_outputs: As given to the export, when it added attention
            weights as outputs; they are then compared too.
        atol: Absolute tolerance.
        rtol: Relative tolerance: an element passes when
            |runtime - keras| <= atol + rtol * |keras|.
        seed: Seed of the random inputs.
        openvino_precision: OpenVINO's INFERENCE_PRECISION_HINT: "f32" (the
            model's arithmetic), or "bf16" to measure OpenVINO's default on
            CPUs with AVX512-BF16 (its row is then labelled
            "openvino_bf16"; pass tolerances that fit bf16).
        precision: How the artifacts were exported from a model computing
            in float16 or bfloat16: "float32" (the default: compared with
            the model's float32 view, and the report gives the error
            against its own outputs) or "model" (in its own dtype, compared
            within a tolerance from that dtype's epsilon).

    Returns:
        A `ParityReport` (every row within tolerance).

    Raises:
        ParityError: if a runtime differs from Keras beyond tolerance, or its
            input or output names differ from the model's; the error's
            `report` holds the rows.
        ValueError: if no artifact is given, an argument is invalid, or a
            runtime cannot load its artifact.
        FileNotFoundError: if an artifact does not exist.

    Example:

    >>> from keras_selfattn.export import export_onnx, verify  # doctest: +SKIP
    >>> path = export_onnx(model, "model.onnx")  # doctest: +SKIP
    >>> print(verify(model, onnx_path=path))  # doctest: +SKIP
    """
    paths = artifact_paths(
        saved_model_dir, onnx_path, litert_path, openvino_path, torch_path
    )
    artifacts = collect_artifacts(paths, openvino_precision)
    default = shapes is None
    shapes = _check_shapes(DEFAULT_SHAPES if default else shapes)
    atol = check_tolerance("atol", atol)
    rtol = check_tolerance("rtol", rtol)
    endpoint = build_endpoint(model, attention_outputs, precision)
    if endpoint.target().quantized:
        shapes = quantized_shapes(endpoint, shapes, default)
    runs, labels, references = forward_runs(endpoint, shapes, seed)
    rows = check_artifacts(
        endpoint.target(),
        artifacts,
        runs,
        references.expected,
        labels,
        atol,
        rtol,
        dequantized=references.dequantized,
        model_outputs=references.model_outputs,
        half=endpoint.half,
    )
    return finish_report(
        rows, atol, rtol, "checks differ from Keras", notes=_notes(endpoint)
    )


def _notes(endpoint: Endpoint) -> tuple[str, ...]:
    """How a half-precision model was judged, for the report."""
    if endpoint.original is not None:
        dtype = precision.half_dtype(endpoint.original)
        return (
            f"the model computes in {dtype}: checked against its float32 view "
            f"(same weights); the last column is the error against its own "
            f"{dtype} outputs",
        )
    if endpoint.half is not None:
        epsilon = precision.EPSILON[endpoint.half]
        return (
            f"{endpoint.half} artifact: atol at least {precision.HALF_EPSILONS} x "
            f"{epsilon:g} (its epsilon) x (max |keras| + 1) per output",
        )
    return ()
