"""keras-hub causal LMs (Llama, Qwen 3, Gemma 3) converted
(`keras_selfattn.convert_causal_lm`) against keras-hub's own, the same
weights: `generate` and the forward pass.

keras-hub's side is its own API: `lm.compile(sampler="greedy")` then
`lm.generate({"token_ids", "padding_mask"}, max_length=prompt + new,
stop_token_ids=None)` (its compiled loop and cache), and `lm.predict_on_batch`
for the forward pass. Gemma 3's `generate` cannot concatenate its own
outputs in keras-hub 0.32 (it keeps `images: None`): its side is the
function `generate` calls, `lm.make_generate_function()`, on the same
request. The converted side is `keras_selfattn.generate(tokens_model,
prompts, new)` and `tokens_model.predict_on_batch`. Both are timed on the
backend the benchmark runs on, interleaved, as medians of per-round ratios
(`benchmarks.timing`); the generated tokens are compared.

Run: `python -m benchmarks.keras_hub [--quick] [--rounds N] [--out DIR]`
(under `KERAS_BACKEND=jax` or `torch` for those backends);
`benchmarks.keras_hub_153m` times issue 56's 153 M Llama so.
"""

from __future__ import annotations

import dataclasses

import keras
import numpy as np

from benchmarks import per_backend, timing
from keras_selfattn import convert_causal_lm, generate


@dataclasses.dataclass(frozen=True)
class Sizes:
    """What every case of a run shares: the vocabulary, the feed-forward
    width as a multiple of the hidden one, the prompt's length and the
    new tokens."""

    vocabulary: int = 1024
    intermediate_ratio: int = 2
    prompt: int = 16
    new_tokens: int = 32

    def setting(self) -> str:
        """The Markdown machine line's setting."""
        return (
            f"prompt {self.prompt}, {self.new_tokens} new tokens, vocabulary "
            f"{self.vocabulary}, feed-forward {self.intermediate_ratio}x hidden, "
            "greedy, float32."
        )


SMALL = Sizes()
# (family, hidden, query heads, key/value heads, layers, batch)
CASES = (
    ("Llama", 128, 4, 2, 2, 4),
    ("Llama", 256, 8, 2, 4, 1),
    ("Qwen 3", 256, 8, 2, 4, 1),
    ("Gemma 3", 256, 8, 2, 4, 1),
)
# Each family's keras-hub classes and arguments beyond the sizes: Qwen 3's
# query and key norms; Gemma 3's too, with its sliding windows (every layer
# but the last of each 6) shorter than the sequence.
FAMILIES = {
    "Llama": ("LlamaBackbone", "LlamaCausalLM", {}),
    "Qwen 3": ("Qwen3Backbone", "Qwen3CausalLM", {"head_dim": 32}),
    "Gemma 3": (
        "Gemma3Backbone",
        "Gemma3CausalLM",
        {
            "head_dim": 32,
            "use_sliding_window_attention": True,
            "sliding_window_size": 16,
            "vision_encoder": None,
            "image_size": 16,
        },
    ),
}
# The Markdown's heading, the setting on its machine line, its targets.
TITLE = "keras-hub's causal LMs converted vs keras-hub's own"
TARGETS = (
    "Targets: generate speedup (keras-hub time / converted time) at least "
    "1; forward time ratio (converted / keras-hub) at most 1.1."
)
COLUMNS = [
    ("model", "model"),
    ("generate_speedup", "generate speedup"),
    ("forward_time_ratio", "forward time ratio"),
    ("converted_tokens_per_s", "converted tokens/s"),
    ("same_tokens", "same tokens"),
]


def causal_lm(
    family: str, hidden: int, heads: int, kv_heads: int, layers: int, sizes: Sizes
):
    """A random-weight causal LM of `family` and this size (keras-hub's
    classes)."""
    import keras_hub

    backbone_class, lm_class, extra = FAMILIES[family]
    keras.utils.set_random_seed(0)
    backbone = getattr(keras_hub.models, backbone_class)(
        vocabulary_size=sizes.vocabulary,
        num_layers=layers,
        num_query_heads=heads,
        num_key_value_heads=kv_heads,
        hidden_dim=hidden,
        intermediate_dim=sizes.intermediate_ratio * hidden,
        **extra,
    )
    lm = getattr(keras_hub.models, lm_class)(backbone=backbone, preprocessor=None)
    lm.compile(sampler="greedy")
    return lm


