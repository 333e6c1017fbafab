"""`benchmarks.matmul_bound`: the kernel shapes it multiplies are a
keras-hub Llama's own (its 2-D kernels, EinsumDense's flattened), and its
compiled step runs on the current backend."""

from __future__ import annotations

import collections
import math

import numpy as np
import pytest

from benchmarks import matmul_bound

pytestmark = pytest.mark.slow_on(
    "jax", "a keras-hub Llama built, compiled op by op; the other suites check it"
)


def test_llama_kernels_are_keras_hubs_kernel_shapes():
    import keras_hub

    sizes = dict(hidden=64, heads=4, kv_heads=2, layers=3, intermediate=96)
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=120,
        num_layers=sizes["layers"],
        num_query_heads=sizes["heads"],
        num_key_value_heads=sizes["kv_heads"],
        hidden_dim=sizes["hidden"],
        intermediate_dim=sizes["intermediate"],
    )
    lm = keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)
    found = []
    for weight in lm.weights:
        shape = tuple(weight.shape)
        if (
            len(shape) < 2
            or "embeddings" in weight.path
            and "reverse" not in weight.path
        ):
            continue  # norms, and the token table (gathered, not multiplied)
        if "attention_output" in weight.path:  # (heads, head_dim, hidden)
            found.append((shape[0] * shape[1], shape[2]))
        else:  # (in, out) or (in, heads, head_dim)
            found.append((shape[0], math.prod(shape[1:])))
    expected = matmul_bound.llama_kernels(**sizes, vocabulary=120)
    assert collections.Counter(found) == collections.Counter(expected)


def test_steps_per_second_runs_compiled():
    shapes = matmul_bound.llama_kernels(32, 4, 2, 2, 64, 100)
    rate = matmul_bound.steps_per_second(shapes, batch=2, rounds=2)
    assert np.isfinite(rate) and rate > 0, rate
