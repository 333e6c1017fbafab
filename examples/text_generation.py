"""A character-level language model: generation with its key/value caches,
exported as one TF Serving call.

The model (Functional): `Embedding` -> decoder blocks -> `Dense(vocabulary)`,
each block `SelfAttention(causal=True, rope_max_wavelength=10000,
num_key_value_heads=HEADS // 2, output_dim=WIDTH, use_bias=True)` + residual +
LayerNorm, then a Dense MLP + residual + LayerNorm. It is trained briefly on
text that ships with an installed package (Keras's own LICENSE file, read
through `importlib.metadata`; nothing is downloaded).

Then it greedily generates characters from a prompt twice, with the same
layers and weights:

- uncached: every step re-runs the full causal forward on the whole
  sequence so far (right-padded to a multiple of BUCKET positions, so a
  compiled forward sees a few shapes; causal attention keeps the padding
  from changing the last real position) and keeps that position's logits;
- cached: `keras_selfattn.generate`, the prompt once into one cache per
  attention layer, then one position per step, the loop compiled on the
  backend.

It checks that both produce the same tokens, prints tokens/s of each and
the speedup, and writes `text_generation.json`. Each generation runs once
untimed first (compilation of every shape), then 3 times (1 with `--fast`)
in alternating order; the speedup is the median of the per-round ratios.

On TensorFlow it then exports the generator for TF Serving
(`export_generator`: `serving/char_lm/1/`, signature "generate", prompts
in, tokens out, checked against `generate` first) and queries it as a
client would: it writes the REST request body (`generate_request.json`,
TF Serving's columnar "inputs" format) and the inputs file of
`export/serving/query.py` (`generate_inputs.json`), answers the request
with the SavedModel's signature as TF Serving would, reads the answer with
the REST client's parser, and prints the commands for a live server.

Run: `.venv/bin/python examples/text_generation.py [--fast] [--out DIR]`.
"""

from __future__ import annotations

import importlib.metadata
import json
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import _common
import keras
import numpy as np

from keras_selfattn import SelfAttention, generate

TEXT_PACKAGE = "keras"
WIDTH = 64
HEADS = 4
KEY_VALUE_HEADS = HEADS // 2
BLOCKS = 2
SEQUENCE = 64
BATCH = 32
PROMPT = "Licensed under the Apache License"
BUCKET = 64
SERVED_NAME = "char_lm"
REPO = Path(__file__).resolve().parent.parent


def language_model(vocabulary_size: int) -> keras.Model:
    """Next-character logits `(batch, time, vocabulary)` from character ids
    `(batch, time)`: the module docstring's blocks, every layer top-level
    (what `generate` and `export_generator` decode)."""
    tokens = keras.Input((None,), dtype="int32", name="tokens")
    h = keras.layers.Embedding(vocabulary_size, WIDTH, name="embed")(tokens)
    for block in range(BLOCKS):
        attended = SelfAttention(
            num_heads=HEADS,
            causal=True,
            num_key_value_heads=KEY_VALUE_HEADS,
            rope_max_wavelength=10000,
            output_dim=WIDTH,
            use_bias=True,
            name=f"attention_{block}",
        )(h)
        h = keras.layers.LayerNormalization(name=f"norm_{block}_1")(
            keras.layers.Add()([h, attended])
        )
        mlp = keras.layers.Dense(4 * WIDTH, activation="gelu", name=f"mlp_{block}_in")(
            h
        )
        mlp = keras.layers.Dense(WIDTH, name=f"mlp_{block}_out")(mlp)
        h = keras.layers.LayerNormalization(name=f"norm_{block}_2")(
            keras.layers.Add()([h, mlp])
        )
    logits = keras.layers.Dense(vocabulary_size, name="logits")(h)
    return keras.Model(tokens, logits, name="char_lm")


@dataclass(frozen=True)
class Generation:
    """One greedy generation: the new token ids and the wall time."""

    tokens: list[int]
    seconds: float


@dataclass(frozen=True)
class Comparison:
    """Timed runs of both generations, `rounds` each, alternating.

    Attributes:
        uncached: The uncached runs.
        cached: The cached runs, one per uncached run, in the same rounds.
    """

    uncached: list[Generation]
    cached: list[Generation]

    @property
    def tokens_equal(self) -> bool:
        """Whether every run of both produced the same tokens."""
        first = self.uncached[0].tokens
        return all(run.tokens == first for run in self.uncached + self.cached)

    @property
    def speedup(self) -> float:
        """Median over rounds of uncached time / cached time."""
        return statistics.median(
            u.seconds / c.seconds
            for u, c in zip(self.uncached, self.cached, strict=True)
        )

    @staticmethod
    def tokens_per_second(runs: list[Generation]) -> float:
        """Tokens per second of the run with the median time."""
        return len(runs[0].tokens) / statistics.median(r.seconds for r in runs)


