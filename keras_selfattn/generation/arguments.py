"""The checked arguments of one generation, and their ValueErrors.

`generate` and the exported generators take the same arguments; each bad
value is refused here by name, before any work (the exported graphs check
the same rules themselves: `export.generator`).
"""

from __future__ import annotations

import dataclasses
import math
from numbers import Integral, Real

import keras
import numpy as np

from keras_selfattn import _checks
from keras_selfattn.generation import cached_model, decode_check
from keras_selfattn.generation.loop import Controls

ACTION = "generate with"


@dataclasses.dataclass(frozen=True)
class Model:
    """A model `generate` can run, read once.

    Attributes:
        reading: Its `cached_model.Reading` (the model decoding runs, its
            SelfAttention layers and their names).
        tokens: Whether it is a token model (integer input, logits out);
            else a value model (float input, its output the next input).
        input_dtype: Its input's dtype.
        features: A value model's input features (None for token models).
        vocabulary: A token model's logits width (None for value models).
    """

    reading: cached_model.Reading
    tokens: bool
    input_dtype: str
    features: int | None
    vocabulary: int | None

    @property
    def model(self) -> keras.Model:
        """The model decoding runs (`Reading.model`)."""
        return self.reading.model

    @property
    def layers(self) -> tuple:
        """Its SelfAttention layers (`Reading.layers`)."""
        return self.reading.layers


def check_decodes(read: Model) -> None:
    """Refuses a model whose cached decode differs from its full forward
    pass (`decode_check`, unless waived; it runs the model, so after the
    cheaper checks of the request).

    Raises:
        ValueError: one line naming the layer that mixes positions.
    """
    decode_check.check(read.reading, probe(read), ACTION)


def read_structure(model) -> Model:
    """Checks that `model`'s structure can generate; reads what generation
    needs, without running it.

    Args:
        model: The user's model (a subclassed one is read through its
            `cached_model.functional_view`).

    Raises:
        TypeError: if `model` is not a keras.Model.
        ValueError: for a structure that cannot decode, or inputs and
            outputs that do not fit a token or a value model.
    """
    if not isinstance(model, keras.Model):
        raise TypeError(f"`model` must be a keras.Model. Received: model={model!r}")
    model = cached_model.functional_view(model, ACTION)
    reading = cached_model.read(model, ACTION)
    if len(model.inputs) != 1 or len(model.outputs) != 1:
        raise cached_model.refusal(
            model,
            f"it has {len(model.inputs)} inputs and {len(model.outputs)} outputs",
            ACTION,
        )
    (source,), (output,) = model.inputs, model.outputs
    dtype = keras.backend.standardize_dtype(source.dtype)
    tokens = "int" in dtype
    if tokens and len(source.shape) != 2:
        raise cached_model.refusal(
            model,
            f"its integer input has shape {source.shape}, not (batch, time)",
            ACTION,
        )
    if tokens and (len(output.shape) != 3 or output.shape[-1] is None):
        raise cached_model.refusal(
            model,
            f"its output has shape {output.shape}, not (batch, time, vocabulary) "
            "logits",
            ACTION,
        )
    if not tokens and (
        len(source.shape) != 3 or tuple(output.shape[2:]) != tuple(source.shape[2:])
    ):
        raise cached_model.refusal(
            model,
            f"its float input {source.shape} and output {output.shape} are not "
            "(batch, time, features) alike, so an output cannot be its next input",
            ACTION,
        )
    return Model(
        reading,
        tokens,
        dtype,
        None if tokens else int(source.shape[-1]),
        int(output.shape[-1]) if tokens else None,
    )


def probe(read: Model) -> np.ndarray:
    """Two rows of `decode_check.PROBE_LENGTH` seeded inputs: ids in [1,
    vocabulary) (0 may be padding), or standard normal values."""
    rng = np.random.default_rng(0)
    shape = (2, decode_check.PROBE_LENGTH)
    if read.tokens:
        return rng.integers(1, max(read.vocabulary, 2), size=shape).astype(
            read.input_dtype
        )
    return rng.standard_normal((*shape, read.features)).astype(read.input_dtype)


@dataclasses.dataclass(frozen=True)
class Request:
    """One checked generation.

    Attributes:
        prompts: Right-padded `(batch, P)` ids or `(batch, P, features)`.
        lengths: int32 `(batch,)`, each in [1, P].
        max_new_tokens: New positions per row, at most.
        max_length: The caches' length, >= P + max_new_tokens.
        controls: The sampling controls (Python numbers).
    """

    prompts: np.ndarray
    lengths: np.ndarray
    max_new_tokens: int
    max_length: int
    controls: Controls


def _is_int(value) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


