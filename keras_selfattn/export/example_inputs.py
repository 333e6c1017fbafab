"""Deterministic example inputs for a `Signature` (checks and warmup)."""

from __future__ import annotations

import keras
import numpy as np

from keras_selfattn._model_layers import every_layer
from keras_selfattn.export.signature import Signature

# Token range when no Embedding layer tells the vocabulary size.
_FALLBACK_VOCAB = 10


def vocabulary_size(model: keras.Model) -> int:
    """The smallest `input_dim` of the model's Embedding layers (nested too)."""
    sizes = [
        layer.input_dim
        for layer in every_layer(model)
        if isinstance(layer, keras.layers.Embedding)
    ]
    return min(sizes) if sizes else _FALLBACK_VOCAB


def is_padded(target: Signature, batch: int, time: int) -> bool:
    """Whether `example_inputs` pads rows for this shape (see there)."""
    discrete = any(
        spec.dtype == "bool" or "int" in spec.dtype for spec in target.inputs
    )
    return discrete and batch > 1 and time > 1


def example_inputs(
    target: Signature, batch: int, time: int, seed: int = 0
) -> dict[str, np.ndarray]:
    """Random inputs keyed by input name; every dynamic dim after batch is `time`
    (or the target's own `examples`).

    Float inputs are standard normal. Integer inputs are token ids in
    [1, vocabulary) and boolean inputs are True; in both, rows after the first
    end with padding (0 / False) from a random length in [1, time] on, the
    first row staying full length.

    Args:
        target: The export target whose inputs to build.
        batch: Batch size.
        time: Size of every dynamic dimension after the batch.
        seed: Seed of the random generator.

    Returns:
        A dict {input name: numpy array}.
    """
    if target.examples is not None:
        return target.examples(batch, time, seed)
    rng = np.random.default_rng(seed)
    vocab = vocabulary_size(target.model)
    lengths = np.concatenate([[time], rng.integers(1, time + 1, size=batch - 1)])
    result = {}
    for spec in target.inputs:
        shape = (batch,) + tuple(time if d is None else d for d in spec.shape[1:])
        if spec.dtype == "bool":
            values = np.ones(shape, dtype=bool)
        elif "int" in spec.dtype:
            values = rng.integers(1, max(vocab, 2), size=shape)
        else:
            values = rng.standard_normal(shape)
        if values.dtype.kind in "bi" and len(shape) > 1:
            padding = np.arange(shape[1])[None, :] >= lengths[:, None]
            padding = padding.reshape(padding.shape + (1,) * (len(shape) - 2))
            values[np.broadcast_to(padding, shape)] = 0
        result[spec.name] = values.astype(spec.dtype)
    return result