def _keras_hub_generate(lm, prompts: np.ndarray, new_tokens: int, outputs: dict):
    length = prompts.shape[1] + new_tokens
    ids = np.zeros((len(prompts), length), "int32")
    ids[:, : prompts.shape[1]] = prompts
    padding = np.zeros(ids.shape, bool)
    padding[:, : prompts.shape[1]] = True
    request = {"token_ids": ids, "padding_mask": padding}
    if type(lm).__name__ == "Gemma3CausalLM":
        function = lm.make_generate_function()

        def run():
            out = function(request, stop_token_ids=None)
            return keras.ops.convert_to_numpy(out["token_ids"])
    else:

        def run():
            out = lm.generate(request, max_length=length, stop_token_ids=None)
            return np.asarray(out["token_ids"])

    def call():
        outputs["keras_hub"] = run()[:, prompts.shape[1] :]

    return call


def _converted_generate(model, prompts: np.ndarray, new_tokens: int, outputs: dict):
    def call():
        outputs["converted"] = np.asarray(generate(model, prompts, new_tokens).tokens)

    return call


def row(case: tuple, rounds: int, sizes: Sizes = SMALL) -> dict:
    """One case's row: `case` is (family, hidden, query heads, key/value
    heads, layers, batch), as `CASES`."""
    family, hidden, heads, kv_heads, layers, batch = case
    lm = causal_lm(family, hidden, heads, kv_heads, layers, sizes)
    tokens_model = convert_causal_lm(lm)
    rng = np.random.default_rng(0)
    prompts = rng.integers(1, sizes.vocabulary, (batch, sizes.prompt)).astype("int32")
    outputs: dict[str, np.ndarray] = {}
    new = sizes.new_tokens
    generation = timing.interleave(
        {
            "keras_hub": _keras_hub_generate(lm, prompts, new, outputs),
            "converted": _converted_generate(tokens_model, prompts, new, outputs),
        },
        rounds=rounds,
        warmup=1,
    )
    window = rng.integers(1, sizes.vocabulary, (batch, sizes.prompt + new))
    window = window.astype("int32")
    request = {"token_ids": window, "padding_mask": np.ones_like(window, bool)}
    forward = timing.interleave(
        {
            "keras_hub": lambda: lm.predict_on_batch(request),
            "converted": lambda: tokens_model.predict_on_batch(window),
        },
        rounds=rounds,
        warmup=1,
    )
    return {
        "model": f"{family} {layers} layers, D={hidden}, {heads}/{kv_heads} heads, "
        f"batch {batch}",
        "generate_speedup": generation.speedup("keras_hub", "converted"),
        "forward_time_ratio": 1 / forward.speedup("keras_hub", "converted"),
        "converted_tokens_per_s": batch * new / generation.median("converted"),
        "same_tokens": bool((outputs["keras_hub"] == outputs["converted"]).all()),
    }


def run_cases(
    cases: tuple, sizes: Sizes, quick: bool = False, rounds: int | None = None
) -> dict:
    """The results of `cases` (only the first when `quick`) at `sizes`."""
    rounds = per_backend.rounds(quick, rounds)
    rows = [row(case, rounds, sizes) for case in (cases[:1] if quick else cases)]
    return per_backend.results(rounds, rows)


def run(quick: bool = False, rounds: int | None = None) -> dict:
    return run_cases(CASES, SMALL, quick, rounds)


def to_markdown(results: dict) -> str:
    """`run`'s results as Markdown (`per_backend.to_markdown`)."""
    return per_backend.to_markdown(results, TITLE, SMALL.setting(), TARGETS, COLUMNS)


if __name__ == "__main__":
    per_backend.main(__doc__, run, to_markdown, "keras_hub")
