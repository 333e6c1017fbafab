"""The report of a parity check: its rows, their text table, and the error
raised when one is beyond tolerance."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from keras_selfattn.export.parity.rules import (
    FLOAT64_LARGEST,
    FLOAT64_MARGIN,
    LARGEST_MARGIN,
    QUANTIZED_MARGIN,
    ROUNDING_SHARE,
    ParityRow,
)


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
            header = (
                "runtime",
                "shape",
                "vs quantized keras",
                "vs dequantized float",
                "keras's own",
                "rms ratio",
                "ok",
            )
            lines = [
                (
                    row.runtime,
                    row.shape,
                    f"{row.max_abs_err:.2e}",
                    f"{row.dequantized_err:.2e}",
                    f"{row.quantization_err:.2e}",
                    f"{row.rms_ratio:.2f}",
                    _yes(row),
                )
                for row in self.rows
            ]
            below = self._quantized_rules()
        else:
            half = any(row.model_precision_err is not None for row in self.rows)
            exact = any(row.float64_err is not None for row in self.rows)
            header = ("runtime", "shape", "max abs err", "max rel err", "ok")
            header += ("vs model's own dtype",) if half else ()
            header += ("vs float64", "keras vs float64", "rms ratio") if exact else ()
            lines = [
                (
                    row.runtime,
                    row.shape,
                    f"{row.max_abs_err:.2e}",
                    f"{row.max_rel_err:.2e}",
                    _yes(row),
                )
                + ((f"{row.model_precision_err:.2e}",) if half else ())
                + (_float64_cells(row) if exact else ())
                for row in self.rows
            ]
            below = [f"tolerance: |err| <= {self.atol:g} + {self.rtol:g} * |keras|"]
            if exact:
                below.append(
                    "rows beyond it judged against the model in float64, over all "
                    f"the shapes: rms <= {FLOAT64_MARGIN:g} x keras's own (rms "
                    f"ratio) + {self.atol:g}, each element <= {FLOAT64_LARGEST:g} x "
                    f"keras's largest + {self.atol:g} + {self.rtol:g} * |float64|"
                )
        return "\n".join(_aligned([header, *lines]) + below + list(self.notes))

    def _quantized_rules(self) -> list[str]:
        """The lines below a quantized model's table: each runtime's scheme,
        what the columns are, and the rules."""
        schemes = {}
        for row in self.rows:
            schemes.setdefault(row.runtime, row.scheme or "not stated")
        return [f"{runtime}: {scheme}" for runtime, scheme in schemes.items()] + [
            "errors are largest |difference|; rms ratio: root mean square error "
            "vs dequantized float over keras's own, over all the shapes",
            f"tolerance: rms ratio <= {QUANTIZED_MARGIN:g} and each element vs "
            f"dequantized <= {LARGEST_MARGIN:g} x keras's own largest over the "
            f"shapes, + {self.atol:g} + "
            f"{self.rtol:g} * |reference|; Keras's own scheme also rms vs quantized "
            f"keras <= {ROUNDING_SHARE:g} x keras's own rms, each element <= keras's "
            "own",
        ]

    def __str__(self) -> str:
        return self.table()


def _yes(row: ParityRow) -> str:
    return "yes" if row.ok else "NO"


def _float64_cells(row: ParityRow) -> tuple[str, ...]:
    """A float row's distances from float64, "-" where the tolerance sufficed."""
    if row.float64_err is None:
        return ("-", "-", "-")
    return (
        f"{row.float64_err:.2e}",
        f"{row.keras_float64_err:.2e}",
        f"{row.rms_ratio:.2f}",
    )


def _aligned(lines: Sequence[tuple[str, ...]]) -> list[str]:
    """`lines` (the header first) in columns as wide as their widest cell,
    with a rule below the header."""
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    text = [
        "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip()
        for line in lines
    ]
    text.insert(1, "  ".join("-" * width for width in widths))
    return text


class ParityError(RuntimeError):
    """An export computes something other than its Keras model.

    Attributes:
        report: The `ParityReport` (rows so far; may be empty when the
            export's inputs or outputs do not match the model's).
    """

    def __init__(self, message: str, report: ParityReport):
        super().__init__(message)
        self.report = report


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
