"""A model's forward pass as an export target (`Forward`): what it exports
(the model's `Endpoint`: named inputs and outputs, the graph), what it
refuses (a half dtype the format cannot keep) and its reference (`verify`,
Keras's outputs on several shapes)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

import keras

from keras_selfattn.export import formats, pipeline
from keras_selfattn.export.endpoint import Endpoint, build_endpoint
from keras_selfattn.export.formats import table
from keras_selfattn.export.target import ExportTarget
from keras_selfattn.export.verify import ParityReport, verify


@dataclasses.dataclass
class Forward(pipeline.Target):
    """A model's forward pass (its `Endpoint`) as `pipeline.export` runs it:
    refused in a half dtype its format cannot keep, checked by `verify`
    (on a fixed-shape artifact's shape: the exporters give one format).

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

    def destination(
        self, export_format: str, path: str | os.PathLike
    ) -> formats.Destination:
        destination = pipeline.check_destination(export_format, path, **self.options)
        fixed = destination.options.get("shape")
        self._shapes = None if fixed is None else [fixed]
        return destination

    def build(self, export_format: str) -> ExportTarget:
        row = table.BY_NAME[export_format]
        endpoint = build_endpoint(self.model, self.attention_outputs, self.precision)
        require_half(row, endpoint)
        runtime = row.runtime_half.get(endpoint.half, {})
        if runtime:
            # A float32 artifact its runtime computes in the half dtype.
            endpoint = build_endpoint(self.model, self.attention_outputs)
            self._runtime.update(runtime)
        return endpoint.target()

    def check(self, staged: Mapping[str, str]) -> ParityReport:
        return verify(
            self.model,
            attention_outputs=self.attention_outputs,
            atol=self.atol,
            rtol=self.rtol,
            shapes=self._shapes,
            precision=self.precision,
            **self._runtime,
            paths=staged,
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
