"""Packed calls (`segment_ids`) on every path, against the float64 reference.

Seeded random configurations, the same on every run: rows packed with
distinct or recurring ids, one-position segments, a segment wholly padded,
a padding mask that ends inside a segment, random padding and rows with
nothing real; causal, sliding windows, grouped-query heads, rotary, and
every score modification (ALiBi, T5's relative bias, sinks, the soft-cap,
an `attention_bias`) with or without an `attention_mask`. Each
configuration calls, with the same weights, a layer with a random
`chunk_size`, one with the layer's defaults, and the latter with
`return_attention_scores=True` (the explicit path, its weights compared
too), each against `tests/reference.py` in float64. A few rows are long
enough (256 positions and more) for the layer's defaults to take the
packed path too, with the block it chooses. One configuration in five also
checks a gradient: the derivative of a random projection of the output
along a random direction of the input and of every weight, against the
reference's central difference in float64.

The configurations come in four families that steer them to the packed
path's strategies where sizes may vary (TensorFlow's eager calls, PyTorch):
ids that make one run each (the runs), ids that come back later in their
row (the pairs), an `attention_bias` or an `attention_mask` (the loop over
key blocks, and in training the chunked path); on JAX, whose calls here are
compiled (`jax.jit`), every packed call takes the loop.
`test_the_configurations_reach_every_strategy` checks that they do. In the
slow suite, TensorFlow's training gradients of the runs' family are
computed in a function XLA compiles (the loop, with its own gradient).
"""

from __future__ import annotations

import collections
import contextlib

import keras
import numpy as np
import pytest

from keras_selfattn import SelfAttention
from keras_selfattn.attention.packed import loop, own_gradient, pairs, runs
from tests import reference
from tests.backend import BACKEND, compiled, to_numpy, value_and_grad

# float32 layer vs float64 reference; inputs and weights are O(1).
TOLERANCE = {"rtol": 1e-4, "atol": 2e-5}
FAMILIES = ("runs", "pairs", "bias", "attention_mask")
FAST_CASES = range(40)
SLOW_CASES = range(40, 64)
# JAX compiles each call (a second or two a configuration): its `make test`
# runs these, which reach each strategy, and the rest in its slow suite.
JAX_FAST = (0, 1, 8, 14, 17, 19, 34, 39)
# How a row is padded, and how often.
PADDINGS = {"none": 0.15, "tail": 0.4, "segment": 0.25, "full": 0.05, "random": 0.15}
# Cases whose rows are long enough for the defaults' packed path (one of
# the runs' family, one of the pairs').
LONG = (8, 17)

# (strategy or path, "forward" or "gradient") -> calls, over the cases run.
_REACHED: collections.Counter = collections.Counter()
_RAN: set[int] = set()


def _recurs(ids, real) -> bool:
    """Whether an id makes two runs among the real positions of a row."""
    starts = real & np.concatenate([[True], (ids[1:] != ids[:-1]) | ~real[:-1]])
    runs = ids[starts]
    return len(set(runs.tolist())) < len(runs)


def _row(rng, time: int, family: str):
    """One row's ids (int32) and real positions (bool), as `family` asks."""
    sizes = [1, 1, 2, 3, 4, 6, 9] if time < 100 else [1, 2, 5, 17, 40, 90]
    lengths = []
    while sum(lengths) < time:
        lengths.append(int(rng.choice(sizes)))
    lengths[-1] -= sum(lengths) - time
    count = len(lengths)
    if family == "pairs" or (family != "runs" and rng.random() < 0.5):
        ids = rng.integers(0, 3, count)  # an id may come back later
    else:
        ids = rng.permutation(2 * count)[:count]  # distinct, in any order
    # The runs' family keeps every id in one run: no hole inside a segment.
    kinds = [k for k in PADDINGS if family != "runs" or k != "random"]
    odds = np.array([PADDINGS[k] for k in kinds])
    kind = rng.choice(kinds, p=odds / odds.sum())
    real = np.ones(time, bool)
    starts = np.cumsum([0] + lengths[:-1])
    if kind == "tail":  # the mask ends inside a segment where one can
        inside = [
            s + k for s, n in zip(starts, lengths, strict=True) for k in range(1, n)
        ]
        real[int(rng.choice(inside)) if inside else int(rng.integers(time)) :] = False
    elif kind == "segment":
        which = int(rng.integers(count))
        real[starts[which] : starts[which] + lengths[which]] = False
    elif kind == "full":
        real[:] = False
    elif kind == "random":
        real = rng.random(time) < 0.7
    return np.repeat(ids, lengths).astype("int32"), real


