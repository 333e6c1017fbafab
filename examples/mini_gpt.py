"""A miniature GPT written the way keras.io writes one, decoded and exported.

keras.io's "Text generation with a miniature GPT" builds a subclassed
`TransformerBlock` holding `MultiHeadAttention` (called with a causal mask)
and a `TokenAndPositionEmbedding` layer whose positions come from
`ops.arange`. Here the block holds `SelfAttention(causal=True)` instead,
and the embedding is `keras_selfattn.TokenAndPositionEmbedding`: learned
absolute positions, as GPT-2's, that decode one position at a time
(keras.io's `ops.arange` layer cannot: `generate` refuses it, naming it).

The model learns arithmetic sequences it is given (each row starts
anywhere and steps by 1, 2 or 3, modulo the vocabulary; generated here,
nothing is downloaded), then:

1. `keras_selfattn.generate` continues prompts of mixed lengths greedily,
   with one key/value cache per SelfAttention layer inside the blocks; the
   tokens are compared with an uncached loop that reruns the whole row at
   every step, and with the sequences' true continuations;
2. the whole generation is exported as one call: a SavedModel signature
   (TF Serving), an ONNX `Loop` and a LiteRT `WHILE`, each checked in a
   fresh process of its runtime against `generate` before it appears, then
   run here in its runtime on the same prompts.

It prints what it measured and writes `mini_gpt.json` and the exports
into `--out`. Run: `.venv/bin/python examples/mini_gpt.py [--fast]
[--out DIR]` (TensorFlow backend: the exports run on TensorFlow).
"""

from __future__ import annotations

import json

import _common
import keras
import numpy as np
from keras import ops

import keras_selfattn
from keras_selfattn import SelfAttention, generate

VOCABULARY = 20
MAXLEN = 24
EMBED_DIM = 32
NUM_HEADS = 2
FF_DIM = 64
PROMPTS = [[3, 4, 5, 6], [10, 12], [1, 4, 7, 10, 13], [18, 19, 0]]
NEW_TOKENS = 8


@keras.saving.register_keras_serializable(package="mini_gpt")
class TransformerBlock(keras.layers.Layer):
    """keras.io's block: attention, then a feed-forward network, each with a
    residual connection, dropout and layer normalization."""

    def __init__(self, embed_dim, num_heads, ff_dim, rate=0.1, **kwargs):
        super().__init__(**kwargs)
        self.embed_dim, self.num_heads, self.ff_dim, self.rate = (
            embed_dim,
            num_heads,
            ff_dim,
            rate,
        )
        self.att = SelfAttention(num_heads=num_heads, causal=True)
        self.ffn = keras.Sequential(
            [
                keras.layers.Dense(ff_dim, activation="relu"),
                keras.layers.Dense(embed_dim),
            ]
        )
        self.layernorm1 = keras.layers.LayerNormalization(epsilon=1e-6)
        self.layernorm2 = keras.layers.LayerNormalization(epsilon=1e-6)
        self.dropout1 = keras.layers.Dropout(rate)
        self.dropout2 = keras.layers.Dropout(rate)

    def call(self, inputs, training=None):
        attention_output = self.dropout1(self.att(inputs), training=training)
        out1 = self.layernorm1(inputs + attention_output)
        ffn_output = self.dropout2(self.ffn(out1), training=training)
        return self.layernorm2(out1 + ffn_output)

    def get_config(self):
        return {
            **super().get_config(),
            "embed_dim": self.embed_dim,
            "num_heads": self.num_heads,
            "ff_dim": self.ff_dim,
            "rate": self.rate,
        }


def create_model() -> keras.Model:
    inputs = keras.Input(shape=(None,), dtype="int32", name="tokens")
    x = keras_selfattn.TokenAndPositionEmbedding(VOCABULARY, MAXLEN, EMBED_DIM)(inputs)
    x = TransformerBlock(EMBED_DIM, NUM_HEADS, FF_DIM)(x)
    x = TransformerBlock(EMBED_DIM, NUM_HEADS, FF_DIM)(x)
    outputs = keras.layers.Dense(VOCABULARY, name="logits")(x)
    model = keras.Model(inputs=inputs, outputs=outputs, name="mini_gpt")
    model.compile(
        "adam",
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def sequences(count: int, seed: int = 0) -> np.ndarray:
    """Arithmetic sequences `(count, MAXLEN + 1)` modulo the vocabulary."""
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, VOCABULARY, size=(count, 1))
    steps = rng.integers(1, 4, size=(count, 1))
    return ((starts + steps * np.arange(MAXLEN + 1)) % VOCABULARY).astype("int32")


