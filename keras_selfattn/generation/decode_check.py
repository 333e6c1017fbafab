"""The check every decoding API makes before it returns a token or writes
a file: the cached decode of a probe equals the model's full forward pass.

A model decodes right only if every layer outside SelfAttention and the
position layers is position-wise, which cannot be read from code the
package does not own (a Conv1D over time, a position layer computing its
positions with `ops.arange`, a layer normalizing over time). So it is
measured: two probe rows of different lengths, left-padded as `generate`
runs them, go through the cached path (a prompt, then one position per
step) and each row alone through the full forward pass; their outputs at
every real position must agree. Where they differ, the layers' outputs are
recorded in both runs and the first layer (in the order calls end) whose
output differs is named in the refusal.

A model that passes is remembered (by object) for later calls. Callers
offer `check=False` as the explicit opt-out: within `waived()` no check
runs (nested calls included: an export's writer and checks).
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from collections.abc import Iterator, Sequence

import keras
import numpy as np

from keras_selfattn._model_layers import every_layer
from keras_selfattn.generation import cached_model, loop

# Probe rows' lengths: a full row and one left-padded by two slots; the
# last two positions are decoded one per step.
PROBE_LENGTH = 5
_SHORTER_BY = 2
_STEPS = 2
# |cached - full| <= RTOL * max|full| + ATOL; 16-bit compute dtypes round
# each layer's output to 8 or 11 bits.
RTOL = 1e-4
RTOL_16_BIT = 3e-2
# Layers that round their inputs to integers (Keras's int8 and int4 `Dense`
# and `EinsumDense`: per token, to 1/127 of the row's largest). Where the
# cached and full passes' float sums differ in the last bit, an input on a
# rounding boundary goes the other way, and that step runs on through the
# later layers: measured up to 1.8e-2 of max|full| (keras-hub Llamas, int8:
# 4 layers of 256 on PyTorch, 4 of 512 on JAX, 28 of 1024 on TensorFlow);
# a layer that mixes positions moves them by half their size or more
# (keras.io's `ops.arange` positions: 0.5 to 1.2, float or int8).
RTOL_INTEGER_INPUTS = 1e-1
ATOL = 1e-5

# The culprit where no layer's output could be compared.
_UNTOLD = "a layer outside SelfAttention"

_PASSED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_WAIVED = contextvars.ContextVar("keras_selfattn_decode_check_waived", default=False)


@contextlib.contextmanager
def waived(waive: bool = True) -> Iterator[None]:
    """Within this context (if `waive`), `check` checks nothing: the
    caller's explicit opt-out (`generate(check=False)`)."""
    token = _WAIVED.set(_WAIVED.get() or waive)
    try:
        yield
    finally:
        _WAIVED.reset(token)


REPLACEMENT = (
    "a position layer must take the decoded positions: keras_selfattn's "
    "PositionEmbedding or TokenAndPositionEmbedding (or keras-hub's) in place "
    "of one computing them with ops.arange"
)


def is_waived() -> bool:
    """Whether calls made now are within `waived()`."""
    return _WAIVED.get()


def check(
    reading: cached_model.Reading,
    probe: np.ndarray,
    action: str,
) -> None:
    """Refuses the model of `reading` (ValueError, one line) if its cached
    decode of `probe` differs from its full forward pass (module docstring).

    Args:
        reading: The model read for this decoding call (`cached_model.read`).
        probe: `(2, PROBE_LENGTH, ...)` inputs, no padding.
        action: How the refusal names what was asked ("generate with").
    """
    model, layers = reading.model, reading.layers
    if _WAIVED.get() or model in _PASSED:
        return
    prompts, lengths = _prompts(probe)
    cached = _cached_run(model, layers, prompts, lengths)
    full = [_call(model, prompts[row : row + 1, :n]) for row, n in enumerate(lengths)]
    error = _error(_aligned(cached, lengths), full)
    rtol = _rtol(reading)
    if error > _tolerance(rtol, full):
        culprit = _culprit(model, layers, prompts, lengths, rtol)
        raise cached_model.refusal(
            model,
            f"its cached decode differs from its full forward pass by {error:.3g}: "
            f"{culprit} mixes positions (position t's output must depend on "
            f"earlier positions only through SelfAttention; {REPLACEMENT})",
            action,
        )
    _PASSED[model] = True


def _prompts(probe: np.ndarray) -> tuple[np.ndarray, list[int]]:
    lengths = [probe.shape[1], probe.shape[1] - _SHORTER_BY]
    prompts = probe.copy()
    prompts[1, lengths[1] :] = 0
    return prompts, lengths


def _call(model, inputs):
    return keras.ops.convert_to_numpy(keras.tree.flatten(model(inputs))[0])


