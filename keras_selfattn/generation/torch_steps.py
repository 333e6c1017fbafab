"""`generate`'s steps on PyTorch: recorded once, then replayed.

Eager PyTorch runs Keras's per-call Python work on every step: about 110
layer calls a step on a 12-layer keras-hub Llama, as much time as its
matmuls at batch 1. The loop instead records its step once as a graph of
PyTorch's ops (`make_fx` over fake tensors, within
`tracing.torch_recording()`), with the weights, the request's tensors and
the loop's variables as the graph's arguments (other tensors the model
holds, constants of its Functional graph, are the graph's constants), and
replays that graph on every step: the same ops on the same tensors,
without the layers' Python. The caches are `TorchRecordedCache`s, written
in place at a tensor index.

A recording is kept for the shapes and dtypes it was made with (batch,
prompt width, cache length; the weights' too, so a model quantized since
records anew) and replays nothing else. A step that cannot be recorded (a
layer that reads a tensor's value in Python, which fake tensors refuse, or
one that assigns a variable, which a replay would not) runs eagerly as
before, and `generate` warns once for that model, naming the cause.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable

import keras

from keras_selfattn import tracing

# Models whose step could not be recorded, warned about once each.
_WARNED: weakref.WeakSet = weakref.WeakSet()


def _signature(arrays) -> tuple:
    """What a recording depends on besides Python facts: each array's shape
    and dtype."""
    return tuple((tuple(a.shape), a.dtype) for a in arrays)


class Steps:
    """The recorded steps of one compiled loop (`compiled._torch`), each
    for the shapes it was recorded with.

    Args:
        model: The model the loop runs (`arguments.Model.model`).
    """

    def __init__(self, model: keras.Model):
        self._model = model
        self._recorded: dict[tuple, Callable | None] = {}

    def body(self, generation, loop_vars: tuple) -> Callable:
        """The loop's body for `generation` (`loop._Generation`, its steps'
        caches `TorchRecordedCache`s): its `step`, replayed from a recording
        made now on `loop_vars` (the first step's) or kept from an earlier
        call with the same shapes; or the step itself where it cannot be
        recorded."""
        request = generation.request_tensors()
        names = tuple(request)
        variables = self._model.variables
        weights = [v.value for v in variables]
        key = (
            generation.width,
            names,
            _signature(weights),
            _signature(request.values()),
            _signature(loop_vars),
        )
        arguments = (weights, list(request.values()))
        if key not in self._recorded:
            self._recorded[key] = self._record(
                generation, variables, names, arguments, loop_vars
            )
        graph = self._recorded[key]
        if graph is None:
            return generation.step
        return lambda *loop_vars: graph(*arguments, *loop_vars)

    def _record(self, generation, variables, names, arguments, loop_vars):
        from torch.fx.experimental.proxy_tensor import make_fx

        def step(weights, request, *loop_vars):
            given = generation.with_request(dict(zip(names, request, strict=True)))
            mapping = list(zip(variables, weights, strict=True))
            with keras.StatelessScope(state_mapping=mapping) as scope:
                before = dict(scope.state_mapping)
                outputs = given.step(*loop_vars)
            # A replayed graph would drop what a step assigns (a counter, a
            # random state): such a step runs eagerly.
            assigned = [
                v.path
                for v in variables
                if scope.state_mapping.get(id(v)) is not before.get(id(v))
            ]
            if assigned:
                raise ValueError(f"its step assigns variables {assigned}")
            return outputs

        try:
            with tracing.torch_recording():
                # Tensors other than the arguments (constants of a Functional
                # graph, such as Gemma's embedding scale) are the graph's.
                recorder = make_fx(
                    step, tracing_mode="fake", _allow_non_fake_inputs=True
                )
                return recorder(*arguments, *loop_vars)
        except Exception as error:  # the model's own code: any error
            if self._model not in _WARNED:
                _WARNED.add(self._model)
                cause = str(error).strip().splitlines()
                warnings.warn(
                    f"generate runs model {self._model.name!r}'s steps eagerly "
                    "on PyTorch: its step could not be recorded as a graph "
                    f"({type(error).__name__}: {cause[0] if cause else ''}). "
                    "Its tokens are the same; each step runs Keras's layers.",
                    stacklevel=2,
                )
            return None
