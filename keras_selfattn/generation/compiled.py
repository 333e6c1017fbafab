"""The generation loop compiled for the model's backend.

TensorFlow: a `tf.function` (one trace per prompt shape and output size),
compiled by XLA unless `jit_compile` is False; JAX: `jax.jit` over the
model's variable values (a `StatelessScope` maps them in, so the weights
are arguments, not constants baked into the compiled program), or traced
op by op when `jit_compile` is False; PyTorch: a Python loop under
`torch.no_grad` whose step is recorded once as a graph of PyTorch's ops
and replayed (`torch_steps`), or run through Keras's layers when
`jit_compile` is False. Compiled functions are kept per model, except
those compiled within `not_kept`.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator

import keras
import numpy as np

from keras_selfattn.attention import cache as cache_lib
from keras_selfattn.generation import loop, torch_steps
from keras_selfattn.generation.arguments import Model, Request

_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# How TensorFlow says XLA cannot compile an op of the function.
_XLA_REFUSED = "Detected unsupported operations when trying to compile"


def _arguments(request: Request) -> tuple:
    c = request.controls
    return (
        request.prompts,
        request.lengths,
        np.int32(request.max_new_tokens),
        np.float32(c.temperature),
        np.int32(c.top_k),
        np.float32(c.top_p),
        np.int32(c.seed),
        np.int32(c.end_token),
    )


def _loop_function(
    read: Model, max_length: int, capacity: int, greedy: bool, **options
):
    """The loop as a function of the request's arrays (`greedy`: for
    requests at temperature 0 only, `loop.run`'s; `options`: more of
    `loop.run`'s arguments)."""

    def generate(prompts, lengths, steps, temperature, top_k, top_p, seed, end):
        controls = loop.Controls(temperature, top_k, top_p, seed, end)
        return loop.run(
            read.model,
            read.layers,
            prompts,
            lengths,
            max_length=max_length,
            capacity=capacity,
            steps=steps,
            controls=controls,
            tokens=read.tokens,
            greedy=greedy,
            **options,
        )

    return generate


def _tensorflow(read: Model, max_length: int, capacity: int, greedy: bool, xla: bool):
    import tensorflow as tf

    function = tf.function(
        _loop_function(read, max_length, capacity, greedy), jit_compile=xla
    )
    if not xla:
        return function

    def run(*arrays):
        try:
            return function(*arrays)
        except tf.errors.InvalidArgumentError as error:
            if _XLA_REFUSED not in str(error):
                raise
            # The message holds _XLA_REFUSED: its first line names the ops.
            first_line = error.message.strip().splitlines()[0]
            raise ValueError(
                f"XLA cannot compile this model's generation loop: {first_line} "
                "Pass `jit_compile=False` to run it as a tf.function without XLA."
            ) from error

    return run


def _jax(read: Model, max_length: int, capacity: int, greedy: bool, xla: bool):
    import jax

    variables = read.model.variables
    generate = _loop_function(read, max_length, capacity, greedy)
    if not xla:
        return generate

    @jax.jit
    def stateless(values, *arrays):
        with keras.StatelessScope(
            state_mapping=list(zip(variables, values, strict=True))
        ):
            return generate(*arrays)

    return lambda *arrays: stateless([v.value for v in variables], *arrays)


def _torch(read: Model, max_length: int, capacity: int, greedy: bool, jit: bool):
    import torch

    options = {}
    if jit:
        options = dict(
            caches=loop.CacheClasses(steps=cache_lib.TorchRecordedCache),
            body=torch_steps.Steps(read.model).body,
        )
    generate = _loop_function(read, max_length, capacity, greedy, **options)

    def run(*arrays):
        with torch.no_grad():
            return generate(*[keras.ops.convert_to_tensor(a) for a in arrays])

    return run


_BUILDERS = {"tensorflow": _tensorflow, "jax": _jax, "torch": _torch}


def jit(jit_compile: bool | str) -> bool:
    """Whether `generate(jit_compile=...)` compiles the loop on this backend
    ("auto" and True do; on PyTorch compiling records the step once and
    replays it, `torch_steps`); raises ValueError naming a bad value."""
    backend = keras.backend.backend()
    if backend not in _BUILDERS:
        raise ValueError(
            f"generate runs on the TensorFlow, JAX and PyTorch backends. "
            f"Received: KERAS_BACKEND={backend!r}"
        )
    if isinstance(jit_compile, str) and jit_compile == "auto":
        return True
    if not isinstance(jit_compile, bool):
        raise ValueError(
            '`jit_compile` must be "auto", True or False. '
            f"Received: jit_compile={jit_compile!r}"
        )
    return jit_compile


def run(
    read: Model, request: Request, jit: bool, greedy_loop: bool = True
) -> tuple[np.ndarray, np.ndarray]:
    """Runs `request` on `read`'s model, compiled when `jit` (as `jit()`
    resolves it); returns numpy (generated, lengths), generated cut to
    `request.max_new_tokens` columns. A greedy request runs the loop traced
    for greedy requests alone (`loop.run`'s `greedy`) unless `greedy_loop`
    is False: then the loop that samples, which at temperature 0 chooses the
    same tokens (a caller running greedy and sampled requests then traces
    one loop)."""
    backend = keras.backend.backend()
    key = (
        request.max_length,
        request.max_new_tokens,
        greedy_loop and request.controls.temperature == 0,
        jit,
    )
    functions = _COMPILED.setdefault(read.model, {})
    if key not in functions:
        functions[key] = _BUILDERS[backend](read, *key)
    generated, lengths = functions[key](*_arguments(request))
    generated = keras.ops.convert_to_numpy(generated)
    return generated[:, : request.max_new_tokens], keras.ops.convert_to_numpy(lengths)


@contextlib.contextmanager
def not_kept(model: keras.Model) -> Iterator[None]:
    """Within the context, `run` compiles and runs as ever; the functions it
    compiled for `model` meanwhile are dropped after it (an export's check
    computes its reference once: its traced loops would stay for the
    model's life)."""
    before = set(_COMPILED.get(model, ()))
    try:
        yield
    finally:
        functions = _COMPILED.get(model, {})
        for key in set(functions) - before:
            del functions[key]
