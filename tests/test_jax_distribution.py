"""SelfAttention under `keras.distribution` on JAX, on two virtual CPU devices.

JAX reads `XLA_FLAGS=--xla_force_host_platform_device_count=2` once, when it
starts, and Keras picks its backend once per process, so each run happens in
a fresh interpreter with `KERAS_BACKEND=jax` and that flag: this file run as
a script (`python tests/test_jax_distribution.py MODE`) is the worker; it
prints one `RESULT {json}` line that the tests below check.

- `data_parallel`: one `fit` step of a model (Embedding with padding,
  SelfAttention, Dense) on one device, then the same initial weights and
  batch under `DataParallel` over both devices: same loss, same weights.
- `model_parallel`: executes docs/distribution.md's
  Python block (ModelParallel with a LayoutMap that splits the heads), then
  checks that each attention weight is really split across the 2 devices,
  each holding whole heads, and that the loss and weights after its `fit`
  step equal a one-device run from the same seed.

The worker starts its own JAX process whatever the suite's backend, so it
runs in one suite (`one_suite`).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.one_suite(
    "spawns its own JAX processes", slow_suite="tensorflow"
)

PAGE = Path(__file__).resolve().parents[1] / "docs" / "distribution.md"
XLA_FLAGS = "--xla_force_host_platform_device_count=2"
LOSS_TOLERANCE = 1e-5
WEIGHT_TOLERANCE = 1e-6
TIMEOUT = 300  # seconds per worker; a run takes about 10 s
# The attention weights the documented layout map splits, and their head axis.
HEAD_AXES = {
    "attention/query_dense/kernel": 1,
    "attention/key_dense/kernel": 1,
    "attention/value_dense/kernel": 1,
    "attention/query_dense/bias": 0,
    "attention/key_dense/bias": 0,
    "attention/value_dense/bias": 0,
    "attention/output_dense/kernel": 0,
}


# ------------------------------------------------------------------ worker
def documented_block() -> str:
    """The ```python block of docs/distribution.md."""
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(), flags=re.S)
    assert len(blocks) == 1, f"{PAGE} should hold one Python block"
    return blocks[0]


def promised_prints(block: str) -> list[str]:
    """The `# text` after each `print(...)` line (tests/test_docs.py's rule)."""
    return [
        line.split("#", 1)[1].strip()
        for line in block.splitlines()
        if line.startswith("print(") and "#" in line
    ]


def max_weight_diff(first, second) -> float:
    """Largest |a - b| over two models' weights, in order."""
    return max(
        float(np.max(np.abs(np.asarray(a) - np.asarray(b)), initial=0.0))
        for a, b in zip(first.get_weights(), second.get_weights(), strict=True)
    )


def one_step(model, tokens: np.ndarray, labels: np.ndarray) -> float:
    """Runs one `fit` step on the whole batch; returns its loss."""
    history = model.fit(tokens, labels, batch_size=len(tokens), epochs=1, verbose=0)
    return float(history.history["loss"][0])


def device_count(variable) -> int:
    """How many devices hold (a part of) a Keras variable's JAX array."""
    return len(variable.value.sharding.device_set)


def describe_sharding(variable) -> dict:
    """How a variable's JAX array is laid out over the devices."""
    array = variable.value
    full = np.asarray(array)
    shards = sorted(array.addressable_shards, key=lambda shard: shard.device.id)
    return {
        "spec": str(array.sharding.spec),
        "devices": sorted(shard.device.id for shard in shards),
        "replicated": bool(array.sharding.is_fully_replicated),
        "shard_shapes": [list(shard.data.shape) for shard in shards],
        # Each device's block, read back, is the slice its index names.
        "blocks_match": all(
            np.array_equal(np.asarray(shard.data), full[shard.index])
            for shard in shards
        ),
        "indices": [[[s.start, s.stop] for s in shard.index] for shard in shards],
    }


def data_parallel() -> dict:
    """One-device step and DataParallel step from the same weights and batch."""
    import keras

    from keras_selfattn import SelfAttention

    def build_model() -> keras.Model:
        tokens = keras.Input((None,), dtype="int32", name="tokens")
        x = keras.layers.Embedding(1000, 32, mask_zero=True)(tokens)
        x = SelfAttention(num_heads=4, output_dim=32, use_bias=True)(x)
        x = keras.layers.GlobalAveragePooling1D()(x)
        probs = keras.layers.Dense(2, activation="softmax")(x)
        model = keras.Model(tokens, probs)
        model.compile(keras.optimizers.SGD(0.1), "sparse_categorical_crossentropy")
        return model

    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 1000, size=(8, 12)).astype("int32")
    tokens[::2, 7:] = 0
    labels = rng.integers(0, 2, size=(8,))
    keras.utils.set_random_seed(0)
    single = build_model()
    initial = single.get_weights()
    single_devices = device_count(single.weights[1])
    single_loss = one_step(single, tokens, labels)

    devices = keras.distribution.list_devices()
    keras.distribution.set_distribution(
        keras.distribution.DataParallel(devices=devices)
    )
    parallel = build_model()
    parallel.set_weights(initial)
    parallel_loss = one_step(parallel, tokens, labels)
    data_layout = keras.distribution.distribution().get_data_layout(tokens.shape)
    return {
        "devices": devices,
        "data_axes": list(data_layout.axes),
        "single_devices": single_devices,
        "parallel_devices": [device_count(w) for w in parallel.weights],
        "parallel_replicated": [
            bool(w.value.sharding.is_fully_replicated) for w in parallel.weights
        ],
        "single_loss": single_loss,
        "parallel_loss": parallel_loss,
        "max_weight_diff": max_weight_diff(single, parallel),
    }


