"""`keras_selfattn.tracing`: the tracing modes set, nest, reset and stay in
their thread; an unknown mode is refused by name."""

import threading

import pytest

from keras_selfattn import tracing


def test_modes_nest_and_reset():
    assert not any(tracing.active(mode) for mode in tracing.MODES)
    with tracing.traced_as(tracing.FOR_CONVERTER):
        with tracing.traced_as(tracing.FOR_CONVERTER, tracing.EXACT_UNCHUNKED):
            assert tracing.active(tracing.FOR_CONVERTER)
            assert tracing.active(tracing.EXACT_UNCHUNKED)
        assert tracing.active(tracing.FOR_CONVERTER)
        assert not tracing.active(tracing.EXACT_UNCHUNKED)
    assert not any(tracing.active(mode) for mode in tracing.MODES)


def test_a_mode_holds_only_in_the_thread_that_set_it():
    seen = []
    with tracing.traced_as(tracing.EXACT_UNCHUNKED):
        thread = threading.Thread(
            target=lambda: seen.append(tracing.active(tracing.EXACT_UNCHUNKED))
        )
        thread.start()
        thread.join()
        assert tracing.active(tracing.EXACT_UNCHUNKED)
    assert seen == [False]


def test_an_unknown_mode_is_refused_before_any_is_set():
    with pytest.raises(ValueError, match="mode='time_minor'"):
        with tracing.traced_as(tracing.FOR_CONVERTER, "time_minor"):
            pass
    assert not tracing.active(tracing.FOR_CONVERTER)
    with pytest.raises(ValueError, match="`mode` must be one of"):
        tracing.active("time_minor")
