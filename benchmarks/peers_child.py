"""The peers' side of `benchmarks.peers`, run by the peers' own Python
(transformers, torch and onnxruntime-genai: not dependencies of the
package; `make bench-peers` installs them in their own virtualenv).

    python -m benchmarks.peers_child checkpoint FOLDER SIZE
        a transformers LlamaForCausalLM of SIZE (`SIZES`) with random
        weights, and a word-level tokenizer, saved in FOLDER
    python -m benchmarks.peers_child reference FOLDER PROMPTS_JSON NEW
        transformers' own greedy tokens of each prompt (one JSON line)
    python -m benchmarks.peers_child serve GENAI_FOLDER NEW
        onnxruntime-genai's model: one greedy generation per line of
        prompt ids read (JSON), its tokens and seconds written back

Imports only the standard library and the peers' packages.
"""

from __future__ import annotations

import json
import sys
import time

# name -> (hidden, layers, heads, kv_heads, intermediate, vocabulary)
SIZES = {
    "tiny": (256, 4, 4, 2, 512, 8000),
    "small": (512, 8, 8, 4, 1536, 16000),
    "153m": (768, 12, 12, 4, 3072, 32000),
}


def checkpoint(folder: str, size: str) -> None:
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    hidden, layers, heads, kv_heads, intermediate, vocabulary = SIZES[size]
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=vocabulary,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # random weights of a trained model's scale
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.normal_(0.0, 0.05)
    model.save_pretrained(folder, safe_serialization=True)
    words = ["<pad>", "<s>", "</s>", "<unk>"] + [f"w{i}" for i in range(vocabulary - 4)]
    tokenizer = Tokenizer(
        models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>")
    )
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
    )
    fast.save_pretrained(folder)


def reference(folder: str, prompts: list[list[int]], new: int) -> list[list[int]]:
    """transformers' greedy tokens, one prompt at a time."""
    import torch
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(folder).eval()
    rows = []
    with torch.no_grad():
        for prompt in prompts:
            out = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=0,
            )
            rows.append(out[0, len(prompt) :].tolist())
    return rows


def serve(genai_folder: str, new: int) -> None:
    import numpy as np
    import onnxruntime_genai as og

    model = og.Model(genai_folder)
    print(json.dumps({"ready": og.__version__}), flush=True)
    for line in sys.stdin:
        prompts = np.asarray(json.loads(line), np.int32)
        params = og.GeneratorParams(model)
        width = prompts.shape[1]
        params.set_search_options(
            do_sample=False,
            max_length=width + new,
            min_length=width + new,
            batch_size=prompts.shape[0],
        )
        start = time.perf_counter()
        generator = og.Generator(model, params)
        generator.append_tokens(prompts)
        while not generator.is_done():
            generator.generate_next_token()
        tokens = [
            [int(t) for t in generator.get_sequence(i)[width:]]
            for i in range(len(prompts))
        ]
        seconds = time.perf_counter() - start
        print(json.dumps({"tokens": tokens, "seconds": seconds}), flush=True)


def main(argv: list[str]) -> None:
    command, *args = argv
    if command == "checkpoint":
        checkpoint(args[0], args[1])
    elif command == "reference":
        print(json.dumps(reference(args[0], json.loads(args[1]), int(args[2]))))
    elif command == "serve":
        serve(args[0], int(args[1]))
    else:
        raise SystemExit(f"unknown command {command!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
