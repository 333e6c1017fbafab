"""Export a model's decoding step: new positions + caches + index -> output + caches.

A decoding step runs the model on the positions `index .. index + new - 1`
only, with one key/value cache per causal SelfAttention layer:

    inputs:  <model input>       (batch, new, ...)   the model's own input
             cache_<layer name>   (batch, 2, max_length, kv_heads, key_dim)
             cache_update_index   int32 scalar, the first new position
    outputs: <model output>       (batch, new, ...)   the new positions' outputs
             updated_cache_<layer name>              the caches after the step

The step's graph is `graph` (finding the cached layers,
threading the caches through the model), its step-by-step check against
Keras `check`. The step is a `Signature` (`DecodeStep.target()`)
and rides the forward export's pipeline: `export_decode_step` writes it in
any format the backend can export (`formats.table`; SavedModel signature
"decode_step" for TF Serving, also aliased as "serving_default"; ONNX with
dynamic "batch" and "time" axes), checking it before it appears: a whole
sequence decoded step by step (a prompt, then one position per step up to
`max_length`) through the export, in a fresh process of its runtime, and
through Keras's cached calls, and Keras's cached calls against the model's
full (uncached) forward.

Supported models: one input and one output (a subclassed model is called
on int32 ids named "tokens"), causal SelfAttention layers anywhere in it
(top level, inside subclassed layers, nested or subclassed models), each
called once per step on one tensor, learned positions from layers that
take the decoded positions (docs/decoding.md, "Which models decode").
Any graph around them (Embedding, Dense, LayerNormalization, residual
Adds) works as long as it is position-wise: position t's output may depend
on earlier positions only through the SelfAttention layers. That is
checked numerically before anything is written (`generation.decode_check`:
the cached decode must equal the full forward), not assumed. Refused with
a ValueError: several inputs or outputs, a SelfAttention called twice or
with an attention mask or bias, non-causal layers, padding masks
(`mask_zero=True`, `Masking`), layers that mix positions.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

import keras

from keras_selfattn.export import formats, pipeline
from keras_selfattn.export.decode_step.check import (
    check_step,
    keras_decode,
    schedule,
    teacher_inputs,
    verify_decode_step,
)
from keras_selfattn.export.decode_step.graph import (
    INDEX_NAME,
    DecodeStep,
    build_decode_step,
    read_model,
    refuse_quantized,
)
from keras_selfattn.export.parity.engine import (
    artifact_paths,
    check_tolerance,
    collect_artifacts,
)
from keras_selfattn.export.parity.report import ParityReport
from keras_selfattn.export.parity.rules import DEFAULT_ATOL, DEFAULT_RTOL
from keras_selfattn.export.signature import Signature
from keras_selfattn.generation import cached_model, decode_check
from keras_selfattn_runtimes import table

# What importers of the exporters find here besides them: the step and its
# check.
__all__ = [
    "INDEX_NAME",
    "DecodeStep",
    "DecodeStepExport",
    "build_decode_step",
    "export_decode_step",
    "export_decode_step_onnx",
    "export_decode_step_saved_model",
    "keras_decode",
    "refuse_quantized",
    "schedule",
    "teacher_inputs",
    "verify_decode_step",
]


def export_decode_step(
    model: keras.Model,
    path: str | os.PathLike,
    export_format: str,
    *,
    max_length: int,
    name: str | None = None,
    version: int | None = None,
    models_config: bool = True,
    opset: int | None = None,
    check: bool = True,
    atol: float = DEFAULT_ATOL,
    rtol: float = DEFAULT_RTOL,
) -> str:
    """Exports the decoding step in any format, checked before it appears.

    The step (`DecodeStep.target()`) goes through the same staging,
    conversion and fresh-process check as the model's forward export; only
    the check differs: whole sequences decoded step by step
    (`verify_decode_step`).

    Args:
        model: See the module docstring for the supported structures.
        path: The SavedModel base dir ("saved_model": `path/name/VERSION/`,
            signature "decode_step") or the file to create.
        export_format: "saved_model", "onnx", "litert", "openvino" or "torch".
        max_length: The caches' length (the longest sequence decoded).
        name, version, models_config: The SavedModel's (as in
            `export_saved_model`); `name` is required there.
        opset: ONNX opset, 13 to 18 (ONNX only). Defaults to 17.
        check: Whether to verify the export before it appears (and the
            model's cached decode against its full forward pass first,
            docs/decoding.md); False skips both.
        atol, rtol: Tolerances of that check.

    Returns:
        The version folder or the file.

    Raises:
        ValueError: for a backend that cannot export the format, an
            unsupported model, or an invalid argument.
        FileExistsError: if the target exists.
        ParityError: if the check fails (nothing is left on disk).
    """
    options = {
        "name": name,
        "version": version,
        "models_config": models_config,
        "opset": opset,
    }
    step = DecodeStepExport(model, max_length, options, {"atol": atol, "rtol": rtol})
    with decode_check.waived(not check):
        return pipeline.export(step, {export_format: path}, check)[export_format]


@dataclasses.dataclass
class DecodeStepExport(pipeline.Target):
    """A model's decoding step as `pipeline.export` runs it: refused on the
    backends a format names (`FormatRow.decoding_refused`) and for a
    quantized model where the format cannot take it, checked by decoding
    whole sequences step by step (`verify_decode_step`).

    Attributes:
        model: The model (module docstring).
        max_length: The caches' length.
        options: The exporter's format options; each format takes its own
            (`FormatRow.options`).
        checks: `verify_decode_step`'s `atol` and `rtol`.
    """

    model: keras.Model
    max_length: int
    options: Mapping[str, object]
    checks: Mapping[str, float]
    _step: DecodeStep | None = None
    _reading: cached_model.Reading | None = None

    def _read(self) -> cached_model.Reading:
        """The model's one reading for this export (`read_model`)."""
        if self._reading is None:
            self._reading = read_model(self.model)
        return self._reading

    def refuse(self, export_format: str) -> None:
        row = table.BY_NAME.get(export_format)
        backend = keras.backend.backend()
        if row is not None and backend in row.decoding_refused:
            raise ValueError(
                f"{row.decoding_refused[backend]} Received: "
                f"export_format={export_format!r} on the {backend} backend"
            )
        refuse_quantized(self._read, export_format, "decoding step")

    def destination(
        self, export_format: str, path: str | os.PathLike
    ) -> formats.Destination:
        self.refuse(export_format)
        options = pipeline.format_options(export_format, self.options)
        return pipeline.check_destination(export_format, path, **options)

    def build(self, export_format: str) -> Signature:
        if self._step is None:
            self._step = build_decode_step(self.model, self.max_length, self._reading)
        return self._step.target()

    def check(self, staged: Mapping[str, str]) -> ParityReport:
        """`verify_decode_step`'s check of the staged artifacts, on the step
        built for them (`build`)."""
        atol = check_tolerance("atol", self.checks.get("atol", DEFAULT_ATOL))
        rtol = check_tolerance("rtol", self.checks.get("rtol", DEFAULT_RTOL))
        artifacts = collect_artifacts(artifact_paths({}, staged))
        return check_step(self.model, self._step, artifacts, atol=atol, rtol=rtol)


