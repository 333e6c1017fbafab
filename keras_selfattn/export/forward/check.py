"""`verify`: numeric parity of exported models with Keras, on the forward
pass's runs (shapes, inputs, Keras's references); its rules are
`parity.rules`, its report `parity.report`, its engine `parity.engine`."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping, Sequence

import keras

from keras_selfattn.export import precision, quantization
from keras_selfattn.export.forward.graph import (
    Endpoint,
    build_endpoint,
    keras_reference,
)
from keras_selfattn.export.parity import engine, exact, runner
from keras_selfattn.export.parity.report import (
    ParityError,
    ParityReport,
    finish_report,
)
from keras_selfattn.export.parity.rules import DEFAULT_ATOL, DEFAULT_RTOL, ParityRow
from keras_selfattn.export.signature import Signature, example_inputs, is_padded

# What importers of `verify` find here besides it: its defaults, its report.
__all__ = [
    "DEFAULT_ATOL",
    "DEFAULT_RTOL",
    "DEFAULT_SHAPES",
    "ParityError",
    "ParityReport",
    "ParityRow",
    "verify",
]

# (batch, time): a single step, an odd length, and two long ones. Rows after
# the first are padded when the model has integer or boolean inputs.
DEFAULT_SHAPES: tuple[tuple[int, int], ...] = ((1, 1), (2, 33), (3, 128), (2, 512))
# A quantized model's root mean square rules need this many elements of
# each output over a call (a classifier's few logits a row give too few):
# `verify` adds rows of `QUANTIZED_TIME` to its default shapes, or repeats
# the shapes it is given with other inputs. With 256, two equally fine
# schemes' ratio ranged 0.85-1.40 over input seeds (LiteRT's int8
# classifier, D=512: docs/quantization.md); with 1024, 0.96-1.07.
QUANTIZED_ELEMENTS = 1024
QUANTIZED_TIME = 16


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
    endpoint: Endpoint,
    target: Signature,
    shapes: Sequence[tuple[int, int]],
    seed: int,
) -> tuple[list[runner.Run], list[str], _References]:
    """The one-step runs of `verify`, their labels, and the references.

    `target` is `endpoint.target()`, as the check has it. A model with a
    fixed length keeps it (the label says the shape run). Shapes that come
    out the same are run once, but a quantized model's repeated shapes run
    with other inputs (labelled "#2", "#3", ...).
    """
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
        runs.append(runner.Run((arrays,)))
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
    paths: Mapping[str, str | os.PathLike] | None = None,
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
        paths: More artifacts, {format: path} (`formats.table.NAMES`:
            `{"onnx": "model.onnx"}` is `onnx_path="model.onnx"`); a format
            given here and by its keyword is refused.
        shapes: (batch, time) pairs. Defaults to
            ((1, 1), (2, 33), (3, 128), (2, 512)). A quantized model's rules
            compare typical errors: where its outputs have fewer than 1024
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
    keywords = {
        "saved_model_dir": saved_model_dir,
        "onnx_path": onnx_path,
        "litert_path": litert_path,
        "openvino_path": openvino_path,
        "torch_path": torch_path,
    }
    paths = engine.artifact_paths(keywords, paths)
    artifacts = engine.collect_artifacts(
        paths, {"openvino_precision": openvino_precision}
    )
    default = shapes is None
    shapes = engine.check_shapes(DEFAULT_SHAPES if default else shapes)
    atol = engine.check_tolerance("atol", atol)
    rtol = engine.check_tolerance("rtol", rtol)
    endpoint = build_endpoint(model, attention_outputs, precision)
    return check_endpoint(
        endpoint,
        endpoint.target(),
        artifacts,
        shapes,
        default,
        attention_outputs,
        atol,
        rtol,
        seed,
    )


def check_endpoint(
    endpoint: Endpoint,
    target: Signature,
    artifacts: Mapping[str, runner.Artifact],
    shapes: Sequence[tuple[int, int]],
    default: bool,
    attention_outputs: str | Mapping[str, str] | None,
    atol: float,
    rtol: float,
    seed: int = 0,
) -> ParityReport:
    """The check `verify` runs, on an endpoint already built: the exporters
    pass theirs (`Forward`), `verify` builds one from its arguments.

    Args:
        endpoint: The endpoint checked (its `source` is Keras's reference).
        target: `endpoint.target()`, as built for the export.
        artifacts: {runtime label: artifact}, from
            `engine.collect_artifacts`.
        shapes: The checked (batch, time) pairs (`engine.check_shapes`).
        default: Whether `shapes` are `DEFAULT_SHAPES` (a quantized model
            adds rows of `QUANTIZED_TIME` to them, else repeats them).
        attention_outputs: As given to the export.
        atol, rtol: Checked tolerances (`engine.check_tolerance`).
        seed: Seed of the random inputs.
    """
    if target.quantized:
        shapes = quantized_shapes(endpoint, shapes, default)
    runs, labels, references = forward_runs(endpoint, target, shapes, seed)
    float64 = None
    if references.dequantized is None and endpoint.half is None:
        steps = [run.steps[0] for run in runs]
        float64 = exact.Float64Reference(endpoint, attention_outputs, steps)
    rows = engine.check_artifacts(
        target,
        artifacts,
        runs,
        references.expected,
        labels,
        atol,
        rtol,
        dequantized=references.dequantized,
        model_outputs=references.model_outputs,
        half=endpoint.half,
        float64=float64,
    )
    notes = _notes(endpoint) + (float64.note() if float64 else ())
    return finish_report(rows, atol, rtol, "checks differ from Keras", notes=notes)


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
