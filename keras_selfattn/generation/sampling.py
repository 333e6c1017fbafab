"""Choosing the next token from logits: greedy, temperature, top-k, top-p.

One definition, in `keras.ops`, that `generate` runs on every backend and
the exported generators carry into their graphs (`tests/test_generation.py`
checks it against an independent numpy copy). With `uniform` the stream's
number for the sequence and step (`random_stream.uniform`):

- temperature 0: greedy, the first index of the largest logit;
- else z = logits / temperature; top-k keeps the logits at least the k-th
  largest (ties kept; k <= 0: all); top-p then keeps the most probable
  tokens whose probabilities, in descending order, start below p (the
  first always; p >= 1: all); the token is the first index whose
  cumulative probability (in vocabulary order, over the kept tokens)
  exceeds `uniform` times their total: inverse-CDF sampling, one uniform
  per token, so every runtime that computes the same probabilities picks
  the same token.
"""

from __future__ import annotations

from keras import ops

from keras_selfattn import tracing
from keras_selfattn.attention import nan_safe


def _keep(z, keep):
    """`z` where `keep`, else -inf (a select that stays one in ONNX)."""
    return nan_safe.where(keep, z, ops.full_like(z, float("-inf")))


def _first_index(found):
    """The first index along the last axis where `found` (bool) holds (an
    integer argmax: Keras's float argmax bit-casts to find -0.0, an op
    ONNX has not)."""
    return ops.cast(ops.argmax(ops.cast(found, "int32"), axis=-1), "int32")


def next_token(logits, uniform, temperature, top_k, top_p):
    """The next token of each row.

    Args:
        logits: `(batch, vocabulary)`, any float dtype (computed in float32).
        uniform: float32 `(batch,)` in [0, 1).
        temperature: float32 scalar >= 0 (0: greedy).
        top_k: int32 scalar (<= 0: no top-k filter).
        top_p: float32 scalar in (0, 1] (1: no top-p filter).

    Returns:
        int32 `(batch,)` token ids.
    """
    logits = ops.cast(logits, "float32")
    greedy = greedy_token(logits)
    sampling = ops.greater(temperature, 0.0)
    # A select where a branch cannot be taken: converters without branches,
    # and a recorded PyTorch step (`torch_steps`), whose fake tensors hold
    # no temperature to branch on.
    if tracing.torch_recorded() or (
        tracing.active(tracing.FOR_CONVERTER)
        and not tracing.active(tracing.CONVERTER_BRANCHES)
    ):
        positive = ops.where(sampling, temperature, 1.0)
        sampled = _sampled(logits, uniform, positive, top_k, top_p)
        return ops.where(sampling, sampled, greedy)
    # A branch: greedy steps skip the two sorts of the vocabulary that
    # sampling needs.
    return ops.cond(
        sampling,
        lambda: _sampled(logits, uniform, temperature, top_k, top_p),
        lambda: greedy,
    )


def greedy_token(logits):
    """int32 `(batch,)`: the first index of each row's largest logit."""
    logits = ops.cast(logits, "float32")
    return _first_index(ops.equal(logits, ops.max(logits, axis=-1, keepdims=True)))


def _sampled(logits, uniform, temperature, top_k, top_p):
    """`next_token` for a temperature > 0 (module docstring)."""
    vocabulary = ops.shape(logits)[-1]
    z = ops.divide(logits, temperature)
    ordered, _ = ops.top_k(z, vocabulary)  # descending
    k = ops.where(ops.greater(top_k, 0), ops.minimum(top_k, vocabulary), vocabulary)
    kth = ops.take(ordered, ops.expand_dims(ops.subtract(k, 1), 0), axis=-1)
    z = _keep(z, ops.greater_equal(z, kth))
    probabilities = ops.softmax(z, axis=-1)
    descending, _ = ops.top_k(probabilities, vocabulary)
    before = ops.subtract(ops.cumsum(descending, axis=-1), descending)
    kept = ops.less(before, top_p)
    smallest = ops.min(
        ops.where(kept, descending, ops.full_like(descending, 2.0)),
        axis=-1,
        keepdims=True,
    )
    probabilities = ops.softmax(
        _keep(z, ops.greater_equal(probabilities, smallest)), axis=-1
    )
    cumulative = ops.cumsum(probabilities, axis=-1)
    total = cumulative[:, -1:]
    threshold = ops.multiply(ops.expand_dims(uniform, -1), total)
    below = ops.sum(ops.cast(ops.less_equal(cumulative, threshold), "int32"), axis=-1)
    # A threshold rounded up to the total would pass every token: the last
    # one with a probability instead.
    # (Its index as a maximum, not by reversing the row: tf2onnx has no
    # ReverseV2 inside an If.)
    indices = ops.arange(vocabulary, dtype="int32")
    last = ops.max(ops.where(ops.greater(probabilities, 0.0), indices, -1), axis=-1)
    return ops.minimum(below, last)
