"""Numeric parity of exported models with Keras: `verify` and its report."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence

import keras
import numpy as np

from keras_selfattn.export._endpoint import Endpoint, build_endpoint, keras_reference
from keras_selfattn.export._inputs import example_inputs, is_padded

# (batch, time): a single step, an odd length, and two long ones. Rows after
# the first are padded when the model has integer or boolean inputs.
DEFAULT_SHAPES: tuple[tuple[int, int], ...] = ((1, 1), (2, 33), (3, 128), (2, 512))
DEFAULT_ATOL = 1e-5
DEFAULT_RTOL = 1e-4

Runner = Callable[[Mapping[str, np.ndarray]], Mapping[str, np.ndarray]]


@dataclasses.dataclass(frozen=True)
class ParityRow:
    """One runtime on one input shape, compared with Keras.

    Attributes:
        runtime: "saved_model" or "onnx".
        shape: Input shape label, "BATCHxTIME", with " padded" when rows
            carry padding.
        max_abs_err: Largest |runtime - keras| over all outputs.
        max_rel_err: Largest |runtime - keras| / |keras| over elements where
            |keras| > atol (smaller ones are judged by atol alone).
        ok: Whether every element satisfies
            |runtime - keras| <= atol + rtol * |keras| (and shapes match).
    """

    runtime: str
    shape: str
    max_abs_err: float
    max_rel_err: float
    ok: bool


@dataclasses.dataclass(frozen=True)
class ParityReport:
    """All `ParityRow`s of a `verify` call and the tolerances used.

    `str(report)` (or `report.table()`) renders a text table.
    """

    rows: tuple[ParityRow, ...]
    atol: float
    rtol: float

    @property
    def ok(self) -> bool:
        """True when every row is within tolerance."""
        return all(row.ok for row in self.rows)

    @property
    def failures(self) -> tuple[ParityRow, ...]:
        """The rows beyond tolerance."""
        return tuple(row for row in self.rows if not row.ok)

    def table(self) -> str:
        """The report as an aligned text table."""
        header = ("runtime", "shape", "max abs err", "max rel err", "ok")
        lines = [header] + [
            (
                row.runtime,
                row.shape,
                f"{row.max_abs_err:.2e}",
                f"{row.max_rel_err:.2e}",
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
        text.append(f"tolerance: |err| <= {self.atol:g} + {self.rtol:g} * |keras|")
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


def _compare(expected: np.ndarray, actual: np.ndarray, atol: float, rtol: float):
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


def _check_names(
    what: str,
    kind: str,
    found: Sequence[str],
    wanted: Sequence[str],
    owner: str = "model",
) -> None:
    missing = [name for name in wanted if name not in found]
    if missing:
        raise ParityError(
            f"{what} lacks the {owner}'s {kind} {missing}; it has {sorted(found)}",
            ParityReport((), 0.0, 0.0),
        )


def _brief(error: BaseException, limit: int = 300) -> str:
    """The error's message on one line, at most `limit` characters."""
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def require_saved_model_pb(directory: str) -> None:
    """Raises FileNotFoundError unless `directory` holds a saved_model.pb."""
    if not os.path.isfile(os.path.join(directory, "saved_model.pb")):
        raise FileNotFoundError(
            f"No saved_model.pb in {directory}: pass a version folder "
            "(BASE_DIR/NAME/VERSION)"
        )