def _config(rng, time: int) -> dict:
    """A layer's arguments (no `chunk_size`)."""
    kv_heads = int(rng.choice([1, 2]))
    causal = bool(rng.random() < 0.5)
    config = {
        "num_heads": kv_heads * int(rng.choice([1, 2])),
        "num_key_value_heads": kv_heads,
        "key_dim": 2 * int(rng.integers(1, 4)),
        "value_dim": rng.choice([None, int(rng.integers(1, 6))]),
        "output_dim": rng.choice([None, 5]),
        "use_bias": bool(rng.random() < 0.5),
        "use_gate": bool(rng.random() < 0.2),
        "scale": rng.choice([None, float(rng.uniform(0.2, 1.5))]),
        "causal": causal,
        "sliding_window": rng.choice([None, int(rng.integers(1, time + 2))]),
        "rope_max_wavelength": rng.choice([None, None, 30.0]),
        "use_sinks": bool(rng.random() < 0.4),
        "logit_soft_cap": rng.choice([None, float(rng.uniform(0.7, 3.0))]),
    }
    bias = rng.choice([None, "alibi", "relative"])
    if bias is not None:
        config["position_bias"] = str(bias)
    if bias == "relative":
        buckets = int(rng.integers(4, 12))
        exact = (buckets if causal else buckets // 2) // 2
        config["relative_attention_num_buckets"] = buckets
        config["relative_attention_max_distance"] = exact + int(rng.integers(1, 8))
    return config


def _case(index: int) -> dict:
    """Configuration `index`: the layer's arguments, its `chunk_size`, the
    input, the call's arguments, and how its gradient is checked, if it is."""
    rng = np.random.default_rng([46, index])
    family = FAMILIES[index % len(FAMILIES)]
    long = index % 20 in LONG
    batch = 1 if long else int(rng.integers(1, 4))
    # An id comes back in a row of at least three positions.
    shortest = 3 if family == "pairs" else 1
    time = int(rng.integers(256, 320) if long else rng.integers(shortest, 25))
    config = _config(rng, time)
    features = int(rng.integers(2, 9))
    rows = [_row(rng, time, family) for _ in range(batch)]
    while family == "pairs" and not any(_recurs(*row) for row in rows):
        rows = [_row(rng, time, family) for _ in range(batch)]
    call = {
        "segment_ids": np.stack([ids for ids, _ in rows]),
        "mask": np.stack([real for _, real in rows]),
    }
    heads = config["num_heads"]
    if family == "bias" or (family == "attention_mask" and rng.random() < 0.5):
        shapes = [(batch, heads, time, time), (batch, 1, time, time)]
        shapes += [(1, heads, time, time), (batch, 1, 1, time)]
        shape = shapes[int(rng.integers(len(shapes)))]
        call["attention_bias"] = rng.normal(size=shape).astype("float32")
    if family == "attention_mask":
        call["attention_mask"] = rng.random((batch, time, time)) < 0.7
    # Cases 4, 9, 14, ... check a gradient: in eight cases in turn, each
    # family in training then not, of the layer with `chunk_size` but in
    # the runs' and pairs' families out of training.
    turn = (index // 5) % 8 if index % 5 == 4 else None
    return {
        "config": config,
        "chunk_size": int(rng.integers(max(1, time // 4), time + 3)),
        "x": rng.normal(size=(batch, time, features)).astype("float32"),
        "call": call,
        "rng": rng,
        "gradient": turn is not None,
        "training": turn is not None and turn < 4,
        "gradient_of_chunked": turn is not None and turn not in (4, 5),
        "runs_in_training": turn == 0,
    }


@contextlib.contextmanager
def _counting(phase: str):
    """Counts, in `_REACHED`, the packed strategies the calls made within
    take (a compiled function counts when it is traced)."""
    patch = pytest.MonkeyPatch()
    targets = [
        (runs, "runs_attention", "runs"),
        (pairs, "pairs_attention", "pairs"),
        (loop, "loop_attention", "loop"),
        (own_gradient, "gradients", "loop's own gradient"),
    ]
    for module, name, strategy in targets:
        original = getattr(module, name)

        def counted(*args, _original=original, _strategy=strategy, **kwargs):
            _REACHED[_strategy, phase] += 1
            return _original(*args, **kwargs)

        patch.setattr(module, name, counted)
    try:
        yield
    finally:
        patch.undo()


def _layers(case: dict):
    """The layer with the case's `chunk_size` and one with the defaults,
    built, with the same random weights."""
    features = case["x"].shape[-1]
    # Built with zeros, not random draws (which JAX compiles for each new
    # shape), then given the case's weights.
    config = {**case["config"], "kernel_initializer": "zeros"}
    chunked = SelfAttention(**config, chunk_size=case["chunk_size"])
    default = SelfAttention(**config)
    for layer in (chunked, default):
        layer.build((None, None, features))
    rng = case["rng"]
    values = [rng.normal(scale=0.5, size=w.shape) for w in chunked.get_weights()]
    for layer in (chunked, default):
        layer.set_weights([v.astype("float32") for v in values])
    return chunked, default


def _tensors(call: dict) -> dict:
    return {k: keras.ops.convert_to_tensor(v) for k, v in call.items()}


def _called(layer, x, call: dict, **arguments):
    """`layer(x, **call, **arguments)`: compiled on JAX (whose eager calls
    compile each operation anew), eager elsewhere (where the packed path's
    sizes may vary)."""

    def fn(x, tensors):
        return layer(x, **tensors, **arguments)

    if BACKEND == "jax":
        fn = compiled(fn)
    return fn(x, _tensors(call))


def _reference(layer, x, call: dict, weights=None):
    return reference.for_layer(
        layer,
        x,
        weights,
        padding_mask=call["mask"],
        attention_mask=call.get("attention_mask"),
        attention_bias=call.get("attention_bias"),
        segment_ids=call["segment_ids"],
    )


def _check_outputs(case: dict, chunked, default) -> None:
    x, call = case["x"], case["call"]
    want, want_weights = _reference(chunked, x, call)
    for label, layer in (("chunk_size", chunked), ("defaults", default)):
        _REACHED[f"{layer.implementation(x, **call)} ({label})", "forward"] += 1
        np.testing.assert_allclose(to_numpy(_called(layer, x, call)), want, **TOLERANCE)
    assert default.implementation(x, return_attention_scores=True, **call) == (
        "explicit"
    )
    _REACHED["explicit", "forward"] += 1
    output, weights = _called(default, x, call, return_attention_scores=True)
    np.testing.assert_allclose(to_numpy(output), want, **TOLERANCE)
    np.testing.assert_allclose(to_numpy(weights), want_weights, **TOLERANCE)


def _compiled_value_and_grad(loss, variables, x, call: dict):
    """`value_and_grad` of `loss(x, call)` compiled: by XLA on TensorFlow
    (the call's tensors arguments, as a training step takes them), by
    `jax.jit` on JAX."""
    if BACKEND == "tensorflow":
        import tensorflow as tf

        @tf.function(jit_compile=True)
        def gradients(x, tensors):
            with tf.GradientTape() as tape:
                tape.watch(x)
                value = loss(x, tensors)
            grads = tape.gradient(value, [v.value for v in variables] + [x])
            return value, [tf.convert_to_tensor(g) for g in grads]

        value, grads = gradients(tf.constant(x), _tensors(call))
        return value.numpy(), [g.numpy() for g in grads]
    import jax

    tensors = _tensors(call)

    def pure(values, x):
        mapping = list(zip(variables, values, strict=True))
        with keras.StatelessScope(state_mapping=mapping):
            return loss(x, tensors)

    value, grads = jax.jit(jax.value_and_grad(pure, argnums=(0, 1)))(
        [v.value for v in variables], x
    )
    return to_numpy(value), [to_numpy(g) for g in (*grads[0], grads[1])]


def _check_gradient(case: dict, layer, xla: bool) -> None:
    """The derivative of `sum(projection * output)` along a random
    direction of the input and every weight, against the reference's."""
    x, call, training = case["x"], case["call"], case["training"]
    rng = np.random.default_rng(int(x.size))
    names = list(reference.layer_weights(layer))
    weights = {
        n: w.astype(np.float64) for n, w in zip(names, layer.get_weights(), strict=True)
    }
    directions = {n: rng.normal(size=w.shape) for n, w in weights.items()}
    direction_x = rng.normal(size=x.shape)

    def reference_output(step: float):
        moved = {n: w + step * directions[n] for n, w in weights.items()}
        return _reference(layer, x + step * direction_x, call, moved)[0]

    output = reference_output(0.0)
    projection = rng.normal(size=output.shape)

    def loss(inputs, tensors):
        output = layer(inputs, training=training, **tensors)
        return keras.ops.sum(keras.ops.cast(projection, "float32") * output)

    variables = layer.trainable_weights
    assert len(variables) == len(layer.weights)  # every weight is trainable
    if not xla:  # XLA's calls, sizes fixed, may take another path
        _REACHED[layer.implementation(x, training=training, **call), "gradient"] += 1
    if xla or BACKEND == "jax":
        value, grads = _compiled_value_and_grad(loss, variables, x, call)
    else:
        tensors = _tensors(call)
        value, grads = value_and_grad(lambda x: loss(x, tensors), variables, [x])
    got = sum(
        np.sum(np.asarray(g, np.float64) * d)
        for g, d in zip(grads, [*directions.values(), direction_x], strict=True)
    )
    step = 1e-6
    moved = reference_output(step) - reference_output(-step)
    want = np.sum(projection * moved) / (2 * step)
    np.testing.assert_allclose(value, np.sum(projection * output), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def _check(index: int, xla_gradients: bool = False) -> None:
    _RAN.add(index)
    case = _case(index)
    chunked, default = _layers(case)
    with _counting("forward"):
        _check_outputs(case, chunked, default)
    if case["gradient"]:
        layer = chunked if case["gradient_of_chunked"] else default
        xla = xla_gradients and BACKEND == "tensorflow" and case["runs_in_training"]
        with _counting("gradient"):
            _check_gradient(case, layer, xla)


def _fast_on_jax(index: int):
    if index in JAX_FAST:
        return index
    return pytest.param(
        index, marks=pytest.mark.slow_on("jax", "a compiled call per path")
    )


@pytest.mark.parametrize("index", [_fast_on_jax(i) for i in FAST_CASES])
def test_packed_calls_match_the_reference(index):
    _check(index)


@pytest.mark.slow
@pytest.mark.parametrize("index", SLOW_CASES)
def test_packed_calls_match_the_reference_long(index):
    _check(index, xla_gradients=True)


# What the fast cases reach on each backend: where sizes may vary, the runs
# and the pairs, the loop (an attention_bias or attention_mask) and, in
# training, the chunked path; on JAX the loop, with its own gradient unless
# a learned modification needs the loop differentiated.
_STRATEGIES = {
    "tensorflow": {
        ("runs", "forward"),
        ("pairs", "forward"),
        ("loop", "forward"),
        ("explicit", "forward"),
        ("packed (defaults)", "forward"),
        ("runs", "gradient"),
        ("pairs", "gradient"),
        ("loop", "gradient"),
        ("loop's own gradient", "gradient"),
        ("chunked", "gradient"),
    },
    "torch": {
        ("runs", "forward"),
        ("pairs", "forward"),
        ("loop", "forward"),
        ("explicit", "forward"),
        ("packed (defaults)", "forward"),
        ("runs", "gradient"),
        ("pairs", "gradient"),
        ("loop", "gradient"),
        ("chunked", "gradient"),
    },
    "jax": {
        ("loop", "forward"),
        ("explicit", "forward"),
        ("packed (defaults)", "forward"),
        ("loop", "gradient"),
        ("loop's own gradient", "gradient"),
        ("chunked", "gradient"),
    },
}


def test_the_configurations_reach_every_strategy():
    fast = set(JAX_FAST if BACKEND == "jax" else FAST_CASES)
    if not fast <= _RAN:
        pytest.skip("counts what the fast cases reached: run them first")
    missing = _STRATEGIES[BACKEND] - set(_REACHED)
    assert not missing, (missing, dict(_REACHED))
