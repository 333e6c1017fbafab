"""A small causal transformer block trained on a generated next-token task.

Block: token + learned position embedding, then
`SelfAttention(causal=True, output_dim=...)` + residual + LayerNorm, then a
feed-forward network + residual + LayerNorm, then a next-token softmax.

Task: each sequence repeats a random 3-token pattern, so from position 2 on
the next token is the token two places back; the model must learn to look
there, and it can only look back because the attention is causal. The
example prints next-token accuracy, shows the attention weights are exactly
lower-triangular (every weight on a future key is 0) and that changing future
tokens leaves earlier outputs unchanged, and writes `causal_transformer.png`.

Run: `.venv/bin/python examples/causal_transformer.py [--fast] [--out DIR]`.
"""

from __future__ import annotations

import _common
import keras
import numpy as np
from keras import ops

from keras_selfattn import SelfAttention

VOCAB = 10
TIME = 16
PERIOD = 3
WIDTH = 32


@keras.saving.register_keras_serializable(package="examples")
class PositionEmbedding(keras.layers.Layer):
    """Adds a learned vector per position to a (batch, time, width) input.

    Args:
        max_length: The longest sequence the table covers.
        **kwargs: Base layer arguments.
    """

    def __init__(self, max_length: int, **kwargs):
        super().__init__(**kwargs)
        self.max_length = max_length
        self.supports_masking = True

    def build(self, input_shape):
        self.table = self.add_weight(
            name="table", shape=(self.max_length, input_shape[-1])
        )

    def call(self, inputs):
        return inputs + self.table[: ops.shape(inputs)[1]]

    def get_config(self) -> dict:
        return {**super().get_config(), "max_length": self.max_length}


def make_data(count: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, next tokens), both (count, TIME) int32, of repeated patterns."""
    patterns = rng.integers(0, VOCAB, size=(count, PERIOD))
    stream = np.tile(patterns, (1, TIME // PERIOD + 2))[:, : TIME + 1]
    return stream[:, :-1].astype("int32"), stream[:, 1:].astype("int32")


def build_model() -> tuple[keras.Model, keras.Model]:
    """The next-token model, and a probe returning its attention weights."""
    tokens = keras.Input((None,), dtype="int32", name="tokens")
    h = keras.layers.Embedding(VOCAB, WIDTH, name="embed")(tokens)
    h = PositionEmbedding(TIME, name="positions")(h)
    attended, weights = SelfAttention(
        num_heads=2, causal=True, output_dim=WIDTH, name="causal_attention"
    )(h, return_attention_scores=True)
    h = keras.layers.LayerNormalization(name="norm_1")(h + attended)
    ffn = keras.layers.Dense(4 * WIDTH, activation="relu", name="ffn_in")(h)
    ffn = keras.layers.Dense(WIDTH, name="ffn_out")(ffn)
    h = keras.layers.LayerNormalization(name="norm_2")(h + ffn)
    logits = keras.layers.Dense(VOCAB, name="next_token")(h)
    model = keras.Model(tokens, logits, name="causal_block")
    return model, keras.Model(tokens, weights, name="attention_probe")


def main() -> None:
    args = _common.parse_args(
        __doc__.splitlines()[0], fast_help="train for 1 epoch of 40 steps"
    )
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    epochs = 1 if args.fast else 6
    x, y = make_data(40 * 32, rng)
    model, probe = build_model()
    model.compile(
        keras.optimizers.Adam(3e-3),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=False,  # XLA compilation costs more than it saves here
    )
    model.fit(x, y, epochs=epochs, batch_size=32, verbose=1)

    x_test, y_test = make_data(500, rng)
    predicted = np.argmax(model.predict(x_test, verbose=0), axis=-1)
    # From position PERIOD - 1 on, the next token is determined by the past.
    accuracy = (predicted == y_test)[:, PERIOD - 1 :].mean()
    print(
        f"next-token accuracy where the past determines it: {accuracy:.4f} "
        f"(chance {1 / VOCAB:.2f})"
    )

    weights = np.asarray(probe.predict(x_test[:3], verbose=0))  # (3, heads, T, T)
    above_diagonal = np.triu(np.ones((TIME, TIME), dtype=bool), k=1)
    print(
        f"max weight on a future key (above the diagonal): "
        f"{np.abs(weights[..., above_diagonal]).max():g}"
    )
    print(
        f"row sums of the weights: min {weights.sum(-1).min():.6f}, "
        f"max {weights.sum(-1).max():.6f}"
    )

    changed = x_test[:1].copy()
    cut = TIME // 2
    changed[0, cut:] = (changed[0, cut:] + 1) % VOCAB
    before = model.predict(x_test[:1], verbose=0)[0, :cut]
    after = model.predict(changed, verbose=0)[0, :cut]
    print(
        f"changing tokens {cut}..{TIME - 1} moves the logits at positions "
        f"0..{cut - 1} by at most {np.abs(before - after).max():g}"
    )

    path = _common.save_heatmaps(
        [weights[0, head] for head in range(weights.shape[1])],
        [f"sequence 0, head {head}" for head in range(weights.shape[1])],
        args.out / "causal_transformer.png",
    )
    print(f"attention heatmaps: {path}")


if __name__ == "__main__":
    main()
