"""The judging rules of exported models' outputs against Keras's: one row
per runtime and input shape (`ParityRow`).

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
  own largest error over all of the call's shapes too (plus the float
  tolerance in both): a classifier's one-token row has four logits, whose
  largest error is no measure of a scheme's;
- an artifact that computes Keras's own scheme (it says so in its metadata)
  must also match the quantized model: its root mean square error against it
  (over all the shapes) at most `ROUNDING_SHARE` of Keras's own, and no
  element further from it than Keras's own largest error, plus the float
  tolerance. Activations whose float value differs by an ulp before a
  quantizer (the runtime's attention or softmax rounds differently) can
  round to the neighbouring integer: sparse steps, one quantization step
  each, while a model that quantizes otherwise has errors independent of
  Keras's, about 1.4 times Keras's own away from it.

A float model's artifact beyond the tolerance has a second reference: the
model computed in float64 on its backend (`parity.exact`). An
ill-conditioned model (scores in the hundreds) leaves Keras's own float32
output far from exact, and any runtime that sums in another order differs
from Keras by as much as Keras differs from exact. Such a row passes when
the artifact is no further from float64 than Keras is, per output over
all of the call's shapes: its root mean square error against float64 at
most `FLOAT64_MARGIN` times Keras's own (plus atol), and no element
further from float64 than `FLOAT64_LARGEST` times Keras's own largest
error plus the float tolerance. The margins are sampling noise, not
leniency: such errors sit in a few ill-conditioned positions, so two
equally exact float32 computations differ in both measures from one
input to another (docs/export.md). An artifact off by Keras's own
largest error everywhere (40x-80x its root mean square) is refused.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from keras_selfattn.export import precision

DEFAULT_ATOL = 1e-5
DEFAULT_RTOL = 1e-4
# A quantized model's artifact may be this many times as far from the
# dequantized-float reference as Keras's own quantized model is (root mean
# squares), and each element this many times Keras's largest error.
QUANTIZED_MARGIN = 1.25
LARGEST_MARGIN = 2.0
# The share of Keras's own quantization error (root mean square) an
# artifact computing Keras's scheme may differ from it by (activations
# rounding the other way).
ROUNDING_SHARE = 0.25
# A float artifact beyond the tolerance passes if its root mean square
# error against float64 is at most this many times Keras's own, and each
# element's at most `FLOAT64_LARGEST` times Keras's largest.
FLOAT64_MARGIN = 1.5
FLOAT64_LARGEST = 3.0


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
            dequantized float| over Keras's own (the worst output); a
            float row judged against float64: root mean square of |runtime
            - float64| over Keras's own.
        float64_err: A float row beyond the tolerance: largest |runtime -
            the model in float64|; None where the tolerance sufficed.
        keras_float64_err: Then Keras's own largest |keras - float64|.
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
    float64_err: float | None = None
    keras_float64_err: float | None = None


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
    (one per output): the largest errors and, for Keras's own scheme, the
    rule on each element against the quantized model (the rules against
    the dequantized-float model pool a call's rows: `pooled`)."""
    exact = bool(description.get("exact"))
    errors, dequantized, own, relative, ok = [], [], [], [], True
    for keras_out, float_out, actual in triples:
        keras_gap = _gap(actual, keras_out)
        float_gap = _gap(actual, float_out)
        own_largest = float(_gap(keras_out, float_out).max(initial=0.0))
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
    """`rows` (one runtime's, one per run) judged by the rules against the
    dequantized-float model over all their runs together, per output (a few
    outputs of one run are too few to tell one scheme's typical or largest
    error from another's): the root mean squares, and each element against
    Keras's own largest error over the runs.

    Args:
        rows: From `quantized_row`, in run order.
        triples: Per run, the (keras, dequantized, actual) triple of each
            output.
    """
    exact = bool(description.get("exact"))
    ok, ratios, each = True, [], [row.ok for row in rows]
    for output in zip(*triples, strict=True):
        own_largest = max(float(_gap(k, f).max(initial=0.0)) for k, f, _ in output)
        for run, (_, float_out, actual) in enumerate(output):
            allowed = LARGEST_MARGIN * own_largest + atol + rtol * np.abs(float_out)
            each[run] &= _within(_gap(actual, float_out), allowed)
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
    return [
        dataclasses.replace(row, ok=row_ok and ok, rms_ratio=ratio)
        for row, row_ok in zip(rows, each, strict=True)
    ]


def float64_judged(
    rows: Sequence[ParityRow],
    triples: Sequence[Sequence[tuple]],
    atol: float,
    rtol: float,
) -> list[ParityRow]:
    """`rows` (one runtime's float rows, one per run, some beyond the
    tolerance) with those beyond it judged against float64, over all the
    runs together, per output: ok when the artifact's root mean square
    error against float64 is at most `FLOAT64_MARGIN` times Keras's own
    plus atol, and each element's at most `FLOAT64_LARGEST` times Keras's
    largest plus the float tolerance. A run or two of few ill-conditioned
    positions are too few to tell two equally exact computations apart, so
    both measures pool the runs. The root mean square rule takes no rtol:
    outputs of tens would let it accept errors many times Keras's own.

    Args:
        rows: From `float_row`, in run order.
        triples: Per run, the (keras, float64, actual) triple of each
            output.
    """
    each, ok, ratios = [True] * len(rows), True, []
    found, own = [0.0] * len(rows), [0.0] * len(rows)
    for output in zip(*triples, strict=True):
        largest = max(float(_gap(k, e).max(initial=0.0)) for k, e, _ in output)
        for run, (keras_out, exact, actual) in enumerate(output):
            gap = _gap(actual, exact)
            allowed = FLOAT64_LARGEST * largest + atol + rtol * np.abs(exact)
            each[run] &= _within(gap, allowed)
            found[run] = max(found[run], float(gap.max(initial=0.0)))
            own[run] = max(own[run], float(_gap(keras_out, exact).max(initial=0.0)))
        keras_out, exact, actual = (
            np.concatenate([np.ravel(np.asarray(t[i], np.float64)) for t in output])
            for i in range(3)
        )
        own_rms = _rms(_gap(keras_out, exact))
        rms = _rms(_gap(actual, exact))  # NaN where an output is: refused
        ok &= rms <= FLOAT64_MARGIN * own_rms + atol
        ratios.append(rms / own_rms if own_rms else np.inf if rms else 0.0)
    ratio = max(ratios, default=0.0)
    return [
        row
        if row.ok
        else dataclasses.replace(
            row,
            ok=bool(each[run] and ok),
            rms_ratio=ratio,
            float64_err=found[run],
            keras_float64_err=own[run],
        )
        for run, row in enumerate(rows)
    ]


def float_row(
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


def largest_gap(
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
