"""Keras ops as direct calls of the backend's own function, where a
decoding step runs them eagerly.

`keras.ops.reshape(x, shape)` first flattens its arguments (the tensor and
the shape's tuple) to look for symbolic tensors; on PyTorch that costs
far more than the reshape itself inside a decoding step.
`keras.ops.slice` converts its starts and sizes to tensors and slices by
them, as costly there (the mask's cut of the padding, once per layer and
step). On PyTorch Keras's ops are
`torch.reshape` and tensor slicing, so traced and exported graphs are the
same; TensorFlow and JAX compile their decoding loops and keep Keras's ops.
"""

from __future__ import annotations

import functools

import keras
import numpy as np
from keras import ops

_TORCH = keras.backend.backend() == "torch"
if _TORCH:
    import torch


def reshape(x, shape: tuple[int, ...]):
    """`keras.ops.reshape(x, shape)` (`shape` of Python ints)."""
    if _TORCH and isinstance(x, torch.Tensor):
        return torch.reshape(x, shape)
    return ops.reshape(x, shape)


def narrow(x, axis: int, start, length):
    """`x` from `start`, `length` long along `axis` (`keras.ops.slice` with
    every other axis whole); on PyTorch `torch.narrow` where both are
    sizes (Python or symbolic ints), not tensors."""
    if _TORCH and isinstance(x, torch.Tensor):
        sizes = (int, torch.SymInt)
        if isinstance(start, sizes) and isinstance(length, sizes):
            return torch.narrow(x, axis, start, length)
    starts = [0] * len(x.shape)
    sizes = list(ops.shape(x))
    starts[axis], sizes[axis] = start, length
    return ops.slice(x, starts, sizes)


def constant_for(array: np.ndarray, x):
    """`array` as a constant to combine with `x`: on PyTorch a tensor on
    x's device, made once per device (a decoding step would otherwise copy
    it from the host at every call); elsewhere the array itself."""
    if _TORCH and isinstance(x, torch.Tensor):
        return _torch_constant(array.tobytes(), array.dtype.str, array.shape, x.device)
    return array


if _TORCH:

    @functools.cache
    def _torch_constant(data: bytes, dtype: str, shape: tuple, device):
        array = np.frombuffer(data, dtype).reshape(shape).copy()
        return torch.as_tensor(array, device=device)


def reorder_last(x, order: np.ndarray):
    """`x` with its last axis's features in `order` (int indices):
    `keras.ops.take(x, order, axis=-1)`; on PyTorch `torch.index_select`,
    whose graph every PyTorch exporter converts (Keras's `take` traces an
    `aten::ravel`, which torch.onnx's TorchScript exporter does not)."""
    if _TORCH and isinstance(x, torch.Tensor):
        indices = constant_for(order.astype(np.int64), x)
        return torch.index_select(x, x.dim() - 1, indices)
    return ops.take(x, order, axis=-1)
