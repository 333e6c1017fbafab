"""Decoding under hostile input: an error naming the input, or NaN, never
finite wrong numbers.

What is guaranteed, and tested here on every backend, eager and compiled
(`tests.backend.compiled`), and on exported decode steps in a fresh process:
- every integer `cache_update_index` (Python, numpy, 0-d int32/int64 tensor)
  decodes alike; a float, bool or non-scalar one is a ValueError;
- where the index and shapes are known (eagerly, or static under a trace), an
  index out of range, an input/cache batch mismatch, a non-float cache or one
  of another dtype than the compute dtype is a ValueError naming them;
- where they are only known when the step runs: TensorFlow graphs and the
  SavedModel step raise InvalidArgument (the SavedModel also enforces its
  declared cache dimensions); under `jax.jit` and in the ONNX step the
  outputs are NaN and the cache comes back unchanged (ONNX Runtime itself
  refuses a cache of other dimensions, and more new positions than fit);
- NaN or inf at positions no query attends (padded inputs, cache slots not
  written yet, padded cache slots) changes no output, on every path; at a
  position a query attends it propagates, as in any attention.
"""

from __future__ import annotations

import json
import subprocess
import sys

import keras
import numpy as np
import pytest
from keras import ops

from keras_selfattn import SelfAttention
from tests.backend import BACKEND, compiled, to_numpy
from tests.decode_step_runtimes import PRELUDE
from tests.preferred_path import preferred

# JAX without x64 truncates an int64 tensor to int32 (and warns).
pytestmark = pytest.mark.filterwarnings("ignore:Explicitly requested dtype int64")

RNG = np.random.default_rng(18)
X = RNG.normal(size=(2, 8, 8)).astype("float32")
MAX_LENGTH = 8
PATHS = ["explicit", "chunked", "fused"]


def _layer(**kwargs) -> SelfAttention:
    keras.utils.set_random_seed(18)
    layer = SelfAttention(**{"num_heads": 2, "key_dim": 4, "causal": True, **kwargs})
    layer.build(X.shape)
    return layer


def _prefilled(layer, batch: int = 2, length: int = 3):
    """The cache after a cached call over the first `length` positions."""
    _, cache = layer(
        X[:batch, :length],
        cache=layer.empty_cache(batch, MAX_LENGTH),
        cache_update_index=0,
    )
    return to_numpy(cache)


def _skip_unserved(path: str) -> None:
    if path == "fused" and BACKEND == "tensorflow":
        pytest.skip("TensorFlow has no fused attention kernel")


INTEGER_INDICES = {
    "int": lambda i: i,
    "np.int32": np.int32,
    "np.int64": np.int64,
    "0-d np.int64 array": lambda i: np.asarray(i, np.int64),
    "int32 tensor": lambda i: ops.convert_to_tensor(i, "int32"),
    "int64 tensor": lambda i: ops.convert_to_tensor(i, "int64"),
}


# -------------------------------------------------------------- eager calls
@pytest.mark.slow_on("jax", "a decode compiled per index type")
@pytest.mark.parametrize("kind", list(INTEGER_INDICES))
def test_every_integer_index_type_decodes_alike(kind):
    layer = _layer(rope_max_wavelength=100.0)
    full = to_numpy(layer(X))
    cache = _prefilled(layer)
    output, _ = layer(
        X[:, 3:5], cache=cache, cache_update_index=INTEGER_INDICES[kind](3)
    )
    np.testing.assert_allclose(to_numpy(output), full[:, 3:5], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["0-d np.int64 array", "int32 tensor", "int64 tensor"])
