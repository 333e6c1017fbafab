"""Shared pytest setup: the Keras backend, quiet TensorFlow, float32 policy.

KERAS_BACKEND is used as given (tensorflow, jax or torch) and defaults to
tensorflow. Tests marked `tensorflow_only("why")` need TensorFlow itself
(SavedModel, tf2onnx, tf.distribute, TF Serving, tf.function graphs): on other
backends they are skipped with that reason.

Tests marked `one_suite("why")` start their own interpreters for fixed
backends, so their result does not depend on the suite's backend: they run in
the KERAS_BACKEND=torch suite only (the lightest of the three), or wherever
KERAS_SELFATTN_ONE_SUITE=1 is set. `one_suite("why", slow_suite="jax")` runs
the test's slow cases in that backend's slow suite instead, to balance the
three slow suites, which run in parallel.

Tests (or parameters) marked `slow_on("jax", "why")` are `slow` (run by `make
test-slow`) on the backends named, fast on the others: for checks that cost
several times more there (JAX's eager calls compile every new shape; its
SavedModel goes through jax2tf) while the other backends check the same in
`make test`.
"""

import gc
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
# JAX compiles every eager op anew for each new shape, and the suite's shapes
# are tiny: LLVM's optimization of that code costs more CPU than it saves
# (about a quarter of the JAX suite), and so do XLA's MLIR fusion emitters,
# the CPU default: the older emitters compile in about 0.55x the CPU (JAX's
# eager tests 0.7x). XLA's graph passes still run; only the machine-code
# optimization is skipped and fusions take the older emitters. Read when JAX
# starts its backend, so set before Keras imports it;
# KERAS_SELFATTN_XLA_OPTIMIZE=1 keeps XLA's defaults.
if os.environ["KERAS_BACKEND"] == "jax" and not os.environ.get(
    "KERAS_SELFATTN_XLA_OPTIMIZE"
):
    os.environ["XLA_FLAGS"] = " ".join(
        [
            os.environ.get("XLA_FLAGS", ""),
            "--xla_backend_optimization_level=0",
            "--xla_llvm_disable_expensive_passes=true",
            "--xla_cpu_use_fusion_emitters=false",
        ]
    ).strip()

import keras  # noqa: E402
import pytest  # noqa: E402

from tests.backend import BACKEND  # noqa: E402

# The float32 checks against numpy mean float32 arithmetic, which a GPU's
# matmuls skip by default on JAX (TF32 on an H100: off by up to 2e-3), so
# the test session asks for full float32 matmuls (the layer itself keeps
# the backend's defaults). On the CPU neither setting changes a result.
if BACKEND == "jax":
    import jax

    jax.config.update("jax_default_matmul_precision", "highest")
elif BACKEND == "torch":
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False

ONE_SUITE_BACKEND = "torch"
BACKENDS = {"tensorflow", "jax", "torch"}


def _reason(item, marker) -> str:
    reason = marker.args[0] if marker.args else marker.kwargs.get("reason")
    if not reason:
        raise pytest.UsageError(
            f"{item.nodeid}: give {marker.name} a reason, e.g. "
            f'@pytest.mark.{marker.name}("SavedModel export")'
        )
    return reason


def _skip_off_the_one_suite(items) -> None:
    if os.environ.get("KERAS_SELFATTN_ONE_SUITE"):
        return
    for item in items:
        marker = item.get_closest_marker("one_suite")
        if marker is None:
            continue
        suite = ONE_SUITE_BACKEND
        if item.get_closest_marker("slow") is not None:
            suite = marker.kwargs.get("slow_suite", ONE_SUITE_BACKEND)
        if suite not in BACKENDS:
            raise pytest.UsageError(f"{item.nodeid}: slow_suite={suite!r}")
        if BACKEND != suite:
            item.add_marker(
                pytest.mark.skip(
                    reason=f"runs in the KERAS_BACKEND={suite} suite "
                    f"only (its own interpreters): {_reason(item, marker)}"
                )
            )


def _slow_where_marked(items) -> None:
    for item in items:
        for marker in item.iter_markers("slow_on"):
            *backends, reason = marker.args or (None,)
            if not backends or not reason or not set(backends) <= BACKENDS:
                raise pytest.UsageError(
                    f'{item.nodeid}: use @pytest.mark.slow_on("jax", "why")'
                )
            if BACKEND in backends:
                item.add_marker(pytest.mark.slow)


# Before `-m "not slow"` deselects: the slow mark must be there by then.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Skips `tensorflow_only` tests off TensorFlow and `one_suite` tests off
    the one suite, saying why; marks `slow_on` tests slow on their
    backends."""
    _skip_off_the_one_suite(items)
    _slow_where_marked(items)
    for item in items:
        marker = item.get_closest_marker("tensorflow_only")
        if marker is None:
            continue
        reason = _reason(item, marker)
        if BACKEND != "tensorflow":
            item.add_marker(
                pytest.mark.skip(
                    reason=f"needs TensorFlow itself: {reason} "
                    f"(KERAS_BACKEND={BACKEND})"
                )
            )


@pytest.fixture(scope="module", autouse=True)
def _frozen_heap():
    """Before each module: collects the garbage, then moves every object still
    alive (TensorFlow, JAX, torch, ONNX and the test modules, what earlier
    modules cached: millions of objects that live until the end) out of the
    garbage collector's sight. Keras runs a full collection each time a layer
    drops a variable (every Dense that `quantize` rewrites), and Python runs
    its own as objects pile up: each walked that whole heap again, seconds
    apiece late in a suite. What the module creates is still collected (the
    previous module's fixtures are torn down before this one runs)."""
    gc.collect()
    gc.freeze()
    yield


@pytest.fixture(autouse=True)
def _float32_policy():
    """Every test starts and ends with the float32 policy."""
    keras.mixed_precision.set_global_policy("float32")
    yield
    keras.mixed_precision.set_global_policy("float32")


@pytest.fixture(params=["explicit", "chunked", "fused"])
def every_path(request):
    """Runs a test once per attention path: within it, every call takes that
    path wherever the path can serve it (`tests.preferred_path.preferred`).
    Modules opt in with `pytestmark = pytest.mark.usefixtures("every_path")`."""
    from tests.preferred_path import preferred

    if request.param == "fused" and BACKEND == "tensorflow":
        pytest.skip("TensorFlow has no fused attention kernel")
    with preferred(request.param):
        yield request.param
