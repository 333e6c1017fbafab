"""Per-backend compiled forward and training-step callables (`benchmarks.backends`,
`benchmarks.decode`).

- JAX: `jax.jit` over `stateless_call` (forward) and `jax.value_and_grad` of
  the mean squared output (train step), compiled ahead of time; temporary
  memory is the compiled executable's `memory_analysis().temp_size_in_bytes`.
- PyTorch: eager; forward under `torch.no_grad()`, train step = forward +
  `loss.backward()`, each followed by `torch.cuda.synchronize()` on CUDA;
  temporary memory is `torch.cuda.max_memory_allocated()` over one call minus
  the allocation before it (CUDA only).
- TensorFlow: `tf.function` forward and `GradientTape` step; temporary memory
  is the GPU allocator's peak over one call (GPU only).

Each backend's framework is imported only when that backend is used, so
nothing imports TensorFlow unless KERAS_BACKEND is "tensorflow".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import keras
import numpy as np

FORWARD, TRAIN = "forward", "train"


@dataclass
class Prepared:
    """One layer ready to time.

    Attributes:
        calls: mode ("forward", "train") -> zero-argument callable running one
            synchronized call (the work is finished when it returns).
        output: the forward output as a float32 numpy array.
        memory: mode -> temporary bytes of one call; None when the backend
            cannot tell (PyTorch and TensorFlow on CPU).
    """

    calls: dict[str, Callable[[], object]]
    output: Callable[[], np.ndarray]
    memory: Callable[[str], int | None] = field(default=lambda mode: None)


def to_numpy(value) -> np.ndarray:
    """A backend tensor as a float32 numpy array."""
    return np.asarray(keras.ops.convert_to_numpy(keras.ops.cast(value, "float32")))


class _Stateless(keras.layers.Layer):
    """Calls a layer through its `__call__`, so `stateless_call` on this wrapper
    keeps mixed precision.

    `layer.stateless_call` runs `layer.call` directly, without the input cast
    and the variable autocast of `__call__`: under mixed_bfloat16 a layer
    whose `call` reads its own variables (SelfAttention) would compute in
    float32, while MultiHeadAttention's sublayers (called through `__call__`)
    compute in bfloat16. Through this wrapper both autocast as in a model.
    """

    def __init__(self, inner: keras.layers.Layer, apply: Callable, **kwargs):
        super().__init__(**kwargs)
        self.inner = inner
        self._apply = apply
        self.built = True

    def call(self, x, padding=None):
        return self._apply(self.inner, x, padding)


class JaxBackend:
    """`jax.jit` over `stateless_call` and `jax.value_and_grad`."""

    name = "jax"
    memory_kind = "XLA temp (memory_analysis)"

    def __init__(self):
        import jax

        self._jax = jax

    def version(self) -> str:
        return self._jax.__version__

    def device(self) -> str:
        device = self._jax.devices()[0]
        if device.platform == "cpu":
            return "cpu"
        return f"{device.platform}: {device.device_kind}"

    def is_gpu(self) -> bool:
        return self._jax.devices()[0].platform != "cpu"

    def prepare(self, layer, apply: Callable, x, mask, train: bool) -> Prepared:
        jax = self._jax
        jnp = jax.numpy
        wrapper = _Stateless(layer, apply)
        args = (
            [v.value for v in wrapper.trainable_variables],
            [v.value for v in wrapper.non_trainable_variables],
            jnp.asarray(x),
            None if mask is None else jnp.asarray(mask),
        )

        def forward(trainable, non_trainable, x, mask):
            return wrapper.stateless_call(trainable, non_trainable, x, mask)[0]

        def loss(trainable, non_trainable, x, mask):
            y = forward(trainable, non_trainable, x, mask)
            return jnp.mean(jnp.square(y.astype(jnp.float32)))

        functions = {FORWARD: forward}
        if train:
            functions[TRAIN] = jax.value_and_grad(loss)
        compiled = {
            mode: jax.jit(fn).lower(*args).compile() for mode, fn in functions.items()
        }
        calls = {
            mode: (lambda c=c: jax.block_until_ready(c(*args)))
            for mode, c in compiled.items()
        }
        return Prepared(
            calls=calls,
            output=lambda: to_numpy(calls[FORWARD]()),
            memory=lambda mode: _xla_temp_bytes(compiled[mode]),
        )

    def release(self) -> None:
        """Nothing to return: buffers are freed when their arrays are."""


def _xla_temp_bytes(compiled) -> int | None:
    analysis = compiled.memory_analysis()
    if analysis is None:
        return None
    return int(analysis.temp_size_in_bytes)


class TorchBackend:
    """Synchronized eager calls."""

    name = "torch"

    def __init__(self):
        import torch

        self._torch = torch
        self._cuda = torch.cuda.is_available()
        self.memory_kind = "CUDA max_memory_allocated" if self._cuda else None

    def version(self) -> str:
        return self._torch.__version__

    def device(self) -> str:
        if self._cuda:
            return f"cuda: {self._torch.cuda.get_device_name(0)}"
        return "cpu"

    def is_gpu(self) -> bool:
        return self._cuda

    def _sync(self) -> None:
        if self._cuda:
            self._torch.cuda.synchronize()

    def prepare(self, layer, apply: Callable, x, mask, train: bool) -> Prepared:
        torch = self._torch
        x = keras.ops.convert_to_tensor(x)
        if mask is not None:
            mask = keras.ops.convert_to_tensor(mask, dtype="bool")
        parameters = [v.value for v in layer.trainable_variables]

        def forward():
            with torch.no_grad():
                y = apply(layer, x, mask)
            self._sync()
            return y

        def step():
            y = apply(layer, x, mask)
            loss = torch.mean(torch.square(y.float()))
            loss.backward()
            self._sync()
            for parameter in parameters:
                parameter.grad = None
            return loss

        calls = {FORWARD: forward}
        if train:
            calls[TRAIN] = step
        return Prepared(
            calls=calls,
            output=lambda: to_numpy(forward()),
            memory=lambda mode: self._cuda_temp_bytes(calls[mode]),
        )

    def _cuda_temp_bytes(self, call: Callable[[], object]) -> int | None:
        if not self._cuda:
            return None
        cuda = self._torch.cuda
        cuda.synchronize()
        cuda.reset_peak_memory_stats()
        before = cuda.memory_allocated()
        call()
        return int(cuda.max_memory_allocated() - before)

    def release(self) -> None:
        """Returns cached CUDA blocks (after a row, or after out-of-memory)."""
        if self._cuda:
            self._torch.cuda.empty_cache()


class TensorFlowBackend:
    """`tf.function` forward and `GradientTape` step."""

    name = "tensorflow"

    def __init__(self):
        import tensorflow as tf

        self._tf = tf
        self._gpus = tf.config.list_physical_devices("GPU")
        self.memory_kind = "TF GPU allocator peak" if self._gpus else None

    def version(self) -> str:
        return self._tf.__version__

    def device(self) -> str:
        if not self._gpus:
            return "cpu"
        details = self._tf.config.experimental.get_device_details(self._gpus[0])
        return f"gpu: {details.get('device_name', self._gpus[0].name)}"

    def is_gpu(self) -> bool:
        return bool(self._gpus)

    def prepare(self, layer, apply: Callable, x, mask, train: bool) -> Prepared:
        tf = self._tf
        x = tf.constant(x)
        mask = None if mask is None else tf.constant(mask)

        def step(x, mask):
            with tf.GradientTape() as tape:
                y = apply(layer, x, mask)
                loss = tf.reduce_mean(tf.square(tf.cast(y, tf.float32)))
            return loss, tape.gradient(loss, layer.trainable_variables)

        functions = {FORWARD: lambda x, mask: apply(layer, x, mask)}
        if train:
            functions[TRAIN] = step
        traced = {
            mode: tf.function(fn, autograph=False) for mode, fn in functions.items()
        }

        def synchronized(fn):
            def call():
                result = fn(x, mask)
                tf.test.experimental.sync_devices()
                return result

            return call

        calls = {mode: synchronized(fn) for mode, fn in traced.items()}
        return Prepared(
            calls=calls,
            output=lambda: to_numpy(calls[FORWARD]()),
            memory=lambda mode: self._gpu_temp_bytes(calls[mode]),
        )

    def _gpu_temp_bytes(self, call: Callable[[], object]) -> int | None:
        if not self._gpus:
            return None
        experimental = self._tf.config.experimental
        experimental.reset_memory_stats("GPU:0")
        before = experimental.get_memory_info("GPU:0")["current"]
        call()
        return int(experimental.get_memory_info("GPU:0")["peak"] - before)

    def release(self) -> None:
        """Nothing to return: TensorFlow keeps its allocator's pool."""


def current() -> JaxBackend | TorchBackend | TensorFlowBackend:
    """The runner of Keras' current backend."""
    backends = {
        "jax": JaxBackend,
        "torch": TorchBackend,
        "tensorflow": TensorFlowBackend,
    }
    name = keras.backend.backend()
    if name not in backends:
        raise ValueError(f"No benchmark runner for the {name!r} backend")
    return backends[name]()


def out_of_memory(error: BaseException) -> bool:
    """Whether `error` is a device or host out-of-memory error of any backend."""
    text = f"{type(error).__name__}: {error}".lower()
    return any(
        marker in text
        for marker in ("out of memory", "outofmemory", "resource_exhausted")
    )