def test_a_tensor_index_is_read_once_per_call(kind, monkeypatch):
    """Reading a tensor index's value waits for the device (a host sync):
    every backend reads it in `cache.checks._known_value`, once per cached
    call."""
    from keras_selfattn.attention.cache import checks as cache_lib

    layer = _layer(rope_max_wavelength=100.0)
    full = to_numpy(layer(X))
    cache = _prefilled(layer)
    reads, original = [], cache_lib._known_value

    def spy(index):
        reads.append(index)
        return original(index)

    monkeypatch.setattr(cache_lib, "_known_value", spy)
    index = INTEGER_INDICES[kind](3)
    output, _ = layer(X[:, 3:5], cache=cache, cache_update_index=index)
    assert len(reads) == 1, reads
    np.testing.assert_allclose(to_numpy(output), full[:, 3:5], atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(BACKEND != "torch", reason="PyTorch tensor methods")
def test_eager_torch_cached_call_reads_the_index_tensor_once():
    """On eager PyTorch every read of a tensor's value (`item`, `int`, ...)
    is a host sync: a cached call makes exactly one, of its index."""
    import torch

    host_reads = {"item", "tolist", "numpy", "__int__", "__index__", "__bool__"}
    reads = []

    class CountingIndex(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            if getattr(func, "__name__", None) in host_reads:
                reads.append(func.__name__)
            return super().__torch_function__(func, types, args, kwargs or {})

    layer = _layer(rope_max_wavelength=100.0)
    full = to_numpy(layer(X))
    cache = _prefilled(layer)
    index = torch.tensor(3, dtype=torch.int32).as_subclass(CountingIndex)
    assert int(index) == 3 and reads == ["__int__"]  # the counter counts
    reads.clear()
    output, _ = layer(X[:, 3:5], cache=cache, cache_update_index=index)
    assert len(reads) == 1, reads
    np.testing.assert_allclose(to_numpy(output), full[:, 3:5], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "index",
    [
        5.7,
        3.0,
        True,
        np.float32(3),
        np.bool_(True),
        [3],
        np.asarray([3], np.int32),
        "3",
        None,
    ],
    ids=repr,
)
def test_float_bool_and_non_scalar_indices_are_value_errors(index):
    layer = _layer()
    with pytest.raises(ValueError, match="cache_update_index"):
        layer(
            X[:, :1], cache=layer.empty_cache(2, MAX_LENGTH), cache_update_index=index
        )


@pytest.mark.parametrize("dtype", ["float32", "bool"])
def test_float_and_bool_index_tensors_are_value_errors(dtype):
    layer = _layer()
    index = ops.convert_to_tensor(np.asarray(1, dtype))
    with pytest.raises(ValueError, match=r"cache_update_index=.*" + dtype):
        layer(
            X[:, :1], cache=layer.empty_cache(2, MAX_LENGTH), cache_update_index=index
        )


@pytest.mark.parametrize("kind", list(INTEGER_INDICES))
@pytest.mark.parametrize(("index", "new"), [(-1, 1), (8, 1), (7, 2), (0, 9)])
def test_known_index_out_of_range_is_a_value_error(kind, index, new):
    layer = _layer()
    x = np.concatenate([X, X], axis=1)[:, :new]
    with pytest.raises(ValueError, match=f"cache_update_index={index}"):
        layer(
            x,
            cache=layer.empty_cache(2, MAX_LENGTH),
            cache_update_index=INTEGER_INDICES[kind](index),
        )


@pytest.mark.parametrize(
    ("cache", "message"),
    [
        (np.zeros((1, 2, 8, 2, 4), "float32"), r"batch size of the inputs \(2\)"),
        (np.zeros((3, 2, 8, 2, 4), "float32"), r"cache.shape=\(3, 2, 8, 2, 4\)"),
        (np.zeros((2, 2, 8, 2, 4), "int32"), "cache.dtype=int32"),
        (np.zeros((2, 2, 8, 2, 4), "bool"), "cache.dtype=bool"),
        (np.zeros((2, 2, 8, 2, 4), "float16"), "cache.dtype=float16"),
    ],
)
def test_cache_batch_and_dtype_are_value_errors(cache, message):
    layer = _layer()
    with pytest.raises(ValueError, match=message):
        layer(X[:, :1], cache=cache, cache_update_index=0)
    with pytest.raises(ValueError, match=message):
        compiled(lambda x, c: layer(x, cache=c, cache_update_index=0))(X[:, :1], cache)


# ----------------------------------------------------------- compiled calls
def _traced_step(layer):
    return compiled(lambda x, c, i: layer(x, cache=c, cache_update_index=i))


@pytest.mark.parametrize(("index", "new"), [(-1, 1), (8, 1), (7, 2)])
def test_traced_index_out_of_range_fails_loudly(index, new):
    """TensorFlow graphs raise; XLA under jax.jit returns NaN and the cache
    unchanged; torch (eager under `compiled`) raises the ValueError."""
    layer = _layer()
    step = _traced_step(layer)
    cache = _prefilled(layer)
    full = to_numpy(layer(X))
    good, _ = step(X[:, 3:4], cache, np.int32(3))  # the same trace, in range
    np.testing.assert_allclose(to_numpy(good), full[:, 3:4], atol=1e-5, rtol=1e-5)
    x = X[:, :new]
    if BACKEND == "tensorflow":
        import tensorflow as tf

        with pytest.raises(tf.errors.InvalidArgumentError, match="cache_update_index"):
            step(x, cache, np.int32(index))
    elif BACKEND == "jax":
        output, updated = step(x, cache, np.int32(index))
        assert np.isnan(to_numpy(output)).all()
        np.testing.assert_array_equal(to_numpy(updated), cache)
    else:
        with pytest.raises(ValueError, match=f"cache_update_index={index}"):
            step(x, cache, np.int32(index))


def _assert_nan_and_cache_kept(step, reference, index_tensor) -> None:
    """`step` (x, cache, index) decodes in range, and returns NaN and the cache
    unchanged for each index out of range."""
    layer_full, cache = reference
    good, _ = step(X[:, 3:5], cache, index_tensor(3))
    np.testing.assert_allclose(to_numpy(good), layer_full[:, 3:5], atol=1e-5, rtol=1e-5)
    for index in (-1, 8, 7):
        output, updated = step(X[:, 3:5], cache, index_tensor(index))
        assert np.isnan(to_numpy(output)).all(), index
        np.testing.assert_array_equal(to_numpy(updated), cache)


def _reference_step(compile_fn):
    layer = _layer()
    step = compile_fn(lambda x, c, i: layer(x, cache=c, cache_update_index=i))
    cache = _prefilled(layer)
    cache[:, :, 5:] = np.nan  # unwritten slots, ignored
    return step, (to_numpy(layer(X)), cache)


@pytest.mark.tensorflow_only("XLA through tf.function(jit_compile=True)")
def test_xla_compiled_tf_step_returns_nan_and_keeps_the_cache():
    """XLA drops TensorFlow's asserts: the step falls back to NaN."""
    import tensorflow as tf

    step, reference = _reference_step(lambda f: tf.function(f, jit_compile=True))
    _assert_nan_and_cache_kept(step, reference, lambda i: tf.constant(i, tf.int32))


@pytest.mark.slow
def test_torch_compiled_step_returns_nan_and_keeps_the_cache():
    """torch.compile traces the index (minutes on a CPU: slow suite)."""
    if BACKEND != "torch":
        pytest.skip("torch.compile")
    import torch

    # Earlier compiled tests of this process may have spent dynamo's
    # recompilation limit on SelfAttention.__call__, after which it runs the
    # frame eagerly (and raises, as eager calls do).
    torch._dynamo.reset()
    step, reference = _reference_step(lambda f: torch.compile(f, dynamic=True))
    _assert_nan_and_cache_kept(
        step, reference, lambda i: torch.tensor(i, dtype=torch.int32)
    )


@pytest.mark.tensorflow_only("a graph with a dynamic batch size")
def test_tf_graph_checks_batch_and_cache_shape_when_it_runs():
    import tensorflow as tf

    layer = _layer()
    step = tf.function(
        lambda x, c, i: layer(x, cache=c, cache_update_index=i),
        input_signature=[
            tf.TensorSpec((None, None, 8)),
            tf.TensorSpec((None, 2, MAX_LENGTH, 2, 4)),
            tf.TensorSpec((), tf.int32),
        ],
    )
    cache = _prefilled(layer)
    with pytest.raises(tf.errors.InvalidArgumentError, match="batch must be the cache"):
        step(X[:1, :1], cache, 3)
    with pytest.raises(tf.errors.InvalidArgumentError, match="batch must be the cache"):
        step(X[:, :1], cache[:1], 3)
    with pytest.raises(tf.errors.InvalidArgumentError, match="cache_update_index"):
        step(X[:, :6], cache, 3)


# ------------------------------------------------------ non-finite isolation
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("bad", [np.nan, np.inf])
@pytest.mark.parametrize("trace", [False, True], ids=["eager", "compiled"])
def test_non_finite_padded_inputs_change_no_output(path, bad, trace):
    _skip_unserved(path)
    layer = _layer(use_bias=True)
    mask = np.ones((2, 8), bool)
    mask[1, :3] = False  # left padding
    mask[0, 6:] = False  # right padding
    hostile = X.copy()
    hostile[~mask] = bad
    run = (compiled if trace else lambda f: f)(lambda x, m: layer(x, mask=m))
    with preferred(path):
        clean, dirty = to_numpy(run(X, mask)), to_numpy(run(hostile, mask))
    np.testing.assert_array_equal(dirty[~mask], 0.0)
    np.testing.assert_allclose(dirty, clean, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(
    ("path", "new"), [("explicit", 2), ("fused", 2), ("single_query", 1)]
)
@pytest.mark.parametrize("bad", [np.nan, -np.inf])
@pytest.mark.parametrize("trace", [False, True], ids=["eager", "compiled"])
def test_non_finite_unwritten_cache_slots_change_no_output(path, new, bad, trace):
    _skip_unserved(path)
    layer = _layer(num_key_value_heads=1)
    full = to_numpy(layer(X))
    cache = _prefilled(layer)
    cache[:, :, 3 + new :] = bad  # written by later steps only
    step = _traced_step(layer) if trace else None
    x = X[:, 3 : 3 + new]
    with preferred(path):
        if step is None:
            output, updated = layer(x, cache=cache, cache_update_index=3)
        else:
            output, updated = step(x, cache, np.int32(3))
    np.testing.assert_allclose(
        to_numpy(output), full[:, 3 : 3 + new], atol=1e-5, rtol=1e-5
    )
    updated = to_numpy(updated)
    # as given
    np.testing.assert_array_equal(updated[:, :, 3 + new :], cache[:, :, 3 + new :])


@pytest.mark.parametrize("path", ["explicit", "fused", "single_query"])
def test_non_finite_padded_cache_slots_change_no_output(path):
    _skip_unserved(path)
    layer = _layer()
    mask = np.ones((2, MAX_LENGTH), bool)
    mask[1, :2] = False
    full = to_numpy(layer(X, mask=mask))
    with preferred(path):
        _, cache = layer(
            X[:, :3],
            mask=mask,
            cache=layer.empty_cache(2, MAX_LENGTH),
            cache_update_index=0,
        )
        cache = to_numpy(cache)
        cache[1, :, :2] = np.nan
        output, _ = layer(X[:, 3:4], mask=mask, cache=cache, cache_update_index=3)
    np.testing.assert_allclose(to_numpy(output), full[:, 3:4], atol=1e-5, rtol=1e-5)


def test_non_finite_attended_positions_propagate():
    """A NaN key or value a query attends makes that query's output NaN, as in
    any attention (the other sequences of the batch are unaffected)."""
    layer = _layer()
    hostile = X.copy()
    hostile[0, 2] = np.nan
    output = to_numpy(layer(hostile))
    assert np.isnan(output[0, 2:]).all() and np.isfinite(output[1]).all()
    cache = _prefilled(layer)
    cache[0, 1, 1] = np.inf  # the value of written position 1, sequence 0
    output, _ = layer(X[:, 3:4], cache=cache, cache_update_index=3)
    output = to_numpy(output)
    assert not np.isfinite(output[0]).any() and np.isfinite(output[1]).all()


# ------------------------------------------------- exported decode steps
_FRESH = (
    PRELUDE
    + r"""
cases = arrays

results = {}
for case in names:
    feed = {k: cases[f"{case}/{k}"] for k in ("x", "cache_attn", "cache_update_index")}
    for runtime, run in (("saved_model", saved_model), ("onnx", onnx)):
        try:
            out = run(feed)
        except Exception as error:
            results[f"{runtime} {case}"] = {"error": f"{type(error).__name__}: {error}"}
            continue
        output, cache = out["attn"], out["updated_cache_attn"]
        result = {"all_nan": bool(np.isnan(output).all()),
                  "unchanged": cache.shape == feed["cache_attn"].shape
                  and bool(np.array_equal(cache, feed["cache_attn"], equal_nan=True))}
        if f"{case}/expected" in cases:
            result["err"] = float(np.abs(output - cases[f"{case}/expected"]).max())
        results[f"{runtime} {case}"] = result
assert "keras_selfattn" not in sys.modules
print(json.dumps(results))
"""
)

# name -> (new positions from x, index, cache), the cache from `_export_cases`.
OUT_OF_RANGE = {"index -1": (1, -1), "index 8": (1, 8), "index 7 new 2": (2, 7)}


def _export_cases(layer) -> dict[str, np.ndarray]:
    """The inputs of every exported case, and the clean outputs expected."""
    full = to_numpy(layer(X))
    cache = _prefilled(layer)
    rng = np.random.default_rng(0)
    arrays = {}

    def case(name, x, cache, index, expected=None):
        arrays[f"{name}/x"] = x
        arrays[f"{name}/cache_attn"] = cache
        arrays[f"{name}/cache_update_index"] = np.asarray(index, np.int32)
        if expected is not None:
            arrays[f"{name}/expected"] = expected

    case("clean", X[:, 3:5], cache, 3, full[:, 3:5])
    random_cache = rng.normal(size=cache.shape).astype("float32")
    for name, (new, index) in OUT_OF_RANGE.items():
        case(name, X[:, :new], random_cache, index)
    case("too many new", np.concatenate([X, X[:, :1]], 1), cache, 0)
    case("x batch 1, cache 2", X[:1, 3:4], cache, 3)
    case("x batch 2, cache 1", X[:, 3:4], cache[:1], 3)
    wide = np.zeros((2, 2, MAX_LENGTH + 1, 2, 4), "float32")
    case("cache max_length 9", X[:, :1], wide, 0)
    case("cache 3 heads", X[:, :1], np.zeros((2, 2, MAX_LENGTH, 3, 4), "float32"), 0)
    for bad in ("nan", "inf"):
        hostile = cache.copy()
        hostile[:, :, 5:] = float(bad)
        case(f"{bad} in unwritten slots", X[:, 3:5], hostile, 3, full[:, 3:5])
    nan_everywhere = np.full(cache.shape, np.nan, "float32")
    case("nan in the slot written", X[:, :1], nan_everywhere, 0, full[:, :1])
    return arrays


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """One exported decode step (SavedModel and ONNX), run on every case in a
    fresh interpreter that does not import keras_selfattn."""
    from keras_selfattn.export import decode_step as ds

    tmp = tmp_path_factory.mktemp("decode")
    layer = _layer(name="attn")
    inputs = keras.Input((None, 8), name="x")
    model = keras.Model(inputs, layer(inputs))
    saved = ds.export_decode_step_saved_model(
        model, tmp / "serving", "m", max_length=MAX_LENGTH, check=False
    )
    onnx_path = ds.export_decode_step_onnx(
        model, tmp / "m.onnx", max_length=MAX_LENGTH, check=False
    )
    arrays = _export_cases(layer)
    np.savez(tmp / "cases.npz", **arrays)
    names = sorted({key.split("/")[0] for key in arrays})
    result = subprocess.run(
        [sys.executable, "-c", _FRESH, str(tmp / "cases.npz"), saved, onnx_path]
        + [json.dumps(names)],
        capture_output=True,
        text=True,
        timeout=180,
        env={"TF_CPP_MIN_LOG_LEVEL": "3", "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


EXPORT_ONLY = pytest.mark.tensorflow_only("decode-step export is a tf.function")
# One exported step run on every case in a fresh process: 12 s of make test
# on 2 shared AVX2 cores; the slow suite's (CI's TensorFlow one).
EXPORTED = pytest.mark.slow


@EXPORT_ONLY
@EXPORTED
@pytest.mark.parametrize("runtime", ["saved_model", "onnx"])
def test_exported_step_decodes_clean_input(exported, runtime):
    assert exported[f"{runtime} clean"]["err"] < 1e-5, exported


@EXPORT_ONLY
@EXPORTED
@pytest.mark.parametrize(
    "case", [*OUT_OF_RANGE, "too many new", "x batch 1, cache 2", "x batch 2, cache 1"]
)
def test_saved_model_step_raises_invalid_argument(exported, case):
    error = exported[f"saved_model {case}"].get("error", "")
    assert error.startswith("InvalidArgumentError"), exported[f"saved_model {case}"]
    assert "cache_update_index" in error and "batch must be the cache" in error


@EXPORT_ONLY
@EXPORTED
@pytest.mark.parametrize("case", [*OUT_OF_RANGE, "x batch 1, cache 2"])
def test_onnx_step_returns_nan_and_keeps_the_cache(exported, case):
    assert exported[f"onnx {case}"] == {"all_nan": True, "unchanged": True}


@EXPORT_ONLY
@EXPORTED
@pytest.mark.parametrize(
    "case",
    ["too many new", "x batch 2, cache 1", "cache max_length 9", "cache 3 heads"],
)
def test_onnx_step_refuses_what_cannot_fit(exported, case):
    """ONNX Runtime raises: the cache's declared dimensions, or a write larger
    than the cache (never a silently dropped position)."""
    result = exported[f"onnx {case}"]
    assert "error" in result or result == {"all_nan": True, "unchanged": True}, result
    if "max_length" in case or "heads" in case:
        assert "cache_attn" in result["error"], result


@EXPORT_ONLY
@EXPORTED
@pytest.mark.parametrize("case", ["cache max_length 9", "cache 3 heads"])
def test_saved_model_step_enforces_cache_dimensions(exported, case):
    error = exported[f"saved_model {case}"].get("error", "")
    assert error.startswith("InvalidArgumentError"), exported[f"saved_model {case}"]
    assert "`cache` must have shape (None, 2, 8, 2, 4)" in error


@EXPORT_ONLY
@EXPORTED
@pytest.mark.parametrize("runtime", ["saved_model", "onnx"])
@pytest.mark.parametrize(
    "case",
    ["nan in unwritten slots", "inf in unwritten slots", "nan in the slot written"],
)
def test_exported_step_ignores_non_finite_unattended_slots(exported, runtime, case):
    result = exported[f"{runtime} {case}"]
    assert result.get("err", np.inf) < 1e-5, result