def signature_runner(
    loaded: object,
    what: str,
    signature_name: str,
    input_names: Sequence[str],
    output_names: Sequence[str],
    owner: str = "model",
) -> Runner:
    """Runs a loaded SavedModel's signature, once its names are checked.

    Args:
        loaded: What `tf.saved_model.load` returned.
        what: The export in errors, e.g. "SavedModel DIR".
        signature_name: The signature to run.
        input_names, output_names: Names the signature must take and return.
        owner: Whose names they are in errors ("model", "decode step").

    Raises:
        ParityError: if the signature or one of the names is missing.
    """
    import tensorflow as tf

    if signature_name not in loaded.signatures:
        raise ParityError(
            f"{what} has no {signature_name!r} signature; it has "
            f"{sorted(loaded.signatures)}",
            ParityReport((), 0.0, 0.0),
        )
    signature = loaded.signatures[signature_name]
    _, input_specs = signature.structured_input_signature
    _check_names(what, "inputs", list(input_specs), input_names, owner)
    found = list(signature.structured_outputs)
    _check_names(what, "outputs", found, output_names, owner)

    def run(arrays):
        outputs = signature(**{k: tf.constant(v) for k, v in arrays.items()})
        return {name: value.numpy() for name, value in outputs.items()}

    return run


def session_runner(
    session: object,
    what: str,
    input_names: Sequence[str],
    output_names: Sequence[str],
    owner: str = "model",
) -> Runner:
    """Runs an onnxruntime session, once its names are checked.

    Arguments as in `signature_runner`; `session` is an
    `onnxruntime.InferenceSession`.

    Raises:
        ParityError: if one of the names is missing.
    """
    found = [node.name for node in session.get_inputs()]
    _check_names(what, "inputs", found, input_names, owner)
    names = [node.name for node in session.get_outputs()]
    _check_names(what, "outputs", names, output_names, owner)

    def run(arrays):
        return dict(zip(names, session.run(None, dict(arrays)), strict=True))

    return run


def saved_model_runner(directory: str, endpoint: Endpoint) -> Runner:
    import tensorflow as tf

    if not os.path.isdir(directory):
        raise FileNotFoundError(f"SavedModel directory not found: {directory}")
    require_saved_model_pb(directory)
    try:
        loaded = tf.saved_model.load(directory)
    except Exception as error:
        raise ValueError(
            f"Cannot load SavedModel {directory}: {_brief(error)}"
        ) from error
    return signature_runner(
        loaded,
        f"SavedModel {directory}",
        "serving_default",
        [s.name for s in endpoint.inputs],
        endpoint.output_names,
    )


def onnx_runner(path: str, endpoint: Endpoint) -> Runner:
    import onnxruntime

    if not os.path.isfile(path):
        raise FileNotFoundError(f"ONNX file not found: {path}")
    try:
        session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
    except Exception as error:
        raise ValueError(f"Cannot load ONNX model {path}: {_brief(error)}") from error
    return session_runner(
        session,
        f"ONNX model {path}",
        [s.name for s in endpoint.inputs],
        endpoint.output_names,
    )


def compare_runtimes(
    endpoint: Endpoint,
    runners: Mapping[str, Runner],
    shapes: Sequence[tuple[int, int]],
    atol: float,
    rtol: float,
    seed: int,
) -> ParityReport:
    """Runs each runtime and Keras on every shape; raises beyond tolerance."""
    rows = []
    labels = set()
    for index, (batch, time) in enumerate(shapes):
        arrays = example_inputs(endpoint, batch, time, seed=seed + index)
        # A model with a fixed length keeps it: label the shape actually run.
        time = next((a.shape[1] for a in arrays.values() if a.ndim > 1), time)
        label = f"{batch}x{time}" + (
            " padded" if is_padded(endpoint, batch, time) else ""
        )
        if label in labels:
            continue
        labels.add(label)
        expected = keras_reference(endpoint, arrays)
        for runtime, run in runners.items():
            try:
                actual = run(arrays)
            except Exception as error:
                raise ParityError(
                    f"{runtime} failed on {label} inputs where Keras runs: "
                    f"{_brief(error)}",
                    ParityReport(tuple(rows), atol, rtol),
                ) from error
            results = [
                _compare(expected[name], actual[name], atol, rtol)
                for name in endpoint.output_names
            ]
            rows.append(
                ParityRow(
                    runtime,
                    label,
                    max(r[0] for r in results),
                    max(r[1] for r in results),
                    all(r[2] for r in results),
                )
            )
    report = ParityReport(tuple(rows), atol, rtol)
    if not report.ok:
        worst = max(report.failures, key=lambda row: row.max_abs_err)
        raise ParityError(
            f"{len(report.failures)} of {len(rows)} checks differ from Keras beyond "
            f"atol={atol:g}, rtol={rtol:g}; worst: {worst.runtime} on "
            f"{worst.shape}, max abs err {worst.max_abs_err:.3g}",
            report,
        )
    return report