def _padded(read: Model, prompts, prompt_lengths) -> tuple[np.ndarray, np.ndarray]:
    """(right-padded prompts, lengths) from a list of sequences or an array."""
    row_dims = 1 if read.tokens else 2
    if isinstance(prompts, (list, tuple)) and prompt_lengths is None:
        rows = [np.asarray(row) for row in prompts]
        if not rows or any(row.ndim != row_dims for row in rows):
            raise ValueError(
                "`prompts` must be a non-empty list of "
                + ("1-D token sequences" if read.tokens else "(time, features) arrays")
                + f". Received: prompts with row shapes {[r.shape for r in rows]}"
            )
        lengths = np.array([len(row) for row in rows], np.int32)
        width = max(int(lengths.max()), 1)
        padded = np.zeros((len(rows), width, *rows[0].shape[1:]), read.input_dtype)
        for index, row in enumerate(rows):
            padded[index, : len(row)] = row
        prompts = padded
    else:
        prompts = np.asarray(prompts)
        if prompts.ndim != row_dims + 1 or prompts.shape[0] == 0:
            shape = "(batch, time)" if read.tokens else "(batch, time, features)"
            raise ValueError(
                f"`prompts` must be a {shape} array or a list of rows. "
                f"Received: prompts with shape {prompts.shape}"
            )
        if prompt_lengths is None:
            lengths = np.full(prompts.shape[0], prompts.shape[1], np.int32)
        else:
            lengths = np.asarray(prompt_lengths)
            if lengths.shape != prompts.shape[:1] or not np.issubdtype(
                lengths.dtype, np.integer
            ):
                raise ValueError(
                    "`prompt_lengths` must be one integer per prompt row. Received: "
                    f"prompt_lengths={prompt_lengths!r} for {prompts.shape[0]} rows"
                )
    if read.tokens:
        if not np.issubdtype(prompts.dtype, np.integer):
            raise ValueError(
                "`prompts` of a token model must hold integer ids. Received: "
                f"prompts with dtype {prompts.dtype}"
            )
        outside = (prompts < 0) | (prompts >= read.vocabulary)
        if outside.any():
            raise ValueError(
                f"`prompts` must hold ids in [0, {read.vocabulary}) (the model's "
                f"vocabulary). Received: {int(prompts[outside][0])}"
            )
    elif prompts.shape[2] != read.features:
        raise ValueError(
            f"`prompts` must have {read.features} features (the model's input). "
            f"Received: prompts with shape {prompts.shape}"
        )
    if (lengths < 1).any() or (lengths > prompts.shape[1]).any():
        raise ValueError(
            f"`prompt_lengths` must each be in [1, {prompts.shape[1]}] (a prompt "
            f"holds at least one position). Received: prompt_lengths={lengths.tolist()}"
        )
    return prompts.astype(read.input_dtype), lengths.astype(np.int32)


def controls(read: Model, temperature, top_k, top_p, seed, end_token) -> Controls:
    """The checked sampling controls (module docstring of `sampling`)."""
    if (
        isinstance(temperature, bool)
        or not isinstance(temperature, Real)
        or not math.isfinite(temperature)
        or temperature < 0
    ):
        raise ValueError(
            "`temperature` must be a finite number >= 0 (0: greedy). "
            f"Received: temperature={temperature!r}"
        )
    if top_k is not None and (not _is_int(top_k) or top_k <= 0):
        raise ValueError(
            f"`top_k` must be a positive integer or None. Received: top_k={top_k!r}"
        )
    if top_p is not None and (
        isinstance(top_p, bool) or not isinstance(top_p, Real) or not 0 < top_p <= 1
    ):
        raise ValueError(
            f"`top_p` must be a number in (0, 1] or None. Received: top_p={top_p!r}"
        )
    if temperature == 0 and (top_k is not None or top_p is not None):
        raise ValueError(
            "`top_k` and `top_p` sample, so they need a temperature > 0 "
            f"(temperature=0 is greedy). Received: temperature={temperature!r}, "
            f"top_k={top_k!r}, top_p={top_p!r}"
        )
    if not read.tokens and (temperature != 0 or end_token is not None):
        raise ValueError(
            "A value model (float input) generates its outputs as they are: "
            "no sampling and no end token. Received: "
            f"temperature={temperature!r}, end_token={end_token!r}"
        )
    if end_token is not None and (
        not _is_int(end_token) or not 0 <= end_token < read.vocabulary
    ):
        raise ValueError(
            f"`end_token` must be an id in [0, {read.vocabulary}) (the model's "
            f"vocabulary) or None. Received: end_token={end_token!r}"
        )
    if seed is None:
        seed = int(np.random.default_rng().integers(0, 2**31 - 1))
    elif not _is_int(seed) or not -(2**31) <= seed < 2**31:
        raise ValueError(
            f"`seed` must be a 32-bit integer or None. Received: seed={seed!r}"
        )
    return Controls(
        temperature=float(temperature),
        top_k=0 if top_k is None else int(top_k),
        top_p=1.0 if top_p is None else float(top_p),
        seed=int(seed),
        end_token=-1 if end_token is None else int(end_token),
    )


def request(
    read: Model,
    prompts,
    max_new_tokens,
    *,
    prompt_lengths=None,
    max_length=None,
    temperature=0.0,
    top_k=None,
    top_p=None,
    seed=None,
    end_token=None,
) -> Request:
    """Checks one generation's arguments (see `generate`).

    Raises:
        ValueError: naming the first bad argument and its value.
    """
    max_new_tokens = _checks.positive_int("max_new_tokens", max_new_tokens)
    padded, lengths = _padded(read, prompts, prompt_lengths)
    width = padded.shape[1]
    if max_length is None:
        max_length = width + max_new_tokens
    max_length = _checks.positive_int("max_length", max_length)
    if width > max_length:
        raise ValueError(
            f"`prompts` are longer than max_length={max_length}. Received: "
            f"prompts of {width} positions"
        )
    if width + max_new_tokens > max_length:
        raise ValueError(
            f"`max_new_tokens` must fit the cache after the prompts: at most "
            f"max_length - prompt positions = {max_length - width}. Received: "
            f"max_new_tokens={max_new_tokens}"
        )
    checked = controls(read, temperature, top_k, top_p, seed, end_token)
    return Request(padded, lengths, max_new_tokens, max_length, checked)
