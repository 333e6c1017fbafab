"""`generate`: continuations of prompts, from a model's key/value caches."""

from __future__ import annotations

import dataclasses

import keras
import numpy as np

from keras_selfattn.generation import arguments, compiled, decode_check


@dataclasses.dataclass(frozen=True)
class Generated:
    """What `generate` returns.

    Attributes:
        tokens: int32 `(batch, max_new_tokens)` new token ids (token
            models), -1 after a row's end; or `(batch, max_new_tokens,
            features)` new values (value models).
        lengths: int32 `(batch,)`: how many new positions each row has (an
            end token counts).
    """

    tokens: np.ndarray
    lengths: np.ndarray

    def rows(self) -> list[np.ndarray]:
        """Each row's new positions, without what follows its end."""
        return [self.tokens[i, :n] for i, n in enumerate(self.lengths)]


def generate(
    model: keras.Model,
    prompts,
    max_new_tokens: int,
    *,
    prompt_lengths=None,
    max_length: int | None = None,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    end_token: int | None = None,
    check: bool = True,
    jit_compile: bool | str = "auto",
) -> Generated:
    """Generates continuations of `prompts` with one key/value cache per
    SelfAttention layer, compiled on the model's backend.

    Token models take integer ids and return logits `(batch, time,
    vocabulary)`: each new token is chosen from the last position's logits
    (greedy at `temperature=0`, else sampled with the optional `top_k` and
    `top_p` filters) and fed back as the next input. Value models take
    float `(batch, time, features)` and return the same shape: the output
    at the last position is the next input (a forecaster). The model must
    be one `SelfAttention` layers can decode: causal layers anywhere in it
    (top level, inside subclassed layers, nested or subclassed models),
    position-wise layers around them, position layers that take the
    decoded positions (`keras_selfattn.PositionEmbedding`, keras-hub's),
    no padding masks. Before the first token, a probe's cached decode is
    checked against the model's full forward pass, once per model: a
    model that differs is refused naming the layer that mixes positions.
    Prompts of different lengths run in one batch; each row computes what
    it would alone (rows are aligned at their last position, which rotary
    embeddings do not see; position layers see each row's own
    positions).

    Sampling is reproducible: each row and step draws one uniform number
    from a counter-based stream of `seed` (`random_stream`), which the
    exported generators compute alike, so they return the same tokens.

    Args:
        model: A token or value model (above).
        prompts: A list of 1-D id sequences (or `(time, features)` arrays),
            or a right-padded `(batch, time)` array with `prompt_lengths`.
        max_new_tokens: New positions per row, at most.
        prompt_lengths: Each row's length in a padded `prompts` array
            (default: all full).
        max_length: The caches' length (default: the longest prompt plus
            `max_new_tokens`).
        temperature: 0 for greedy; else logits are divided by it before
            sampling.
        top_k: Sample among the `top_k` largest logits only.
        top_p: Sample among the most probable tokens whose probabilities
            add up to `top_p` (nucleus sampling), in (0, 1].
        seed: Seeds the uniform stream (default: a random one).
        end_token: A row ends after emitting this id.
        check: Whether to check the cached decode against the full forward
            pass first (a few calls on 2 rows of 5 positions, once per
            model). False skips it: the explicit opt-out for a model too
            large to run twice, whose tokens are then unchecked.
        jit_compile: Whether the loop is compiled: "auto" (default) and
            True do. On TensorFlow and JAX XLA compiles it into one program
            (on TensorFlow the loop is otherwise a `tf.function` run op by
            op); on PyTorch the step is recorded once as a graph of
            PyTorch's ops and replayed on every step, without Keras's
            per-layer Python (a step that cannot be recorded runs through
            the layers, with a warning). False: for a model with ops XLA
            cannot compile (the error says so), or PyTorch's steps run
            through the layers. Compiled once per prompt shape and output
            size, as a `tf.function` traces.

    Returns:
        A `Generated` (tokens or values, and each row's length).

    Raises:
        ValueError: naming a bad argument: a prompt longer than
            `max_length`, `max_new_tokens` beyond the cache, `top_k <= 0`,
            `top_p` outside (0, 1], a negative or NaN temperature, an end
            token outside the vocabulary, ids outside it, a `jit_compile`
            other than "auto", True or False; or a model that cannot decode
            (or that XLA cannot compile).

    Example:

    ```python
    import keras
    from keras_selfattn import SelfAttention, generate

    tokens = keras.Input((None,), dtype="int32", name="tokens")
    h = keras.layers.Embedding(20, 16)(tokens)
    h = SelfAttention(num_heads=2, causal=True, rope_max_wavelength=100)(h)
    model = keras.Model(tokens, keras.layers.Dense(20)(h))
    result = generate(model, [[1, 2, 3], [4]], max_new_tokens=5)
    print(result.tokens.shape, result.lengths)  # (2, 5) [5 5]
    ```
    """
    jit = compiled.jit(jit_compile)
    read = arguments.read_structure(model)
    request = arguments.request(
        read,
        prompts,
        max_new_tokens,
        prompt_lengths=prompt_lengths,
        max_length=max_length,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        end_token=end_token,
    )
    # The request is checked before the model runs (the decode check).
    with decode_check.waived(not check):
        arguments.check_decodes(read)
    return generated(read, request, jit)


def generated(
    read: arguments.Model,
    request: arguments.Request,
    jit: bool,
    greedy_loop: bool = True,
) -> Generated:
    """`generate`'s result for a model already read and checked, and a
    checked request (an exported generator's check runs it), its loop
    compiled when `jit` (`compiled.jit`); `greedy_loop` as `compiled.run`
    takes it."""
    values, lengths = compiled.run(read, request, jit, greedy_loop)
    return Generated(values, lengths)
