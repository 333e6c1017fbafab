"""Tokens of a quantized model's generator where Keras's logits nearly tie.

Keras's int8 and int4 layers round their inputs to integers per token
(`Reading.quantizes_inputs`). Two computations of the same model, Keras's
and a runtime's, differ in the last bits of their float sums; an input on
a rounding boundary then goes to the other integer, and the logits move by
up to a few hundredths of their largest (`decode_check.RTOL_INTEGER_INPUTS`
gives the measurements). Where two tokens' logits are closer than that,
the runtime may choose the other one, and from there on generates another
sequence, as Keras's own cached and uncached passes may.

An ONNX generator written with `int4_inputs="int8"` rounds the inputs of
Keras's 4-bit layers, which Keras multiplies as floats, to int8 in blocks
(the artifact's description says `rounds_inputs`): finer rounding than a
token's, and its tokens are judged the same way.

So a generator of such a model whose tokens are not Keras's is judged on
its own tokens, teacher-forced: each row's prompt and generated tokens go
once through the model's full forward pass, and at each step where the
runtime's token is not the one Keras's sampler (`sampling.next_token`, with
the step's uniform) chooses from those logits, it must be one the sampler
chooses from them moved by at most `BAND` times their largest magnitude,
each (toward the runtime's token): greedy, their largest then; sampled,
one the sampler keeps (temperature, top-k, top-p) and so chooses for some
uniform. The step's own uniform is not compared there: a token entering or
leaving the kept set moves every later token's share of the cumulative
sum. A row must also end where its end token is and hold nothing after
it. A token any further from Keras's choice is a difference, as before.
"""

from __future__ import annotations

import numpy as np
from keras import ops

from keras_selfattn.generation import decode_check, loop, random_stream, sampling

# How far each logit may move (times the step's largest |logit|): two
# logits may come closer by the decode check's tolerance.
BAND = decode_check.RTOL_INTEGER_INPUTS / 2


def _pick(logits: np.ndarray, uniform: float, controls: dict) -> int:
    chosen = sampling.next_token(
        ops.convert_to_tensor(logits[None], "float32"),
        ops.convert_to_tensor([uniform], "float32"),
        ops.convert_to_tensor(controls["temperature"], "float32"),
        ops.convert_to_tensor(controls["top_k"], "int32"),
        ops.convert_to_tensor(controls["top_p"], "float32"),
    )
    return int(ops.convert_to_numpy(chosen)[0])


def _favoured(logits: np.ndarray, token: int, band: float) -> np.ndarray:
    """Logits within `band` of `logits`, as far as they go toward `token`:
    it raised, the others lowered."""
    return np.where(np.arange(logits.size) == token, logits + band, logits - band)


def _choosable(logits: np.ndarray, token: int, controls: dict) -> bool:
    """Whether the sampler chooses `token` from `logits` for some uniform:
    its choice grows with the uniform (inverse-CDF sampling in vocabulary
    order), so the smallest uniform choosing `token` or later is bisected."""
    if controls["temperature"] <= 0:  # greedy: no uniform
        return _pick(logits, 0.0, controls) == token
    low, high = 0.0, 1.0 - 2.0**-24
    if not _pick(logits, low, controls) <= token <= _pick(logits, high, controls):
        return False
    for _ in range(24):
        middle = (low + high) / 2
        if _pick(logits, middle, controls) < token:
            low = middle
        else:
            high = middle
    return _pick(logits, high, controls) == token


def _row_ties(
    model, prompt, tokens, length: int, controls: dict, row: int
) -> int | None:
    """The tokens of one row chosen at a near tie of Keras's logits.

    Args:
        model: The generator's model (`Reading.model`).
        prompt: The row's prompt ids, right-padded; `length` of them real.
        tokens: The row's generated slots from the runtime (-1 unfilled).
        length: The prompt's length.
        controls: The request's "temperature", "top_k", "top_p", "seed" and
            "end_token".
        row: The row's index in its batch (its uniforms).

    Returns:
        How many, or None if a token is not Keras's within `BAND`, or the
        row does not end where its end token is.
    """
    tokens = [int(t) for t in tokens]
    filled = tokens.index(loop.NOT_GENERATED) if loop.NOT_GENERATED in tokens else None
    generated = tokens[:filled]
    if any(t != loop.NOT_GENERATED for t in tokens[len(generated) :]):
        return None
    end = int(controls["end_token"])
    ends = [i for i, t in enumerate(generated) if end >= 0 and t == end]
    if (ends and ends[0] != len(generated) - 1) or (filled is not None and not ends):
        return None
    ids = np.asarray([[*prompt[:length], *generated[:-1]]], np.int32)
    logits = ops.convert_to_numpy(ops.cast(model(ids), "float32"))[0, length - 1 :]
    uniforms = ops.convert_to_numpy(
        random_stream.uniforms(
            int(controls["seed"]),
            np.asarray([row], np.int32),
            np.arange(len(generated), dtype=np.int32),
        )
    )[0]
    ties = 0
    for step, token in enumerate(generated):
        here, uniform = logits[step].astype(np.float64), float(uniforms[step])
        if _pick(here, uniform, controls) == token:
            continue
        moved = _favoured(here, token, BAND * float(np.max(np.abs(here))))
        if not _choosable(moved, token, controls):
            return None
        ties += 1
    return ties


def ties(
    model,
    request: dict,
    prompt_name: str,
    tokens: np.ndarray,
    lengths: np.ndarray,
    reference: tuple[np.ndarray, np.ndarray] | None = None,
) -> int | None:
    """`_row_ties` summed over a request's rows, whose `lengths` (the
    runtime's) must count their tokens; None if a row fails. A row equal to
    `reference`'s (Keras's generated tokens and lengths: Keras's own
    choices) is not replayed and has no tie."""
    prompts, widths = request[prompt_name], request["prompt_lengths"]
    tokens, lengths = np.asarray(tokens), np.asarray(lengths)
    if tokens.ndim != 2 or len(tokens) != len(prompts) or lengths.shape != widths.shape:
        return None
    vocabulary = int(model.outputs[0].shape[-1])
    if np.any((tokens < loop.NOT_GENERATED) | (tokens >= vocabulary)):
        return None
    controls = {
        name: np.asarray(request[name]).item()
        for name in ("temperature", "top_k", "top_p", "seed", "end_token")
    }
    total = 0
    for row, (prompt, width) in enumerate(zip(prompts, widths, strict=True)):
        if reference is not None and _same_row(reference, tokens, lengths, row):
            continue
        found = _row_ties(model, prompt, tokens[row], int(width), controls, row)
        counted = int(np.sum(np.asarray(tokens[row]) != loop.NOT_GENERATED))
        if found is None or int(lengths[row]) != counted:
            return None
        total += found
    return total


def _same_row(reference, tokens: np.ndarray, lengths: np.ndarray, row: int) -> bool:
    """Whether row `row` of `tokens` and `lengths` is `reference`'s."""
    wanted, counts = (np.asarray(array) for array in reference)
    return (
        wanted.shape == tokens.shape
        and counts.shape == lengths.shape
        and bool(np.array_equal(wanted[row], tokens[row]))
        and int(counts[row]) == int(lengths[row])
    )
