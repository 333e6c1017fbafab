"""The forward pass as a `pipeline.Target` (`Forward`): what it exports (the
model's `Endpoint` from `graph`), what it refuses (a half dtype the format
cannot keep), and its check (`check`: Keras's outputs on several shapes)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

import keras

from keras_selfattn.export import formats, pipeline
from keras_selfattn.export.forward.check import (
    DEFAULT_ATOL,
    DEFAULT_RTOL,
    DEFAULT_SHAPES,
    ParityReport,
    check_endpoint,
)
from keras_selfattn.export.forward.graph import Endpoint, build_endpoint
from keras_selfattn.export.parity import engine
from keras_selfattn.export.signature import Signature
from keras_selfattn_runtimes import table

# The options every format's export takes, and their defaults.
COMMON_OPTIONS = {
    "attention_outputs": None,
    "check": True,
    "atol": DEFAULT_ATOL,
    "rtol": DEFAULT_RTOL,
    "precision": "float32",
}


@dataclasses.dataclass
class Forward(pipeline.Target):
    """A model's forward pass (its `Endpoint`) as `pipeline.export` runs it:
    refused in a half dtype its format cannot keep, checked as `verify`
    checks (on a fixed-shape artifact's shape: the exporters give one
    format). The endpoint is built once per export, by the first `build`,
    and the check reuses it and its target.

    Attributes:
        model, attention_outputs, atol, rtol, precision: As given to the
            exporters.
        options: The format's options (`Format.check_options`).
    """

    model: keras.Model
    attention_outputs: str | Mapping[str, str] | None
    atol: float
    rtol: float
    precision: str
    options: Mapping[str, object]
    # What the check runs: a fixed-shape artifact's shape, the runtimes'
    # keywords of an artifact its runtime computes in a half dtype.
    _shapes: list | None = None
    _runtime: dict = dataclasses.field(default_factory=dict)
    # The endpoint in the export's precision and its target, built once;
    # a float32 one for a format whose runtime computes the half dtype.
    _endpoint: Endpoint | None = None
    _target: Signature | None = None
    _float32: Signature | None = None

    def destination(
        self, export_format: str, path: str | os.PathLike
    ) -> formats.Destination:
        destination = pipeline.check_destination(export_format, path, **self.options)
        fixed = destination.options.get("shape")
        self._shapes = None if fixed is None else [fixed]
        return destination

    def build(self, export_format: str) -> Signature:
        row = table.BY_NAME[export_format]
        if self._endpoint is None:
            self._endpoint = build_endpoint(
                self.model, self.attention_outputs, self.precision
            )
            self._target = self._endpoint.target()
        require_half(row, self._endpoint)
        runtime = row.runtime_half.get(self._endpoint.half, {})
        if not runtime:
            return self._target
        # A float32 artifact its runtime computes in the half dtype.
        if self._float32 is None:
            self._float32 = build_endpoint(self.model, self.attention_outputs).target()
        self._runtime.update(runtime)
        return self._float32

    def check(self, staged: Mapping[str, str]) -> ParityReport:
        """`verify`'s check of the staged artifacts, on the endpoint built
        for them (`build`)."""
        return self.check_at(staged, self._shapes, self._runtime)

    def check_at(
        self,
        staged: Mapping[str, str],
        shapes: list | None = None,
        runtime: Mapping[str, object] | None = None,
    ) -> ParityReport:
        """`verify` of the artifacts `staged`, {format: path}, on `shapes`
        (None: `verify`'s defaults) with `verify`'s runtime keywords
        `runtime` (`openvino_precision`), on the endpoint `build` built."""
        paths = engine.artifact_paths({}, staged)
        artifacts = engine.collect_artifacts(paths, dict(runtime or {}))
        default = shapes is None
        shapes = engine.check_shapes(DEFAULT_SHAPES if default else shapes)
        return check_endpoint(
            self._endpoint,
            self._target,
            artifacts,
            shapes,
            default,
            self.attention_outputs,
            engine.check_tolerance("atol", self.atol),
            engine.check_tolerance("rtol", self.rtol),
        )


def require_half(row: table.FormatRow, endpoint: Endpoint) -> None:
    """Refuses `precision="model"` for a half dtype the format cannot keep.

    Raises:
        ValueError: one line naming the format, the dtype and what works.
    """
    if endpoint.half is not None and endpoint.half not in row.half:
        keeps = f" (it keeps {' and '.join(row.half)})" if row.half else ""
        raise ValueError(
            f"{row.title} export cannot keep {endpoint.half} arithmetic{keeps}: "
            "export in float32 (precision='float32', the default), or in "
            f"{endpoint.half} to "
            + ", ".join(r.title for r in table.ROWS if endpoint.half in r.half)
            + ". Received: precision='model'"
        )