def _cached_run(model, layers, prompts, lengths) -> np.ndarray:
    """The cached outputs `(2, width, ...)`: the left-aligned prompt, then
    the last `_STEPS` slots one per step, as the generation loop runs."""
    width = prompts.shape[1]
    lengths = np.asarray(lengths, np.int32)
    moved, valid = loop.left_aligned(prompts, lengths)
    starts = width - lengths
    caches = [layer.empty_cache(len(lengths), width) for layer in layers]
    outputs, index = [], 0
    for new in (width - _STEPS, *([1] * _STEPS)):
        output, caches = cached_model.run_cached(
            model,
            layers,
            moved[:, index : index + new],
            caches,
            index,
            valid,
            starts,
        )
        outputs.append(keras.ops.convert_to_numpy(output))
        index += new
    return np.concatenate(outputs, axis=1)


def _aligned(cached: np.ndarray, lengths) -> list[np.ndarray]:
    width = cached.shape[1]
    return [cached[row : row + 1, width - n :] for row, n in enumerate(lengths)]


def _error(cached: Sequence[np.ndarray], full: Sequence[np.ndarray]) -> float:
    return max(
        float(np.max(np.abs(c.astype("float64") - f.astype("float64"))))
        for c, f in zip(cached, full, strict=True)
    )


def _rtol(reading: cached_model.Reading) -> float:
    """The relative tolerance of the model's arithmetic (the rules above)."""
    if reading.quantizes_inputs:
        return RTOL_INTEGER_INPUTS
    if reading.compute_dtypes & {"float16", "bfloat16"}:
        return RTOL_16_BIT
    return RTOL


def _tolerance(rtol: float, full: Sequence[np.ndarray]) -> float:
    scale = max(float(np.max(np.abs(f))) for f in full)
    return rtol * scale + ATOL


def _own_copy(model, layers, prompts):
    """A copy of `model` the check owns (`keras.models.clone_model`, then
    the weights) with its layers in `every_layer` order paired with the
    model's, and the copies of `layers`; None where the model does not
    rebuild from its config."""
    try:
        copy = keras.models.clone_model(model)
        if not copy.built:
            copy(prompts[:1, :1])
        copy.set_weights(model.get_weights())
    except Exception:  # the user's classes' own code: any error
        return None
    originals, copies = every_layer(model), every_layer(copy)
    if [type(a) for a in originals] != [type(b) for b in copies]:
        return None
    position = {id(layer): index for index, layer in enumerate(originals)}
    own_layers = [copies[position[id(layer)]] for layer in layers]
    return copy, dict(zip(map(id, copies), originals, strict=True)), own_layers


@contextlib.contextmanager
def _recording(copy) -> Iterator[dict]:
    """Records every layer's first output, in the order calls end:
    {"order": [layer, ...], id(layer): [outputs]}. `copy` is the check's
    own copy of the model (`_own_copy`): its layers' `call` is wrapped
    meanwhile, never a user's layer's."""
    records: dict = {"order": []}

    def recorder(layer, original):
        def recorded(*args, **kwargs):
            output = original(*args, **kwargs)
            if id(layer) not in records:
                records["order"].append(layer)
                records[id(layer)] = []
            records[id(layer)].append(keras.tree.flatten(output)[0])
            return output

        return recorded

    wrapped = [(layer, vars(layer).get("call")) for layer in every_layer(copy)[1:]]
    for layer, _ in wrapped:
        object.__setattr__(layer, "call", recorder(layer, layer.call))
    try:
        yield records
    finally:
        for layer, own in wrapped:
            if own is None:
                object.__delattr__(layer, "call")
            else:
                object.__setattr__(layer, "call", own)


def _culprit(model, layers, prompts, lengths, rtol: float) -> str:
    """Names the first layer whose output differs between the cached run
    and the full runs (module docstring), recorded on a copy of the model,
    or says none could be told."""
    owned = _own_copy(model, layers, prompts)
    if owned is None:
        return _UNTOLD
    model, originals, layers = owned
    with _recording(model) as cached:
        _cached_run(model, layers, prompts, lengths)
    full = []
    for row, n in enumerate(lengths):
        with _recording(model) as records:
            _call(model, prompts[row : row + 1, :n])
        full.append(records)
    for layer in full[0]["order"]:
        outputs = cached.get(id(layer))
        once = all(len(f.get(id(layer), ())) == 1 for f in full)
        if not once or len(outputs or ()) != 1 + _STEPS:
            continue  # called more than once a pass: not comparable
        try:
            pieces = [keras.ops.convert_to_numpy(o) for o in outputs]
            joined = np.concatenate(pieces, axis=1)
            mine = _aligned(joined, lengths)
            theirs = [keras.ops.convert_to_numpy(f[id(layer)][0]) for f in full]
            error = _error(mine, theirs)
        except (ValueError, TypeError, IndexError):
            continue  # not a (batch, time, ...) output
        if error > _tolerance(rtol, theirs):
            layer = originals[id(layer)]
            return f"layer {layer.name!r} ({type(layer).__name__})"
    return _UNTOLD
