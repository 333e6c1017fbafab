"""Variable-length integer sequences, padded with 0 and masked by Embedding.

`Embedding(mask_zero=True)` marks token 0 as padding and Keras hands that mask
to `SelfAttention`. The example trains a small classifier on generated
sequences of different lengths (label: does the sequence hold more tokens
from the upper half of the vocabulary than from the lower half), then shows
on a padded batch that
  * every padded key gets exactly 0 attention weight,
  * every padded position outputs exactly 0,
  * the real positions' outputs equal those of the same sequence run alone,
    without any padding.
It writes `masked_sequences.png` (the weights of three padded sequences).

Run: `.venv/bin/python examples/masked_sequences.py [--fast] [--out DIR]`.
"""

from __future__ import annotations

import _common
import keras
import numpy as np

from keras_selfattn import SelfAttention

VOCAB = 20  # token 0 is padding; real tokens are 1..VOCAB-1
MAX_LEN = 12


def make_data(count: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Padded (count, MAX_LEN) int sequences of lengths 2..MAX_LEN and labels."""
    tokens = np.zeros((count, MAX_LEN), dtype="int32")
    labels = np.zeros((count,), dtype="int32")
    for i in range(count):
        length = int(rng.integers(2, MAX_LEN + 1))
        sequence = rng.integers(1, VOCAB, size=length)
        tokens[i, :length] = sequence
        labels[i] = int((sequence >= VOCAB // 2).sum() > (sequence < VOCAB // 2).sum())
    return tokens, labels


def build_model() -> tuple[keras.Model, keras.Model]:
    """The classifier, and a probe model returning (attention output, weights)."""
    tokens = keras.Input((None,), dtype="int32", name="tokens")
    embedded = keras.layers.Embedding(VOCAB, 16, mask_zero=True, name="embed")(tokens)
    attended, weights = SelfAttention(num_heads=2, name="attention")(
        embedded, return_attention_scores=True
    )
    pooled = keras.layers.GlobalAveragePooling1D(name="mean_over_real")(attended)
    label = keras.layers.Dense(1, activation="sigmoid", name="label")(pooled)
    classifier = keras.Model(tokens, label, name="masked_classifier")
    probe = keras.Model(tokens, [attended, weights], name="attention_probe")
    return classifier, probe


def main() -> None:
    args = _common.parse_args(
        __doc__.splitlines()[0], fast_help="train on 512 sequences for 2 epochs"
    )
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    count, epochs = (512, 2) if args.fast else (4000, 10)
    x, y = make_data(count, rng)
    classifier, probe = build_model()
    classifier.compile(
        "adam", "binary_crossentropy", metrics=["accuracy"], jit_compile=False
    )
    classifier.fit(x, y, epochs=epochs, batch_size=64, verbose=1)
    x_test, y_test = make_data(500, rng)
    _, accuracy = classifier.evaluate(x_test, y_test, verbose=0)
    majority = max(y_test.mean(), 1 - y_test.mean())
    print(f"held-out accuracy: {accuracy:.4f} (majority class: {majority:.4f})")

    lengths = [3, 7, MAX_LEN]
    batch = np.zeros((len(lengths), MAX_LEN), dtype="int32")
    for i, length in enumerate(lengths):
        batch[i, :length] = rng.integers(1, VOCAB, size=length)
    print("padded batch (0 = padding):")
    print(batch)
    output, weights = (np.asarray(a) for a in probe.predict(batch, verbose=0))
    for i, length in enumerate(lengths):
        alone_output, _ = probe.predict(batch[i : i + 1, :length], verbose=0)
        diff = np.abs(output[i, :length] - alone_output[0]).max()
        line = f"sequence {i} (length {length:2d}): "
        if length < MAX_LEN:
            key_weight = np.abs(weights[i, :, :, length:]).max()
            padded_output = np.abs(output[i, length:]).max()
            line += (
                f"max weight on padded keys = {key_weight:g}, "
                f"max |output| at padded positions = {padded_output:g}, "
            )
        else:
            line += "no padding, "
        print(line + f"max |padded - alone| on real positions = {diff:g}")
    path = _common.save_heatmaps(
        [weights[i, 0] for i in range(len(lengths))],
        [f"length {n}, head 0" for n in lengths],
        args.out / "masked_sequences.png",
    )
    print(f"attention heatmaps: {path}")


if __name__ == "__main__":
    main()
