"""A quantized layer's stored values, read for exports: `QuantizedDense`.

`quantization.describe` reads one quantized layer's integers, scales and
zero points into a `QuantizedDense` (numpy), whose dequantized float
kernel, by Keras's own formula, is made only when something asks for it
(`dequantized`); the ONNX and OpenVINO passes find kernels or integers in
a converted graph by `value_key`. `stored_array`, `unpacked`,
`input_quantizer` and `grouped_layer` read a layer's stored variables for
`quantization` and `integer_layers`. A float model's export calls nothing
here.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib

import keras
import numpy as np
from keras import ops


@dataclasses.dataclass(frozen=True, eq=False)
class QuantizedDense:
    """One quantized `Dense` layer, as stored by Keras.

    Attributes:
        layer: The layer (a `ReversibleEmbedding` for its reverse projection:
            `integer_layers.describe_reverse`).
        mode: "int8", "int4", "float8", "gptq" or "awq".
        kernel: The dequantized float32 kernel `(in, out)`: what the float
            reference computes, by Keras's own formula. Per-channel "int8"
            and "int4" make it on first use (`dequantized`): an export
            that traces the stored integers (`in_graph`) never holds it.
        integers: The stored integers unpacked to `(in, out)`: int8 in
            [-127, 127] ("int8"), int8 in [-8, 7] ("int4"), uint8 codes with
            `zero` ("gptq", "awq", grouped "int4" as codes + 8); None for
            "float8".
        scale: "int8" and per-channel "int4": `(out,)`, kernel = integers /
            scale. Grouped modes: `(groups, out)`, kernel =
            (integers - zero) * scale.
        zero: The grouped modes' `(groups, out)` zero points, else None.
        group_size: Input rows per group (grouped modes), else None.
        bits: 8 or 4 (0 for "float8").
        input_divisor: "awq": `(in,)`, the kernel's rows are divided by it
            (x @ kernel = (x / input_divisor) @ dequantized codes).
        activations: How Keras quantizes this layer's inputs: the
            `AbsMaxQuantizer`'s (low, high, epsilon) for int8 per token
            symmetric, or None (float inputs).
        tensor: Per-channel "int8" and "int4": `kernel` as a tensor of the
            backend that described the layer, whose memory `kernel` shares
            on the CPU (`dequantized`), so that traced calls capture it
            without another copy; None otherwise.
        shape: The kernel's `(in, out)`, without making it.
    """

    layer: keras.layers.Dense
    mode: str
    # The kernel, where it is made at once (grouped modes, float8); None:
    # dequantized from `integers` and `scale` on first use.
    _kernel: np.ndarray | None
    integers: np.ndarray | None
    scale: np.ndarray | None
    zero: np.ndarray | None = None
    group_size: int | None = None
    bits: int = 8
    input_divisor: np.ndarray | None = None
    activations: tuple[float, float, float] | None = None

    @functools.cached_property
    def _dequantized(self) -> tuple[np.ndarray, object]:
        if self._kernel is not None:
            return self._kernel, None
        return dequantized(self.integers, self.scale)

    @property
    def kernel(self) -> np.ndarray:
        return self._dequantized[0]

    @property
    def tensor(self) -> object:
        return self._dequantized[1]

    @property
    def shape(self) -> tuple[int, ...]:
        source = self.integers if self._kernel is None else self._kernel
        return tuple(source.shape)


def stored_array(variable) -> np.ndarray:
    return np.asarray(keras.ops.convert_to_numpy(variable))


def dequantized(integers: np.ndarray, scale: np.ndarray) -> tuple[np.ndarray, object]:
    """Keras's per-channel dequantization, `integers / scale` in float32
    (columns divided by `scale`), computed once by the backend.

    Returns:
        The numpy kernel and the backend tensor. On TensorFlow and PyTorch's
        CPU the numpy kernel is a view of the tensor's memory (`np.asarray`),
        so a model's dequantized kernels are held once:
        `keras.ops.convert_to_numpy` copies on TensorFlow, and a tensor made
        from a numpy array holds twice its size there (measured: 2.0 GiB of
        RSS for a 1 GiB float32 array). A tensor on an accelerator is copied
        to the host. On JAX the division is numpy's: XLA divides by the
        broadcast scales as a product by their reciprocals, a float32 ulp
        off numpy's quotient in about a quarter of the elements (measured).
    """
    if keras.backend.backend() == "jax":
        kernel = integers.astype(np.float32) / scale
        return kernel, ops.convert_to_tensor(kernel)
    tensor = ops.divide(
        ops.cast(ops.convert_to_tensor(integers), "float32"),
        ops.convert_to_tensor(scale),
    )
    try:
        kernel = np.asarray(tensor)
    except TypeError:  # a torch tensor on a GPU
        kernel = stored_array(tensor)
    return kernel, tensor


def value_key(array: np.ndarray) -> tuple:
    """An array's dtype, shape and a digest of its bytes: the key an
    export's pass finds a kernel (or its stored integers) by in the
    converted graph (the kernel's own bytes as the key held a second copy
    of every kernel)."""
    array = np.ascontiguousarray(array)
    digest = hashlib.blake2b(memoryview(array).cast("B")).digest()
    return array.dtype.str, array.shape, digest


def unpacked(packed, length: int, axis: int, dtype: str) -> np.ndarray:
    """Keras's own `unpack_int4` of a stored kernel, as numpy."""
    from keras import quantizers

    return stored_array(quantizers.unpack_int4(packed, length, axis=axis, dtype=dtype))


def input_quantizer(layer) -> tuple[float, float, float] | None:
    quantizer = getattr(layer, "inputs_quantizer", None)
    if quantizer is None:
        return None
    low, high = quantizer.value_range
    return (float(low), float(high), float(quantizer.epsilon))


def grouped_layer(
    layer, values: np.ndarray, mode: str, bits: int, divisor=None, sz=None
):
    """A grouped layer from its (in, out) stored values and Keras's scales and
    zeros `sz` (default the layer's kernel ones: (out, groups) for gptq/awq,
    (groups, out) for int4).

    The codes are unsigned (MatMulNBits' and OpenVINO's u4/u8): int4's
    signed values and zero points are shifted by 8, which keeps
    `codes - zero`.
    """
    scale, zero = sz or (layer.kernel_scale, layer.kernel_zero)
    scale, zero = (stored_array(x).astype(np.float32) for x in (scale, zero))
    if mode in ("gptq", "awq"):  # stored (out, groups)
        scale, zero = scale.T, zero.T
    shift = 8 if mode == "int4" else 0
    groups = stored_array(layer.g_idx).astype(np.int64)
    kernel = (values.astype(np.float32) - zero[groups]) * scale[groups]
    if divisor is not None:
        kernel = kernel / divisor[:, None]
    # One group spans every input row; otherwise the first change of group.
    group_size = groups.size if scale.shape[0] == 1 else int(np.argmax(groups != 0))
    contiguous = group_size > 0 and np.array_equal(
        groups, np.arange(groups.size) // group_size
    )
    return QuantizedDense(
        layer,
        mode,
        kernel.astype(np.float32),
        (values.astype(np.int16) + shift).astype(np.uint8),
        scale,
        zero + shift,
        group_size if contiguous else None,
        bits,
        divisor,
    )