def model_parallel() -> dict:
    """Executes the documented block, then compares with a one-device run."""
    block = documented_block()
    namespace: dict = {"__name__": "__readme__"}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(block, str(PAGE), "exec"), namespace)  # noqa: S102
    import keras

    model, build_model = namespace["model"], namespace["build_model"]
    tokens, labels = namespace["tokens"], namespace["labels"]
    sharding = {w.path: describe_sharding(w) for w in model.weights}
    # The same seed gives the same initial weights sharded or not ...
    keras.utils.set_random_seed(0)
    sharded_initial = build_model().get_weights()
    keras.distribution.set_distribution(None)
    keras.utils.set_random_seed(0)
    single = build_model()
    same_initial = all(
        np.array_equal(a, b)
        for a, b in zip(sharded_initial, single.get_weights(), strict=True)
    )
    # ... so one step from there must give the documented run's loss and weights.
    single_devices = device_count(single.weights[1])
    single_loss = one_step(single, tokens, labels)
    return {
        "printed": printed.getvalue().strip().splitlines(),
        "promised": promised_prints(block),
        "sharding": sharding,
        "weight_paths": [w.path for w in model.weights],
        "same_initial": same_initial,
        "single_devices": single_devices,
        "single_loss": single_loss,
        "parallel_loss": float(namespace["history"].history["loss"][0]),
        "max_weight_diff": max_weight_diff(single, model),
    }


def worker_main(mode: str) -> None:
    result = {"data_parallel": data_parallel, "model_parallel": model_parallel}[mode]()
    print("RESULT " + json.dumps(result), flush=True)


# ------------------------------------------------------------------ tests
def run_worker(mode: str) -> dict:
    """Runs this file as a JAX worker on 2 virtual CPUs; its RESULT dict."""
    env = dict(
        os.environ, KERAS_BACKEND="jax", XLA_FLAGS=XLA_FLAGS, TF_CPP_MIN_LOG_LEVEL="2"
    )
    result = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), mode],
        capture_output=True,
        text=True,
        env=env,
        timeout=TIMEOUT,
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    assert result.returncode == 0 and lines, (
        f"worker {mode} exited {result.returncode}\n{result.stdout[-3000:]}\n"
        f"{result.stderr[-3000:]}"
    )
    return json.loads(lines[-1].removeprefix("RESULT "))


class _Workers(dict):
    """{mode: Future of the worker's result}, each worker started when a test
    first asks for it: `make test` runs the model-parallel worker only."""

    def __init__(self, pool: ThreadPoolExecutor):
        super().__init__()
        self.pool = pool

    def __missing__(self, mode: str) -> Future:
        self[mode] = self.pool.submit(run_worker, mode)
        return self[mode]


@pytest.fixture(scope="module")
def workers() -> dict[str, Future]:
    """{mode: Future of the worker's result} (`_Workers`)."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        yield _Workers(pool)


@pytest.mark.slow  # two JAX worker interpreters
def test_data_parallel_step_gives_the_one_device_loss(workers):
    result = workers["data_parallel"].result()
    assert result["devices"] == ["cpu:0", "cpu:1"]
    assert result["single_devices"] == 1
    # DataParallel splits the batch over the devices and replicates every weight.
    assert result["data_axes"] == ["batch", None]
    assert set(result["parallel_devices"]) == {2}
    assert all(result["parallel_replicated"])
    assert result["parallel_loss"] == pytest.approx(
        result["single_loss"], rel=LOSS_TOLERANCE, abs=LOSS_TOLERANCE
    )
    assert result["max_weight_diff"] <= WEIGHT_TOLERANCE


@pytest.mark.slow  # a worker interpreter with two JAX devices: 24 s
def test_documented_model_parallel_block_prints_what_it_promises(workers):
    result = workers["model_parallel"].result()
    assert result["promised"], "the documented block promises no output"
    assert result["printed"][-len(result["promised"]) :] == result["promised"]


@pytest.mark.slow  # the same worker
def test_documented_layout_map_splits_the_heads_over_two_devices(workers):
    result = workers["model_parallel"].result()
    sharding = result["sharding"]
    assert set(HEAD_AXES) <= set(result["weight_paths"])
    for path, axis in HEAD_AXES.items():
        layout = sharding[path]
        assert layout["devices"] == [0, 1], path
        assert not layout["replicated"], path
        assert layout["blocks_match"], path
        # 4 heads of 8: device 0 holds heads 0-1 (0:16), device 1 heads 2-3.
        blocks = [index[axis] for index in layout["indices"]]
        assert blocks == [[0, 16], [16, 32]], (path, layout)
    # What the map does not name stays whole on both devices.
    for path in ("attention/output_dense/bias", "embedding/embeddings", "dense/kernel"):
        layout = sharding[path]
        assert layout["replicated"] and layout["devices"] == [0, 1], path


@pytest.mark.slow  # the same worker
def test_documented_model_parallel_step_gives_the_one_device_loss(workers):
    result = workers["model_parallel"].result()
    assert result["same_initial"]
    assert result["single_devices"] == 1
    assert result["parallel_loss"] == pytest.approx(
        result["single_loss"], rel=LOSS_TOLERANCE, abs=LOSS_TOLERANCE
    )
    assert result["max_weight_diff"] <= WEIGHT_TOLERANCE


if __name__ == "__main__":
    worker_main(sys.argv[1])