def uncached(model: keras.Model, prompt: list[int], steps: int) -> list[int]:
    """Greedy tokens by rerunning the whole row at every step: no cache."""
    row = list(prompt)
    for _ in range(steps):
        logits = model(np.array([row], "int32"), training=False)
        row.append(int(ops.convert_to_numpy(logits)[0, -1].argmax()))
    return row[len(prompt) :]


def truth(prompt: list[int]) -> list[int]:
    step = (prompt[1] - prompt[0]) % VOCABULARY
    last = prompt[-1]
    return [(last + step * (i + 1)) % VOCABULARY for i in range(NEW_TOKENS)]


def export_generators(model: keras.Model, out) -> dict[str, list[list[int]]]:
    """The three generators, each checked by its exporter, then run here."""
    import onnxruntime
    import tensorflow as tf
    from ai_edge_litert.interpreter import Interpreter

    from keras_selfattn.export import export_generator

    lengths = np.array([len(p) for p in PROMPTS], np.int32)
    padded = np.zeros((len(PROMPTS), lengths.max()), np.int32)
    for row, prompt in enumerate(PROMPTS):
        padded[row, : len(prompt)] = prompt
    request = {
        "prompt_tokens": padded,
        "prompt_lengths": lengths,
        "max_new_tokens": np.array(NEW_TOKENS, np.int32),
        "temperature": np.array(0.0, np.float32),
        "top_k": np.array(VOCABULARY, np.int32),
        "top_p": np.array(1.0, np.float32),
        "seed": np.array(0, np.int32),
        "end_token": np.array(-1, np.int32),
    }
    max_length = MAXLEN
    served = export_generator(
        model, out / "serving", "saved_model", max_length=max_length, name="mini_gpt"
    )
    onnx_path = export_generator(
        model, out / "mini_gpt.onnx", "onnx", max_length=max_length
    )
    litert_path = export_generator(
        model, out / "mini_gpt.tflite", "litert", max_length=max_length
    )
    signature = tf.saved_model.load(served).signatures["generate"]
    tokens = {
        "saved_model": signature(**{k: tf.constant(v) for k, v in request.items()})[
            "tokens"
        ].numpy()
    }
    session = onnxruntime.InferenceSession(
        onnx_path, providers=["CPUExecutionProvider"]
    )
    tokens["onnx"] = session.run(["tokens"], request)[0]
    runner = Interpreter(model_path=litert_path).get_signature_runner("generate")
    tokens["litert"] = runner(**request)["tokens"]
    for name, path in (("saved_model", served), ("onnx", onnx_path)):
        print(f"exported: {name} {path}")
    print(f"exported: litert {litert_path}")
    return {name: value.tolist() for name, value in tokens.items()}


def main() -> None:
    args = _common.parse_args(
        "A keras.io-style miniature GPT with SelfAttention: trained, decoded "
        "with generate, exported as one-call generators.",
        "train for fewer epochs",
    )
    keras.utils.set_random_seed(0)
    model = create_model()
    data = sequences(2048)
    epochs = 3 if args.fast else 8
    history = model.fit(
        data[:, :-1], data[:, 1:], batch_size=64, epochs=epochs, verbose=0
    )
    print(f"trained: {epochs} epochs, loss {history.history['loss'][-1]:.4f}")

    generated = generate(model, PROMPTS, max_new_tokens=NEW_TOKENS)
    cached = generated.tokens.tolist()
    reference = [uncached(model, prompt, NEW_TOKENS) for prompt in PROMPTS]
    correct = sum(
        int(a == b)
        for row, prompt in zip(cached, PROMPTS, strict=True)
        for a, b in zip(row, truth(prompt), strict=True)
    )
    total = NEW_TOKENS * len(PROMPTS)
    print(f"generate == uncached loop: {cached == reference}")
    print(f"continuations right: {correct}/{total}")
    results = {
        "epochs": epochs,
        "prompts": PROMPTS,
        "generate": cached,
        "uncached": reference,
        "correct": correct,
        "total": total,
    }
    if keras.backend.backend() == "tensorflow":
        results["exports"] = export_generators(model, args.out)
        for name, tokens in results["exports"].items():
            print(f"{name} generator == generate: {tokens == cached}")
    path = _common.write_replacing(
        args.out / "mini_gpt.json",
        lambda tmp: tmp.write_text(json.dumps(results, indent=2) + "\n"),
    )
    print(f"results: {path}")
    if cached != reference:
        raise SystemExit("generate's tokens differ from the uncached loop's")


if __name__ == "__main__":
    main()
