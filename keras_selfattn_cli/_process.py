"""A command's process: signals, exit status, one error line, TensorFlow's log.

`run` runs one command and turns how it ended into an exit status: 0, 1 with
one line `keras-selfattn: error: ...` on stderr (never a traceback), 130 for
SIGINT, 143 for SIGTERM. Unless verbose, TensorFlow's native (C++) log, which
it writes straight to file descriptor 2 (oneDNN, CUDA and CPU-feature notices
while it is imported, and more while it works), is discarded so it cannot
bury that line. TensorFlow imported during the command runs without oneDNN's
ops unless the environment sets `TF_ENABLE_ONEDNN_OPTS`, as the package's
other processes that write exports do (`keras_selfattn.export.tensorflow_env`:
oneDNN's allocator keeps every block it once held).
"""

from __future__ import annotations

import contextlib
import gc
import os
import re
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Iterator

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


class CLIError(Exception):
    """A failure reported as one line, without a traceback."""


class Terminated(BaseException):
    """SIGTERM, raised like KeyboardInterrupt so every cleanup runs."""


# Exit status and message per signal. Python swallows an exception raised
# while a `__del__` runs ("Exception ignored in ..."), and libraries may wrap
# it in their own error, so the received signal is also recorded and decides
# the outcome whatever the work ended with.
_SIGNALS = {
    signal.SIGINT: (130, "interrupted", KeyboardInterrupt),
    signal.SIGTERM: (143, "terminated", Terminated),
}
# The signals received during the current `run` (signal handlers are
# process-wide, and so is this record; `check_signals` reads it between steps).
_RECEIVED: list[int] = []


def check_signals() -> None:
    """Raises KeyboardInterrupt if a signal arrived whose exception was
    swallowed: the command stops at its next step."""
    if _RECEIVED:
        raise KeyboardInterrupt


def one_line(error: BaseException) -> str:
    """A one-line description of `error` for the command line."""
    if isinstance(error, OSError) and error.strerror and error.filename:
        text = f"{error.strerror}: {error.filename}"
    else:
        text = str(error) or type(error).__name__
    return " ".join(_ANSI.sub("", text).split())


def run(command: Callable[[], int], *, prog: str, verbose: bool) -> int:
    """Runs `command` and returns the process's exit status.

    Args:
        command: the work; returns its exit status.
        prog: the name that starts the error line.
        verbose: keep TensorFlow's native log (else it is discarded, and
            `TF_CPP_MIN_LOG_LEVEL` is 2 unless set, for TensorFlow imported
            during the command). `TF_ENABLE_ONEDNN_OPTS` is 0 unless set,
            either way.

    Returns:
        `command`'s status; 1 if it raised (the error in one line on stderr,
        after its traceback and converter log when `verbose`, and a parity
        report it carries on stdout), 130 after SIGINT, 143 after SIGTERM.
    """
    received = _RECEIVED
    received.clear()
    status, message = 0, ""
    quiet = contextlib.nullcontext() if verbose else _native_log_discarded()
    with _variables(verbose), quiet, _signals_recorded(received) as disarm:
        stderr = sys.stderr
        try:
            status = command()
        except (KeyboardInterrupt, Terminated):
            if not received:  # raised without our handler (not the main thread)
                received.append(signal.SIGINT)
        except Exception as error:  # every failure ends in one line, no traceback
            if not received:
                if getattr(getattr(error, "report", None), "rows", ()):
                    print(error.report, flush=True)
                if verbose:  # what led to the line: tracebacks, converter logs
                    traceback.print_exception(error, file=stderr)
                    log = getattr(error, "log", "")
                    if log:
                        print(f"converter log:\n{log}", file=stderr, flush=True)
                status, message = 1, one_line(error)
        finally:
            disarm()
        if received:  # whatever the work ended with (see _SIGNALS)
            status, word, _ = _SIGNALS[received[0]]
            message = f"{word}; nothing partial was left on disk"
        if status:
            print(f"{prog}: error: {message}", file=stderr, flush=True)
        return status


@contextlib.contextmanager
def _signals_recorded(received: list[int]) -> Iterator[Callable[[], None]]:
    """Appends SIGINT/SIGTERM to `received` and raises their exception.

    Yields a function that stops the raising (once the work is over, a
    signal is only recorded, so it cannot escape `run` as a traceback).
    After a signal, what Python and libraries print about the cut-off work
    would bury the one line that `run` prints to the stream it saved, so it
    is silenced until the end: `sys.stderr` (a SystemError from a C
    callback), and exceptions ignored in a `__del__` through
    `sys.unraisablehook`, which a library restoring `sys.stderr` on its way
    out (`contextlib.redirect_stderr`) cannot undo. Objects the cut-off work
    left in reference cycles are collected before the end, while silenced.
    """
    armed = [True]
    if threading.current_thread() is not threading.main_thread():
        yield armed.clear
        return
    original, unraisable = sys.stderr, sys.unraisablehook
    quiet = open(os.devnull, "w")

    def handler(signum, frame):
        received.append(signum)
        sys.stderr = quiet
        if armed:
            raise _SIGNALS[signum][2]

    def report_unless_signalled(report) -> None:
        if not received:
            unraisable(report)

    previous = {signum: signal.signal(signum, handler) for signum in _SIGNALS}
    sys.unraisablehook = report_unless_signalled
    try:
        yield armed.clear
    finally:
        if received:
            gc.collect()
        for signum, action in previous.items():
            signal.signal(signum, action)
        sys.stderr, sys.unraisablehook = original, unraisable
        quiet.close()


# The package's TensorFlow processes that write exports run without oneDNN's
# ops (`keras_selfattn.export.tensorflow_env`, not imported here: it imports
# Keras, and the variable must be set before TensorFlow is imported).
_ONEDNN = "TF_ENABLE_ONEDNN_OPTS"


@contextlib.contextmanager
def _variables(verbose: bool) -> Iterator[None]:
    """While active, each unless set: `TF_ENABLE_ONEDNN_OPTS` 0 and, unless
    `verbose`, `TF_CPP_MIN_LOG_LEVEL` 2 (for TensorFlow imported meanwhile)."""
    defaults = {_ONEDNN: "0", **({} if verbose else {"TF_CPP_MIN_LOG_LEVEL": "2"})}
    unset = [name for name in defaults if name not in os.environ]
    os.environ.update({name: defaults[name] for name in unset})
    try:
        yield
    finally:
        for name in unset:
            os.environ.pop(name, None)


@contextlib.contextmanager
def _native_log_discarded() -> Iterator[None]:
    """Points fd 2 at /dev/null (Python's `sys.stderr` keeps the real one).

    `TF_CPP_MIN_LOG_LEVEL` alone is not enough: TensorFlow 2.21 prints its
    oneDNN and CUDA notices while it is imported whatever its value.
    """
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        python_uses_fd2 = sys.stderr.fileno() == 2
    except (AttributeError, OSError, ValueError):  # e.g. replaced by pytest
        python_uses_fd2 = False
    original = sys.stderr
    if python_uses_fd2:
        sys.stderr = os.fdopen(os.dup(saved), "w", buffering=1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        if python_uses_fd2:
            sys.stderr.close()
            sys.stderr = original