def training_text(package: str = TEXT_PACKAGE) -> tuple[str, str]:
    """(text, description) of the LICENSE file shipped with `package`."""
    distribution = importlib.metadata.distribution(package)
    for file in distribution.files or []:
        if file.name.upper().startswith("LICENSE"):
            text = file.read_text(encoding="utf-8")
            return text, f"{package} {distribution.version} {file.name}"
    raise FileNotFoundError(f"{package} ships no LICENSE file")


class Vocabulary:
    """Characters <-> ids, ids in order of the sorted distinct characters."""

    def __init__(self, text: str):
        self.characters = sorted(set(text))
        self._ids = {c: i for i, c in enumerate(self.characters)}

    def __len__(self) -> int:
        return len(self.characters)

    def encode(self, text: str) -> np.ndarray:
        return np.array([self._ids[c] for c in text], dtype="int32")

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self.characters[i] for i in ids)


def windows(
    ids: np.ndarray, count: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """`count` random (inputs, next characters) windows of SEQUENCE ids."""
    starts = rng.integers(0, len(ids) - SEQUENCE - 1, size=count)
    stream = np.stack([ids[s : s + SEQUENCE + 1] for s in starts])
    return stream[:, :-1], stream[:, 1:]


def train(
    model: keras.Model, ids: np.ndarray, steps: int, rng: np.random.Generator
) -> keras.callbacks.History:
    """Fits next-character prediction on `steps` batches of random windows."""
    x, y = windows(ids, steps * BATCH, rng)
    model.compile(
        keras.optimizers.Adam(3e-3),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model.fit(x, y, batch_size=BATCH, epochs=1, verbose=2)


def generate_uncached(model: keras.Model, prompt: np.ndarray, steps: int) -> Generation:
    """Greedy decoding that re-runs the full causal forward on the sequence
    so far at every step.

    The sequence is right-padded to a multiple of BUCKET positions, so
    compiled backends see a few shapes instead of one per length; padding
    after the last position cannot change its logits (causal attention).
    """
    sequence = [int(i) for i in prompt]
    start = time.perf_counter()
    for _ in range(steps):
        length = len(sequence)
        padded = np.zeros((1, -(-length // BUCKET) * BUCKET), dtype="int32")
        padded[0, :length] = sequence
        logits = model.predict_on_batch(padded)
        sequence.append(int(np.argmax(logits[0, length - 1])))
    return Generation(sequence[len(prompt) :], time.perf_counter() - start)


def generate_cached(model: keras.Model, prompt: np.ndarray, steps: int) -> Generation:
    """Greedy decoding with one key/value cache per attention layer
    (`keras_selfattn.generate`: the loop compiled on the backend)."""
    start = time.perf_counter()
    result = generate(model, [prompt], steps)
    return Generation(result.tokens[0].tolist(), time.perf_counter() - start)


def compare(
    model: keras.Model, prompt: np.ndarray, new_tokens: int, rounds: int
) -> Comparison:
    """Runs each generation once untimed (compiling every shape), then
    `rounds` timed runs of both, alternating which goes first."""
    runs = {
        "uncached": lambda: generate_uncached(model, prompt, new_tokens),
        "cached": lambda: generate_cached(model, prompt, new_tokens),
    }
    for run in runs.values():
        run()
    timed: dict[str, list[Generation]] = {name: [] for name in runs}
    for round_index in range(rounds):
        order = list(runs) if round_index % 2 == 0 else list(runs)[::-1]
        for name in order:
            timed[name].append(runs[name]())
    return Comparison(**timed)


def first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    """The first index where `a` and `b` differ (or the shorter length)."""
    for index, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return index
    return min(len(a), len(b))


def report(comparison: Comparison, vocabulary: Vocabulary) -> dict:
    """Prints the speed and equality lines; returns them for the JSON."""
    rounds = len(comparison.cached)
    which = "1 timed run" if rounds == 1 else f"median of {rounds} timed runs"
    for name, runs in (
        ("uncached", comparison.uncached),
        ("cached", comparison.cached),
    ):
        seconds = statistics.median(run.seconds for run in runs)
        print(
            f"{name:>8}: {len(runs[0].tokens)} tokens in {seconds:.3f} s, "
            f"{Comparison.tokens_per_second(runs):.1f} tokens/s "
            f"({which})"
        )
    print(f"speedup with the cache: {comparison.speedup:.2f}x")
    print(f"cached tokens == uncached tokens: {comparison.tokens_equal}")
    generated = vocabulary.decode(comparison.cached[0].tokens)
    print(f"generated: {generated!r}")
    return {
        "uncached": [asdict(run) for run in comparison.uncached],
        "cached": [asdict(run) for run in comparison.cached],
        "speedup": comparison.speedup,
        "tokens_equal": comparison.tokens_equal,
        "generated": generated,
    }


def serve_generator(
    model: keras.Model, vocabulary: Vocabulary, new_tokens: int, out
) -> dict:
    """Exports the generator for TF Serving and queries it as a client would
    (module docstring); returns what the answer held."""
    from keras_selfattn.export import export_generator
    from keras_selfattn.serving.rest_client import (
        build_rest_request,
        parse_rest_response,
    )

    prompts = [PROMPT, PROMPT[:12]]  # two lengths in one request
    max_length = len(PROMPT) + new_tokens
    serving = out / "serving"
    version_dir = export_generator(
        model, serving, "saved_model", max_length=max_length, name=SERVED_NAME
    )
    print(f"exported the generator: {version_dir} (signature 'generate')")
    padded = np.zeros((len(prompts), len(PROMPT)), "int32")
    for row, prompt in enumerate(prompts):
        padded[row, : len(prompt)] = vocabulary.encode(prompt)
    inputs = {
        "prompt_tokens": padded,
        "prompt_lengths": np.array([len(p) for p in prompts], "int32"),
        "max_new_tokens": np.array(new_tokens, "int32"),
        "temperature": np.array(0.0, "float32"),  # greedy; > 0 samples
        "top_k": np.array(len(vocabulary), "int32"),  # the vocabulary: keep all
        "top_p": np.array(1.0, "float32"),
        "seed": np.array(0, "int32"),
        "end_token": np.array(-1, "int32"),  # none
    }
    body = build_rest_request(inputs, format="inputs", signature_name="generate")
    request_path = _common.write_replacing(
        out / "generate_request.json", lambda tmp: tmp.write_text(json.dumps(body))
    )
    inputs_path = _common.write_replacing(
        out / "generate_inputs.json",
        lambda tmp: tmp.write_text(json.dumps(body["inputs"])),
    )
    answer = {"outputs": answer_as_tf_serving(version_dir, inputs)}
    outputs = parse_rest_response(answer)
    texts = [
        vocabulary.decode(row[:length])
        for row, length in zip(outputs["tokens"], outputs["lengths"], strict=True)
    ]
    expected = generate(model, [vocabulary.encode(p) for p in prompts], new_tokens)
    same = bool((outputs["tokens"] == expected.tokens).all())
    print(f"served answer == generate: {same}")
    for prompt, text in zip(prompts, texts, strict=True):
        print(f"  {prompt!r} -> {text!r}")
    query = f"{sys.executable} {REPO / 'export' / 'serving' / 'query.py'}"
    print(
        "with TF Serving running on the export (tensorflow_model_server "
        f"--rest_api_port=8501 --model_config_file={serving / 'models.config'}):\n"
        f"  curl -d @{request_path} "
        f"http://localhost:8501/v1/models/{SERVED_NAME}:predict\n"
        f"  {query} {inputs_path} --model {SERVED_NAME} --signature generate "
        "--format inputs"
    )
    return {"tokens_equal_generate": same, "texts": texts}


def answer_as_tf_serving(version_dir: str, inputs: dict) -> dict:
    """The "outputs" TF Serving's REST API would return: the SavedModel's
    `generate` signature run on the request's tensors, as JSON lists."""
    import keras_selfattn_runtimes as runtimes

    # TensorFlow as it is: `generate` runs after it here, XLA included.
    signature = runtimes.load("saved_model", version_dir, "generate", tf_serving=False)
    return {name: value.tolist() for name, value in signature(inputs).items()}


def main() -> None:
    args = _common.parse_args(
        __doc__.splitlines()[0],
        fast_help="train 20 steps, generate 24 characters, 1 timed run (seconds)",
    )
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    text, source = training_text()
    vocabulary = Vocabulary(text)
    print(
        f"training text: {source}, {len(text)} characters, {len(vocabulary)} distinct"
    )
    steps, new_tokens, rounds = (20, 24, 1) if args.fast else (600, 200, 3)
    model = language_model(len(vocabulary))
    start = time.perf_counter()
    history = train(model, vocabulary.encode(text), steps, rng)
    loss = history.history["loss"][-1]
    print(
        f"trained {steps} steps in {time.perf_counter() - start:.1f} s, loss {loss:.3f}"
    )

    print(f"prompt: {PROMPT!r}, greedy, {new_tokens} new characters")
    comparison = compare(model, vocabulary.encode(PROMPT), new_tokens, rounds)
    results = {
        "backend": keras.backend.backend(),
        "text": source,
        "prompt": PROMPT,
        "training_steps": steps,
        "final_loss": loss,
        **report(comparison, vocabulary),
    }
    if keras.backend.backend() == "tensorflow":
        results["served"] = serve_generator(model, vocabulary, new_tokens, args.out)
    else:
        print(
            "export: a generator exports on TensorFlow; save the model and "
            "load it there (KERAS_BACKEND=tensorflow) to export it"
        )
    path = _common.write_replacing(
        args.out / "text_generation.json",
        lambda tmp: tmp.write_text(json.dumps(results, indent=2) + "\n"),
    )
    print(f"results: {path}")
    if not comparison.tokens_equal:
        first = first_difference(
            comparison.uncached[0].tokens, comparison.cached[0].tokens
        )
        raise SystemExit(f"cached and uncached tokens differ from token {first} on")


if __name__ == "__main__":
    main()