def export_decode_step_saved_model(
    model: keras.Model,
    base_dir: str | os.PathLike,
    name: str,
    version: int | None = None,
    *,
    max_length: int,
    models_config: bool = True,
    check: bool = True,
    atol: float = DEFAULT_ATOL,
    rtol: float = DEFAULT_RTOL,
) -> str:
    """Exports the decoding step for TF Serving as `base_dir/name/VERSION/`.

    The SavedModel's signature "decode_step" (also under "serving_default")
    takes the model's input (batch, new, ...), one cache
    `cache_<layer>` (batch, 2, max_length, kv_heads, key_dim) per
    SelfAttention layer and the int32 scalar `cache_update_index`, and returns
    the model's output for the new positions and `updated_cache_<layer>`.
    Written beside the target and renamed into place after the check
    (`verify_decode_step`), under the version rules of `serving.layout`.
    TensorFlow and JAX backends (`export_decode_step`).

    Args:
        model: See the module docstring for the supported structures.
        base_dir, name, version, models_config: As in `export_saved_model`.
        max_length: The caches' length (the longest sequence decoded).
        check: Whether to verify the export before it appears.
        atol, rtol: Tolerances of that check.

    Returns:
        The version folder.

    Raises:
        ValueError: for a backend that cannot export a SavedModel, an
            unsupported model, an invalid name, version or max_length.
        FileExistsError: if the version exists.
        ParityError: if the check fails (nothing is left on disk).
    """
    options = {"name": name, "version": version, "models_config": models_config}
    checks = {"check": check, "atol": atol, "rtol": rtol}
    return export_decode_step(
        model,
        base_dir,
        table.SAVED_MODEL.name,
        max_length=max_length,
        **options,
        **checks,
    )


def export_decode_step_onnx(
    model: keras.Model,
    path: str | os.PathLike,
    *,
    max_length: int,
    opset: int | None = None,
    check: bool = True,
    atol: float = DEFAULT_ATOL,
    rtol: float = DEFAULT_RTOL,
) -> str:
    """Exports the decoding step to an ONNX file.

    Inputs and outputs are named as in `export_decode_step_saved_model`; axis
    0 is "batch", the new positions' axis "time" (the caches' max_length is
    fixed). The file passes `onnx.checker`, is written beside `path`, checked
    in onnxruntime (`verify_decode_step`) and linked into place.

    Args:
        model: See the module docstring.
        path: The ONNX file to create (never replaced).
        max_length: The caches' length.
        opset: ONNX opset, 13 to 18. Defaults to 17.
        check, atol, rtol: As in `export_decode_step_saved_model`.

    Returns:
        `path`, as a string.
    """
    checks = {"check": check, "atol": atol, "rtol": rtol}
    return export_decode_step(
        model, path, table.ONNX.name, max_length=max_length, opset=opset, **checks
    )
