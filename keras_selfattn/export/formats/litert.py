"""LiteRT (.tflite): TensorFlow's converter, or litert-torch on torch.

On TensorFlow the converter keeps batch and time dynamic; litert-torch on
torch fixes them (option `shape`). A target with extra signatures (a
generator's "prefill" and "decode" beside "generate") is converted with
them into one file (`litert_signatures`, TensorFlow); a target alone goes
through Keras's `model.export`. A quantized model is converted with its
dequantized kernels as float constants, then quantized by LiteRT's own
`ai_edge_quantizer` (`RECIPES`), the same on both backends:

- int8 layers whose activations Keras quantizes (per token): dynamic range,
  int8 weights per output channel, symmetric, and int8 activations per row
  on LiteRT's hybrid kernels. Re-quantizing the dequantized kernel gives
  back exactly Keras's integers and scales (Keras's largest code in a
  channel is 127, so the quantizer's scale is Keras's); `check_integers`
  reads them back and the export refuses a file where they differ.
- int8 layers without activation quantization: the same weights, float
  activations (weight-only), as Keras computes them.
- Keras's other modes (int4 in groups with zero points, gptq, awq, float8):
  LiteRT has no kernel that computes them as Keras does (its 4-bit weights
  are symmetric), so they are written as their dequantized float32 kernels
  (exactly Keras's results; the file is float-sized), and a warning says
  so. ONNX and OpenVINO keep those weights 4-bit.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Mapping, Sequence

import keras
import numpy as np

from keras_selfattn import tracing
from keras_selfattn.attention.cache import ConverterCache
from keras_selfattn.export import quantization, quantized_kernels
from keras_selfattn.export.formats import litert_process, litert_signatures
from keras_selfattn.export.formats._base import (
    APART_BYTES,
    ExportError,
    Format,
    converting,
    weight_bytes,
)
from keras_selfattn.export.signature import Signature
from keras_selfattn_runtimes import table

logger = logging.getLogger(__name__)
# ai_edge_quantizer's recipe for models whose every quantized layer is int8,
# by whether Keras quantizes their activations.
RECIPES = {True: "dynamic_wi8_afp32", False: "weight_only_wi8_afp32"}
# The weights from which a file keeps them after the flatbuffer.
BUFFER_OFFSET_BYTES = APART_BYTES


def recipe_name(quantized: Sequence[quantized_kernels.QuantizedDense]) -> str | None:
    """The recipe that computes these layers as Keras does, or None."""
    if not quantized or any(q.mode != "int8" for q in quantized):
        return None
    activations = {q.activations is not None for q in quantized}
    return RECIPES[activations.pop()] if len(activations) == 1 else None


def quantize(path: str, name: str) -> None:
    """Quantizes the .tflite file at `path` in place with recipe `name`."""
    from ai_edge_quantizer import quantizer, recipe

    result = quantizer.Quantizer(path, getattr(recipe, name)()).quantize(
        enable_progress_bar=False, enable_progress_report=False
    )
    result.export_model(path, overwrite=True)


def check_shape(shape: object) -> tuple[int, int] | None:
    """Returns a fixed (batch, time) shape, or None (dynamic).

    Raises:
        ValueError: if it is not None or a pair of positive ints.
    """
    if shape is None:
        return None
    if not (
        isinstance(shape, tuple | list)
        and len(shape) == 2
        and all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape)
    ):
        raise ValueError(
            "`shape` must be None or a (batch, time) pair of positive ints. "
            f"Received: shape={shape!r}"
        )
    return (shape[0], shape[1])


def fixed_signature(target: Signature, shape: tuple[int, int]) -> list:
    """`target.input_signature()` with every dynamic dim set from `shape`."""
    batch, time = shape
    return [
        [
            keras.InputSpec(
                shape=tuple(
                    (batch if axis == 0 else time) if dim is None else dim
                    for axis, dim in enumerate(spec.shape)
                ),
                dtype=spec.dtype,
                name=spec.name,
            )
            for spec in target.inputs
        ]
    ]


def stored_integers(path: str) -> list[np.ndarray]:
    """The int8 constant matrices of a .tflite file, (out, in) as stored."""
    from ai_edge_litert.interpreter import Interpreter

    interpreter = Interpreter(model_path=path)
    found = []
    for detail in interpreter.get_tensor_details():
        if detail["dtype"] == np.int8 and len(detail["shape"]) == 2:
            try:
                found.append(np.array(interpreter.get_tensor(detail["index"])))
            except ValueError:  # not a constant
                continue
    return found


def check_integers(path: str, quantized) -> None:
    """Refuses a file whose int8 weights are not Keras's integers.

    Raises:
        ExportError: naming the first layer whose integers are missing.
    """
    stored = {w.tobytes() for w in stored_integers(path)}
    for layer in quantized:
        transposed = np.ascontiguousarray(layer.integers.T).tobytes()
        if transposed not in stored and layer.integers.tobytes() not in stored:
            raise ExportError(
                "LiteRT conversion did not keep Keras's int8 integers of layer "
                f"{layer.layer.name!r}; export ONNX or OpenVINO for this model"
            )


def _refuse_short_memory(function, *args) -> None:
    """Calls `function`; a conversion short of memory becomes one line.

    Raises:
        ExportError: naming the memory the converter needs or took and the
            formats that write these weights within less.
    """
    try:
        function(*args)
    except litert_process.OutOfMemory as error:
        raise ExportError(
            f"LiteRT conversion short of memory: {error}; export ONNX (its weights as "
            "external data) or a SavedModel, which need less"
        ) from error


# A LiteRT generator file past this size is checked on LiteRT's builtin
# kernels: XNNPACK, the interpreter's default, would pack its weights again
# for each of the file's four subgraphs that read them
# (`keras_selfattn_runtimes.litert`), 4.8 times a 2.1 GiB file resident.
XNNPACK_CHECK_MAX_BYTES = 2**30


def _past_xnnpack_check(path: str) -> bool:
    """Whether the file at `path` is checked on LiteRT's builtin kernels."""
    return os.path.getsize(path) > XNNPACK_CHECK_MAX_BYTES