def _check_shapes(shapes) -> tuple[tuple[int, int], ...]:
    checked = []
    for shape in shapes:
        if (
            not isinstance(shape, Sequence)
            or len(shape) != 2
            or not all(
                isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape
            )
        ):
            raise ValueError(
                "`shapes` must be a sequence of (batch, time) pairs of positive "
                f"ints. Received: shapes={shapes!r}"
            )
        checked.append((shape[0], shape[1]))
    if not checked:
        raise ValueError(f"`shapes` must not be empty. Received: shapes={shapes!r}")
    return tuple(checked)


def _check_tolerance(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise ValueError(
            f"`{name}` must be a non-negative number. Received: {name}={value!r}"
        )
    return float(value)


def verify(
    model: keras.Model,
    saved_model_dir: str | os.PathLike | None = None,
    onnx_path: str | os.PathLike | None = None,
    *,
    shapes: Sequence[tuple[int, int]] | None = None,
    attention_outputs: str | Mapping[str, str] | None = None,
    atol: float = DEFAULT_ATOL,
    rtol: float = DEFAULT_RTOL,
    seed: int = 0,
) -> ParityReport:
    """Checks that exported models compute what the Keras model computes.

    Each runtime (the SavedModel's `serving_default` signature through
    `tf.saved_model.load`, the ONNX file through `onnxruntime`) and Keras get
    the same random inputs for every (batch, time) in `shapes`. Float inputs
    are standard normal; integer token and boolean mask inputs have rows
    padded at the end (see the report's "padded" shapes).

    Args:
        model: The Keras model that was exported.
        saved_model_dir: A SavedModel version directory, or None.
        onnx_path: An ONNX file, or None.
        shapes: (batch, time) pairs. Defaults to
            ((1, 1), (2, 33), (3, 128), (2, 512)).
        attention_outputs: As given to the export, when it added attention
            weights as outputs; they are then compared too.
        atol: Absolute tolerance.
        rtol: Relative tolerance: an element passes when
            |runtime - keras| <= atol + rtol * |keras|.
        seed: Seed of the random inputs.

    Returns:
        A `ParityReport` (every row within tolerance).

    Raises:
        ParityError: if a runtime differs from Keras beyond tolerance, or its
            input or output names differ from the model's; the error's
            `report` holds the rows.
        ValueError: if neither artifact is given or an argument is invalid.
        FileNotFoundError: if an artifact does not exist.

    Example:

    >>> from keras_selfattn.export import export_onnx, verify  # doctest: +SKIP
    >>> path = export_onnx(model, "model.onnx")  # doctest: +SKIP
    >>> print(verify(model, onnx_path=path))  # doctest: +SKIP
    """
    if saved_model_dir is None and onnx_path is None:
        raise ValueError(
            "Pass `saved_model_dir`, `onnx_path` or both. "
            "Received: saved_model_dir=None, onnx_path=None"
        )
    shapes = _check_shapes(DEFAULT_SHAPES if shapes is None else shapes)
    atol = _check_tolerance("atol", atol)
    rtol = _check_tolerance("rtol", rtol)
    endpoint = build_endpoint(model, attention_outputs)
    runners: dict[str, Runner] = {}
    if saved_model_dir is not None:
        runners["saved_model"] = saved_model_runner(
            os.fspath(saved_model_dir), endpoint
        )
    if onnx_path is not None:
        runners["onnx"] = onnx_runner(os.fspath(onnx_path), endpoint)
    return compare_runtimes(endpoint, runners, shapes, atol, rtol, seed)
