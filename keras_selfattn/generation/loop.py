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
   The steps' caches are checked by the loop (no guards, no zeroing), of
   the class where the loop runs needs (`CacheClasses`, `cache_classes`):
   in a TensorFlow graph without XLA time-major (`TimeMajorCache`), where
   the keys and values written so far are read as views of the cache
   instead of copies and each step writes into the caches' own buffers;
   in eager PyTorch written in place (`TorchInPlaceCache`). A caller may
   pass its own classes and a body to run instead of the step
   (`torch_steps`: the step recorded once and replayed, its caches
   `TorchRecordedCache`s).

Value models (a float input whose last output is the next input) run the
same loop without sampling or ending: the output at the last position is
the next input.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import keras
from keras import ops

from keras_selfattn.attention import cache as cache_lib
from keras_selfattn.attention import nan_safe
from keras_selfattn.attention.cache import environment
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


@dataclasses.dataclass(frozen=True)
class CacheClasses:
    """The cache classes of one generation (`attention.cache.layouts`).

    Attributes:
        prompt: The prompt's caches' (guarded, as a user's call is).
        steps: The steps' caches', checked by the loop: every index is in
            range, every slot no query may attend holds zeros and every fed
            position is a real token.
    """

    prompt: type = cache_lib.Cache
    steps: type = cache_lib.CheckedCache


def cache_classes() -> CacheClasses:
    """The classes a generation run where the loop runs now needs: its steps
    written in place in eager PyTorch, time-major in a TensorFlow graph that
    XLA does not compile (views instead of copies), else batch-major."""
    if environment.torch_eager():
        return CacheClasses(steps=cache_lib.TorchInPlaceCache)
    if environment.outside_xla():
        return CacheClasses(steps=cache_lib.TimeMajorCache)
    return CacheClasses()


_CONTROLS = ("temperature", "top_k", "top_p")


@dataclasses.dataclass(frozen=True)
class _Generation:
    """What one generation's steps read (`run`'s arguments, prepared)."""

    model: keras.Model
    layers: Sequence
    width: object
    padding: object
    starts: object
    steps: object
    controls: Controls
    tokens: bool
    greedy: bool
    uniforms: object
    end: object
    step_cache: type

    def request_tensors(self) -> dict:
        """The request's tensors that the steps read, by name
        (`with_request`): the rest of the generation is Python facts."""
        c = self.controls
        named = {
            "padding": self.padding,
            "starts": self.starts,
            "uniforms": self.uniforms,
            "end": self.end,
            "temperature": c.temperature,
            "top_k": c.top_k,
            "top_p": c.top_p,
        }
        return {name: x for name, x in named.items() if ops.is_tensor(x)}

    def with_request(self, tensors: dict) -> _Generation:
        """This generation with other request tensors (`request_tensors`'
        names)."""
        controls = {k: v for k, v in tensors.items() if k in _CONTROLS}
        fields = {k: v for k, v in tensors.items() if k not in _CONTROLS}
        return dataclasses.replace(
            self, controls=dataclasses.replace(self.controls, **controls), **fields
        )

    def choose(self, output, t):
        """The output at position t: its last position, or its token."""
        last = output[:, -1]
        if not self.tokens:
            return last
        if self.greedy:
            return sampling.greedy_token(last)
        uniform = ops.take(self.uniforms, ops.cast(t, "int32"), axis=1)
        controls = self.controls
        return sampling.next_token(
            last, uniform, controls.temperature, controls.top_k, controls.top_p
        )

    def ends(self, chosen):
        """Whether each row's `chosen` token is the end token."""
        return ops.logical_and(
            ops.greater_equal(self.end, 0), ops.equal(chosen, self.end)
        )

    def running(self, t, generated, produced, ended, newest, *caches):
        """The loop's condition: steps left, and a row not ended."""
        return ops.logical_and(ops.less(t, self.steps), ops.logical_not(ops.all(ended)))

    def step(self, t, generated, produced, ended, newest, *caches):
        """The loop's body: position t from the newest one."""
        if self.tokens:  # an ended row feeds token 0 (any valid id; not emitted)
            fed = ops.expand_dims(ops.where(ended, 0, newest), 1)
        else:
            fed = ops.expand_dims(newest, 1)
        # Position width - 1 + t < width + steps <= max_length: in every
        # cache (callers check steps), so the layers check nothing; the
        # caches hold zeros in every slot no query may attend, and the fed
        # position is never padding.
        output, caches = cached_model.run_cached(
            self.model,
            self.layers,
            fed,
            [self.step_cache(c) for c in caches],
            ops.add(self.width - 1, t),
            self.padding,
            self.starts,
        )
        chosen = self.choose(output, t)
        if self.tokens:
            emitted = ops.where(ended, NOT_GENERATED, chosen)
            produced = ops.add(produced, ops.cast(ops.logical_not(ended), "int32"))
            ended = ops.logical_or(ended, self.ends(chosen))
        else:
            emitted = chosen
            produced = ops.add(produced, 1)
        generated = _written(generated, t, emitted)
        caches = [c.tensor for c in caches]
        return (ops.add(t, 1), generated, produced, ended, chosen, *caches)


