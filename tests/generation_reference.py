"""Independent numpy references for generation, written from the specs in
`keras_selfattn.generation` (random_stream, sampling, loop docstrings),
sharing no code with the package.

- `uniform`: the counter-based stream with Python's exact integers.
- `next_token`: greedy / temperature / top-k / top-p / inverse-CDF pick.
- `uncached`: generation that re-runs the model's full forward on each
  row's own unpadded sequence at every step: no cache, no padding.
- `generator_request`: an exported generator's inputs for those prompts.
"""

from __future__ import annotations

import keras
import numpy as np

M = 2**31 - 1


CONSTANTS = (625341585, 1481765933, 335903614, 1812433253, 666578662, 374761393)


def uniform(seed: int, row: int, step: int) -> np.float32:
    x, constants = 0, iter(CONSTANTS)
    for value in (seed % M, row, step):
        x = (x + value) % M
        for _ in range(2):
            x = pow((x + next(constants)) % M, 5, M)
    return np.float32((x >> 7) / 2**24)


def _softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp((z - z.max()).astype(np.float32))
    return (e / e.sum()).astype(np.float32)


def next_token(logits, u, temperature=0.0, top_k=0, top_p=1.0) -> int:
    logits = np.asarray(logits, np.float32)
    if temperature == 0:
        return int(np.argmax(logits))
    z = logits / np.float32(temperature)
    if top_k > 0:
        kth = np.sort(z)[::-1][min(top_k, z.size) - 1]
        z = np.where(z >= kth, z, -np.inf).astype(np.float32)
    p = _softmax(z)
    descending = np.sort(p)[::-1]
    before = np.cumsum(descending, dtype=np.float32) - descending
    smallest = descending[before < np.float32(top_p)].min()
    z = np.where(p >= smallest, z, -np.inf).astype(np.float32)
    p = _softmax(z)
    cumulative = np.cumsum(p, dtype=np.float32)
    picked = int((cumulative <= np.float32(u) * cumulative[-1]).sum())
    return min(picked, int(np.flatnonzero(p > 0).max()))


def uncached(model, prompts, steps, *, seed=0, end_token=None, **controls):
    """Token rows: (tokens, lengths) as `generate` defines them, -1 after an
    end. Each step runs the model's full forward on every row's whole
    sequence so far, right-padded to one width (a causal model's position
    t does not see what follows it), and reads the row's last position."""
    tokens = np.full((len(prompts), steps), -1, np.int32)
    lengths = np.zeros(len(prompts), np.int32)
    sequences = [list(prompt) for prompt in prompts]
    width = max(len(prompt) for prompt in prompts) + steps
    for step in range(steps):
        padded = np.zeros((len(prompts), width), np.int32)
        for row, sequence in enumerate(sequences):
            padded[row, : len(sequence)] = sequence
        logits = keras.ops.convert_to_numpy(model.predict_on_batch(padded))
        for row, sequence in enumerate(sequences):
            if step and tokens[row, step - 1] == end_token:
                continue
            if step and tokens[row, step - 1] == -1:
                continue
            token = next_token(
                logits[row, len(sequence) - 1], uniform(seed, row, step), **controls
            )
            tokens[row, step] = token
            lengths[row] += 1
            sequence.append(token)
    return tokens, lengths


def uncached_values(model, prompts, steps) -> np.ndarray:
    """Value rows: the output at the last position, fed back, `steps` times."""
    rows = []
    for prompt in prompts:
        sequence = np.asarray(prompt, np.float32)
        new = []
        for _ in range(steps):
            output = keras.ops.convert_to_numpy(model(sequence[None]))[0, -1]
            new.append(output)
            sequence = np.concatenate([sequence, output[None]], axis=0)
        rows.append(np.stack(new))
    return np.stack(rows)


def generator_request(prompts, steps, vocabulary, controls=None) -> dict:
    """An exported generator's inputs (module doc of
    `keras_selfattn.export.generator`): `prompts` right-padded, greedy
    unless `controls` say otherwise."""
    padded = np.zeros((len(prompts), max(map(len, prompts))), np.int32)
    for row, prompt in enumerate(prompts):
        padded[row, : len(prompt)] = prompt
    values = {
        "temperature": 0.0,
        "top_k": vocabulary,
        "top_p": 1.0,
        "seed": 0,
        "end_token": -1,
    }
    values.update(controls or {})
    dtypes = {"temperature": "float32", "top_p": "float32"}
    return {
        "prompt_tokens": padded,
        "prompt_lengths": np.array([len(p) for p in prompts], np.int32),
        "max_new_tokens": np.array(steps, np.int32),
        **{k: np.array(v, dtypes.get(k, "int32")) for k, v in values.items()},
    }
