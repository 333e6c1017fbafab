"""The generation loop, in `keras.ops`: a prompt in, new tokens out.

One definition that `generate` compiles on every backend and the exported
generators carry into their graphs (a `tf.while_loop` on TensorFlow, a
`lax.while_loop` on JAX, a Python loop on PyTorch):

1. Prompts arrive right-padded, `(batch, P)` with their lengths; each row is
   moved right so that all end at position P - 1 (left padding), and the
   padding mask over the cache, `(batch, max_length)`, marks the slots
   before a row's first token. Slots then differ from a row's own
   positions by a constant, which rotary embeddings (and attention without
   positions) do not see; position layers (learned absolute positions) are
   given each row's positions counted from its first token. So each row
   computes what it would alone.
2. The prompts run once into one cache per SelfAttention layer, and the
   first token is chosen from the last position (`sampling.next_token`,
   with the uniform of step 0).
3. While fewer than `steps` tokens are out and some row has not ended, the
   model runs on the newest token only (cache index P + t - 1) and chooses
   token t. A row that emitted `end_token` has ended: its later slots hold
   -1 (as do all slots from `steps` on) and its length counts the end token.
   In a TensorFlow graph without XLA the steps carry the caches time-major
   (`tracing.TIME_MAJOR`), where the keys and values written so far are
   read as views of the cache instead of copies, and each step writes into
   the caches' own buffers.

Value models (a float input whose last output is the next input) run the
same loop without sampling or ending: the output at the last position is
the next input.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import keras
from keras import ops

from keras_selfattn import tracing
from keras_selfattn.attention import cache, nan_safe
from keras_selfattn.generation import cached_model, random_stream, sampling

# What `tokens` holds where nothing was generated.
NOT_GENERATED = -1


@dataclasses.dataclass(frozen=True)
class Controls:
    """The sampling controls of one generation, as scalars or scalar tensors.

    Attributes:
        temperature: >= 0; 0 is greedy.
        top_k: <= 0 for none.
        top_p: in (0, 1]; 1 for none.
        seed: Any int32.
        end_token: A token id, or < 0 for none.
    """

    temperature: object = 0.0
    top_k: object = 0
    top_p: object = 1.0
    seed: object = 0
    end_token: object = -1


def left_aligned(prompts, lengths):
    """Right-padded prompts moved to end at the last position.

    Args:
        prompts: `(batch, P)` or `(batch, P, features)`.
        lengths: int32 `(batch,)`, each in [1, P].

    Returns:
        Tuple (the moved prompts, padding slots zero; bool `(batch, P)`,
        True where a row holds a token).
    """
    width = ops.shape(prompts)[1]
    shift = ops.subtract(width, lengths)
    source = ops.subtract(
        ops.expand_dims(ops.arange(width, dtype="int32"), 0), ops.expand_dims(shift, 1)
    )
    valid = ops.greater_equal(source, 0)
    index = ops.maximum(source, 0)
    if len(prompts.shape) == 3:
        index = ops.expand_dims(index, -1)
        moved = ops.take_along_axis(prompts, index, axis=1)
        moved = ops.where(ops.expand_dims(valid, -1), moved, ops.zeros_like(moved))
    else:
        moved = ops.take_along_axis(prompts, index, axis=1)
        moved = ops.where(valid, moved, ops.zeros_like(moved))
    return moved, valid


def _written(buffer, t, values):
    """`buffer` with column `t` set to `values` (a select, no scatter)."""
    columns = ops.arange(ops.shape(buffer)[1], dtype="int32")
    here = ops.equal(columns, ops.cast(t, "int32"))
    if len(buffer.shape) == 3:
        return ops.where(
            ops.reshape(here, (1, -1, 1)), ops.expand_dims(values, 1), buffer
        )
    return ops.where(ops.expand_dims(here, 0), ops.expand_dims(values, 1), buffer)


def _empty_cache(layer, batch, max_length: int):
    """`layer.empty_cache` for a batch size that may be a traced scalar."""
    shape = tuple(layer.empty_cache(1, max_length).shape)[1:]
    return ops.zeros((batch, *shape), dtype=layer.compute_dtype)


def run(
    model: keras.Model,
    layers: Sequence,
    prompts,
    lengths,
    *,
    max_length: int,
    capacity: int,
    steps,
    controls: Controls,
    tokens: bool,
    greedy: bool = False,
):
    """Generates up to `steps` new positions per row (module docstring).

    Args:
        model, layers: The model and its SelfAttention layers
            (`cached_model.cached_layers`).
        prompts: Right-padded prompts `(batch, P)` (token models) or
            `(batch, P, features)` (value models).
        lengths: int32 `(batch,)`, each in [1, P].
        max_length: The caches' length, >= P + steps.
        capacity: Columns of the output, >= steps (a Python int).
        steps: The most new positions (int or int32 scalar), >= 1.
        controls: The sampling controls (token models).
        tokens: Whether `model` is a token model.
        greedy: Whether the caller knows, as a Python fact, that
            `controls.temperature` is 0: then no uniforms are drawn and no
            sampling branch is traced (the same tokens).

    Returns:
        Tuple (int32 `(batch, capacity)` tokens, or `(batch, capacity,
        features)` values; int32 `(batch,)` lengths).
    """
    lengths = ops.cast(lengths, "int32")
    steps = ops.cast(steps, "int32")
    batch = ops.shape(prompts)[0]
    width = ops.shape(prompts)[1]
    moved, valid = left_aligned(prompts, lengths)
    padding = ops.concatenate(
        [valid, ops.ones((batch, max_length - width), dtype="bool")], axis=1
    )
    caches = [_empty_cache(layer, batch, max_length) for layer in layers]
    if tokens and not greedy:  # every step's uniforms at once: (batch, capacity)
        uniforms = random_stream.uniforms(
            controls.seed,
            ops.arange(batch, dtype="int32"),
            ops.arange(capacity, dtype="int32"),
        )

    def choose(output, t):
        last = output[:, -1]
        if not tokens:
            return last
        if greedy:
            return sampling.greedy_token(last)
        uniform = ops.take(uniforms, ops.cast(t, "int32"), axis=1)
        return sampling.next_token(
            last, uniform, controls.temperature, controls.top_k, controls.top_p
        )

    # Each row's first token's slot: position layers count from there.
    starts = ops.subtract(width, lengths)
    output, caches = cached_model.run_cached(
        model, layers, moved, caches, 0, padding, starts
    )
    # Padded slots to zeros: the steps' caches then read zero wherever no
    # query may attend, which `tracing.CHECKED_BY_CALLER` requires.
    slots = ops.expand_dims(padding, (1, 3, 4))
    caches = [nan_safe.zero_unless(slots, c) for c in caches]
    # The steps read time-major caches where that saves copies.
    time_major = cache.views_pay()
    step_modes = (tracing.CHECKED_BY_CALLER,)
    if time_major:
        caches = [cache.to_time_major(c) for c in caches]
        step_modes += (tracing.TIME_MAJOR,)
    first = choose(output, 0)
    if tokens:
        generated = ops.full((batch, capacity), NOT_GENERATED, dtype="int32")
        end = ops.cast(controls.end_token, "int32")
        ended = ops.logical_and(ops.greater_equal(end, 0), ops.equal(first, end))
    else:
        generated = ops.zeros((batch, capacity, ops.shape(first)[-1]), first.dtype)
        ended = ops.zeros((batch,), dtype="bool")
    generated = _written(generated, 0, first)
    produced = ops.ones((batch,), dtype="int32")

    def cond(t, generated, produced, ended, newest, *caches):
        return ops.logical_and(ops.less(t, steps), ops.logical_not(ops.all(ended)))

    def body(t, generated, produced, ended, newest, *caches):
        if tokens:  # an ended row feeds token 0 (any valid id; not emitted)
            fed = ops.expand_dims(ops.where(ended, 0, newest), 1)
        else:
            fed = ops.expand_dims(newest, 1)
        # Position width - 1 + t < width + steps <= max_length: in every
        # cache (callers check steps), so the layers check nothing; the
        # caches hold zeros in every slot no query may attend, and the fed
        # position is never padding.
        with tracing.traced_as(*step_modes):
            output, caches = cached_model.run_cached(
                model,
                layers,
                fed,
                list(caches),
                ops.add(width - 1, t),
                padding,
                starts,
            )
        chosen = choose(output, t)
        if tokens:
            emitted = ops.where(ended, NOT_GENERATED, chosen)
            produced = ops.add(produced, ops.cast(ops.logical_not(ended), "int32"))
            ended = ops.logical_or(
                ended,
                ops.logical_and(ops.greater_equal(end, 0), ops.equal(chosen, end)),
            )
        else:
            emitted = chosen
            produced = ops.add(produced, 1)
        generated = _written(generated, t, emitted)
        return (ops.add(t, 1), generated, produced, ended, chosen, *caches)

    loop_vars = (ops.convert_to_tensor(1, "int32"), generated, produced, ended, first)
    results = ops.while_loop(cond, body, (*loop_vars, *caches))
    return results[1], results[2]