def _uniforms(controls: Controls, batch, capacity: int):
    """Every step's uniforms at once: (batch, capacity)."""
    return random_stream.uniforms(
        controls.seed,
        ops.arange(batch, dtype="int32"),
        ops.arange(capacity, dtype="int32"),
    )


def _prefill(generation: _Generation, moved, max_length: int, prompt_cache: type):
    """The prompts run once into new caches: the output, and the caches
    as the steps take them (tensors in the steps' layout)."""
    batch = ops.shape(moved)[0]
    caches = [
        prompt_cache(_empty_cache(layer, batch, max_length))
        for layer in generation.layers
    ]
    output, caches = cached_model.run_cached(
        generation.model,
        generation.layers,
        moved,
        caches,
        0,
        generation.padding,
        generation.starts,
    )
    # Padded slots to zeros: the steps' caches then read zero wherever no
    # query may attend, which a checked cache requires.
    slots = ops.expand_dims(generation.padding, (1, 3, 4))
    tensors = [nan_safe.zero_unless(slots, c.tensor) for c in caches]
    return output, [generation.step_cache.from_batch_major(t).tensor for t in tensors]


def _first(generation: _Generation, output, capacity: int):
    """The loop's variables after the prompt: t, the generated buffer, the
    lengths produced, which rows ended, the newest output."""
    first = generation.choose(output, 0)
    batch = ops.shape(first)[0]
    if generation.tokens:
        generated = ops.full((batch, capacity), NOT_GENERATED, dtype="int32")
        ended = generation.ends(first)
    else:
        generated = ops.zeros((batch, capacity, ops.shape(first)[-1]), first.dtype)
        ended = ops.zeros((batch,), dtype="bool")
    generated = _written(generated, 0, first)
    produced = ops.ones((batch,), dtype="int32")
    return (ops.convert_to_tensor(1, "int32"), generated, produced, ended, first)


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
    caches: CacheClasses | None = None,
    body: Callable | None = None,
):
    """Generates up to `steps` new positions per row (module docstring).

    Args:
        model, layers: The model and its SelfAttention layers
            (`cached_model.Reading`).
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
        caches: The cache classes the caller needs (an exporter's), or
            None: `cache_classes()`.
        body: None, or a function of the generation (whose `step` is the
            loop's body, `request_tensors` what it reads of the request) and
            the loop's first variables that returns the body to run instead
            (`torch_steps.Steps.body`: the step recorded and replayed).

    Returns:
        Tuple (int32 `(batch, capacity)` tokens, or `(batch, capacity,
        features)` values; int32 `(batch,)` lengths).
    """
    lengths = ops.cast(lengths, "int32")
    classes = caches or cache_classes()
    batch = ops.shape(prompts)[0]
    width = ops.shape(prompts)[1]
    moved, valid = left_aligned(prompts, lengths)
    padding = ops.concatenate(
        [valid, ops.ones((batch, max_length - width), dtype="bool")], axis=1
    )
    generation = _Generation(
        model=model,
        layers=layers,
        width=width,
        padding=padding,
        # Each row's first token's slot: position layers count from there.
        starts=ops.subtract(width, lengths),
        steps=ops.cast(steps, "int32"),
        controls=controls,
        tokens=tokens,
        greedy=greedy,
        uniforms=_uniforms(controls, batch, capacity)
        if tokens and not greedy
        else None,
        end=ops.cast(controls.end_token, "int32"),
        step_cache=classes.steps,
    )
    output, step_caches = _prefill(generation, moved, max_length, classes.prompt)
    loop_vars = (*_first(generation, output, capacity), *step_caches)
    step = generation.step if body is None else body(generation, loop_vars)
    results = ops.while_loop(generation.running, step, loop_vars)
    return results[1], results[2]
