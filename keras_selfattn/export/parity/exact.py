"""The float64 second reference of a float model's check (`rules.float64_judged`).

Where an artifact is beyond the float tolerance, `verify` asks how far
Keras's own float32 output is from exact: the same Keras model, its layers
computing in float64 (`precision.float64_view`, same weights, the float32
inputs widened exactly), run on the model's backend, never by the runtime
under test. It is computed only for the runs beyond the tolerance, so a
passing export pays nothing (about 0.6 s for a small classifier's four
runs when one fails).

It is not exact everywhere: SelfAttention computes its softmax (the
explicit path: TensorFlow, JAX) and its rotary rotation in float32 by
design (`attention.explicit`, `attention.rotary`), so the reference keeps
those roundings. Against the numpy float64 reference, on a SelfAttention
with scores of tens, its root mean square error is 0.13x Keras's float32
one without rotary and 0.36x (TensorFlow) to 0.64x (JAX) with it;
PyTorch's fused kernel keeps float64 (0.00x, 0.07x with rotary).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping, Sequence

import keras
import numpy as np

from keras_selfattn.export import precision
from keras_selfattn.export.formats import one_line
from keras_selfattn.export.forward.graph import (
    Endpoint,
    build_endpoint,
    keras_reference,
)


@contextlib.contextmanager
def _float64_arithmetic() -> Iterator[None]:
    """Keras ops computing float64 on the backend, within this block.

    TensorFlow does. On JAX and PyTorch, Keras's type promotion narrows a
    float64 result to float32, as JAX does by default (its
    `BIT64_TO_BIT32_DTYPE`: a float64 Dense computes a float32 matmul), and
    JAX computes float64 only within `jax.enable_x64`; both are lifted here
    and restored after. Only float64 results change meanwhile.
    """
    backend = keras.backend.backend()
    if backend == "tensorflow":
        yield
        return
    from keras_selfattn._keras_private import dtypes_module

    dtypes = dtypes_module()
    narrowing = dtypes.BIT64_TO_BIT32_DTYPE
    dtypes.BIT64_TO_BIT32_DTYPE = {
        wide: narrow for wide, narrow in narrowing.items() if wide != "float64"
    }
    try:
        if backend == "jax":
            import jax

            with jax.enable_x64(True):
                yield
        else:
            yield
    finally:
        dtypes.BIT64_TO_BIT32_DTYPE = narrowing


@dataclasses.dataclass
class Float64Reference:
    """A float model's outputs in float64, per run, computed on demand.

    Attributes:
        endpoint: The checked endpoint (its `source` is the model computed).
        attention_outputs: As given to the check (attention weights are
            outputs too).
        inputs: Each run's inputs, keyed by input name.
        unavailable: Why the reference could not be computed (a layer that
            cannot be cloned or has no float64 kernel), once it failed;
            the rows then keep the float tolerance's verdict.
    """

    endpoint: Endpoint
    attention_outputs: str | Mapping[str, str] | None
    inputs: Sequence[Mapping[str, np.ndarray]]
    unavailable: str | None = None

    def __call__(self, runs: Sequence[int]) -> dict[int, list[dict[str, np.ndarray]]]:
        """{run index: [{output name: float64 output}]} (a run's one step) for
        `runs`; {} when the reference is unavailable (`unavailable` then
        says why)."""
        try:
            with _float64_arithmetic():
                view = precision.float64_view(self.endpoint.source)
                twin = build_endpoint(view, self.attention_outputs)
                return {
                    run: [
                        {
                            name: np.asarray(value, np.float64)
                            for name, value in keras_reference(
                                twin, self.inputs[run]
                            ).items()
                        }
                    ]
                    for run in runs
                }
        except Exception as error:  # the float tolerance's verdict stands
            self.unavailable = one_line(error)
            return {}

    def note(self) -> tuple[str, ...]:
        """The report's line when the reference was unavailable."""
        if self.unavailable is None:
            return ()
        return (f"rows beyond the tolerance, no float64 reference: {self.unavailable}",)
