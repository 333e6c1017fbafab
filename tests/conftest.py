"""Shared pytest setup: the Keras backend, quiet TensorFlow, float32 policy.

KERAS_BACKEND is used as given (tensorflow, jax or torch) and defaults to
tensorflow. Tests marked `tensorflow_only("why")` need TensorFlow itself
(SavedModel, tf2onnx, tf.distribute, TF Serving, tf.function graphs): on other
backends they are skipped with that reason.

Tests marked `one_suite("why")` start their own interpreters for fixed
backends, so their result does not depend on the suite's backend: they run in
the KERAS_BACKEND=torch suite only (the lightest of the three), or wherever
KERAS_SELFATTN_ONE_SUITE=1 is set.

Tests marked `fast_on(BACKEND, "why")` check on the other backends what their
run on BACKEND checks in `make test`, at several times its cost (exports
through jax2tf, say): off BACKEND they are `slow` (run by `make test-slow`).
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import pytest  # noqa: E402

from tests.backend import BACKEND  # noqa: E402

ONE_SUITE_BACKEND = "torch"


def _reason(item, marker) -> str:
    reason = marker.args[0] if marker.args else marker.kwargs.get("reason")
    if not reason:
        raise pytest.UsageError(
            f"{item.nodeid}: give {marker.name} a reason, e.g. "
            f'@pytest.mark.{marker.name}("SavedModel export")'
        )
    return reason


def _skip_off_the_one_suite(items) -> None:
    if BACKEND == ONE_SUITE_BACKEND or os.environ.get("KERAS_SELFATTN_ONE_SUITE"):
        return
    for item in items:
        marker = item.get_closest_marker("one_suite")
        if marker is not None:
            item.add_marker(
                pytest.mark.skip(
                    reason=f"runs in the KERAS_BACKEND={ONE_SUITE_BACKEND} suite "
                    f"only (its own interpreters): {_reason(item, marker)}"
                )
            )


def _slow_off_their_fast_backend(items) -> None:
    for item in items:
        marker = item.get_closest_marker("fast_on")
        if marker is None:
            continue
        if len(marker.args) != 2 or marker.args[0] not in (
            "tensorflow",
            "jax",
            "torch",
        ):
            raise pytest.UsageError(
                f'{item.nodeid}: use @pytest.mark.fast_on("tensorflow", "why")'
            )
        if marker.args[0] != BACKEND:
            item.add_marker(pytest.mark.slow)


# Before `-m "not slow"` deselects: the slow mark must be there by then.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Skips `tensorflow_only` tests off TensorFlow and `one_suite` tests off
    the one suite, saying why; marks `fast_on` tests slow off their
    backend."""
    _skip_off_the_one_suite(items)
    _slow_off_their_fast_backend(items)
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