class LiteRTFormat(Format):
    """LiteRT flatbuffers, checked with `ai_edge_litert`."""

    row = table.LITERT
    quantized_form = quantization.CONSTANTS
    advice = "export ONNX or OpenVINO instead"

    def check_options(
        self, options: Mapping[str, object], backend: str | None = None
    ) -> dict[str, object]:
        """`shape`: the fixed (batch, time), required on torch."""
        super().check_options(options)
        shape = check_shape(options.get("shape"))
        if shape is None and (backend or keras.backend.backend()) == "torch":
            raise ValueError(
                "LiteRT export on the torch backend has fixed input shapes "
                "(litert-torch): pass shape=(batch, time) (CLI: --litert-shape "
                "BATCH,TIME), or export under KERAS_BACKEND=tensorflow for dynamic "
                "shapes. Received: shape=None"
            )
        return {"shape": shape}

    def generator_runtime(
        self, path: str, options: Mapping[str, object]
    ) -> tuple[dict[str, object], str | None]:
        """A file past `XNNPACK_CHECK_MAX_BYTES` on LiteRT's builtin kernels."""
        if not _past_xnnpack_check(path):
            return dict(options), None
        size = os.path.getsize(path)
        return {**options, "xnnpack": False}, (
            f"{self.name} ran on LiteRT's builtin kernels, XNNPACK off: its "
            f"{size / 2**30:.1f} GiB file's weights would be packed again for "
            "each subgraph that reads them; one row a request: the builtin "
            "fully connected kernel keeps a packed copy of them for several"
        )

    def generator_rows(self, path: str) -> int | None:
        """One past `XNNPACK_CHECK_MAX_BYTES`: LiteRT's builtin fully
        connected kernel keeps a packed copy of the weights (ruy's cache)
        once a request has two rows; a 0.59 B Llama's generator resident
        2.29 GiB for one row, 4.55 GiB for two."""
        return 1 if _past_xnnpack_check(path) else None

    def expected_generator_rows(self, weights: int) -> int | None:
        """One for a file of `weights` bytes past `XNNPACK_CHECK_MAX_BYTES`
        (its float32 weights are most of it)."""
        return 1 if weights > XNNPACK_CHECK_MAX_BYTES else None

    def detail(self, options: Mapping[str, object]) -> str:
        """The fixed shape, if any."""
        shape = options.get("shape")
        return f" (fixed shape {shape[0]}x{shape[1]})" if shape else ""

    def write(
        self, target: Signature, path: str, options: Mapping[str, object]
    ) -> None:
        shape = options["shape"]
        # Extra targets are built before the conversion: a model they refuse
        # gets their own one-line ValueError, not a failed conversion.
        # A decoding step's cache write as XlaDynamicUpdateSlice, which the
        # converter takes.
        target = target.with_caches(ConverterCache)
        targets = (target,)
        if target.extra_signatures is not None:
            targets += target.extra_signatures()
        entries = [
            (
                each,
                each.input_signature()
                if shape is None
                else fixed_signature(each, shape),
            )
            for each in targets
        ]
        size = weight_bytes(target)
        large = size >= BUFFER_OFFSET_BYTES
        if large and len(entries) == 1:
            raise ValueError(
                f"LiteRT export of {size / 2**30:.2f} GiB of "
                "weights: a flatbuffer holds at most 2 GiB, and Keras's LiteRT "
                "export cannot write weights past it; quantize the model to "
                "int8 first, or export its generator (weights after the "
                "flatbuffer), ONNX (external data) or a SavedModel"
            )
        recipe = recipe_name(target.quantized)
        if target.quantized and recipe is None:
            modes = sorted({q.mode for q in target.quantized})
            logger.warning(
                "LiteRT: the %s layers are written with float32 weights (LiteRT "
                "has no kernel computing them as Keras does); ONNX and OpenVINO "
                "keep their integers",
                "/".join(modes),
            )
        # `chunk_size` is a memory option: the chunked path's loop would need
        # LiteRT's Flex delegate, so the file computes attention unchunked.
        with (
            converting(self.row.title, self.advice),
            target.traced(self.quantized_form),
            # Ops the converter takes (a decoding step's cache write as
            # XlaDynamicUpdateSlice, its dynamic_update_slice), and branches
            # (LiteRT's IF: a greedy step skips sampling's two sorts of the
            # vocabulary).
            tracing.traced_as(
                tracing.EXACT_UNCHUNKED,
                tracing.FOR_CONVERTER,
                tracing.CONVERTER_BRANCHES,
            ),
            warnings.catch_warnings(),
        ):
            warnings.simplefilter("ignore")
            if len(entries) > 1:
                _refuse_short_memory(
                    litert_signatures.convert, entries, path, size, large
                )
            else:
                target.keras_model().export(
                    path, format="litert", verbose=False, input_signature=entries[0][1]
                )
            if recipe is not None:
                quantize(path, recipe)
        if recipe is not None:
            check_integers(path, target.quantized)


FORMAT = LiteRTFormat()
