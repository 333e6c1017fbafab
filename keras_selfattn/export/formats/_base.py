"""What every export format implements, and the refusals they share.

A `Format` is one row of `table` plus how it writes: which options it
takes (`check_options`), which form quantized layers are traced in
(`quantized_form`), and `write`, which converts a `Signature` into an
artifact in a staging folder. Staging, verification and moving into place
are the pipeline's, the same for every format.

A conversion runs inside `converting`: what the converter prints (on
Python's streams or straight to file descriptors 1 and 2, as TensorFlow's
C++ and MLIR do) is kept, not shown, and a failure becomes one line, an
`ExportError` naming the format, the cause and what to do, whose
`__cause__` is the converter's own exception and whose `log` holds what it
printed.

TensorFlow's `tf.custom_gradient`, traced into a graph, registers its
gradient function in TensorFlow's process-wide gradient registry under a
new name and never removes it (tensorflow/tensorflow#97697, #27492). The
function holds the traced tensors, and through them the whole graph:
every `tf.nn.silu` (the feed-forward layers of keras-hub's Llama, Mistral
and Gemma call it) keeps the graph it was traced in alive for the life of
the process. An export differentiates none of the graphs it traces (the
artifact's function, the loop a generator's check runs as the reference,
the SavedModel a LiteRT file is converted from), so `released` drops the
registrations made within it and, for a model of `COLLECTED_BYTES` of
weights or more, collects and gives the freed memory back to the system:
before the fresh-process check (`pipeline.stage`), and before LiteRT's
converter starts beside the model (`formats.litert_signatures`;
docs/export.md, "Large models").
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import dataclasses
import gc
import importlib
import io
import logging
import math
import os
import re
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator, Mapping

import keras
import numpy as np

from keras_selfattn.export import _files
from keras_selfattn.export.signature import Signature
from keras_selfattn_runtimes.table import FormatRow

# Writes a target's artifact at a staged path with the format's options:
# `Format.write`, or another process's writer (`export.generator._writer`).
Writer = Callable[[Signature, str, Mapping[str, object]], None]


class ExportError(RuntimeError):
    """A converter could not write a model: one line saying why and what to do.

    Attributes:
        log: What the converter printed while it ran ("" if nothing).
    """

    def __init__(self, message: str, log: str = ""):
        super().__init__(message)
        self.log = log


@dataclasses.dataclass(frozen=True)
class Destination:
    """A checked export destination.

    Attributes:
        format: The format's name (`table.NAMES`).
        path: The SavedModel base dir, or the file.
        options: The format's checked options (`Format.check_options`).
        version_dir: The SavedModel's version folder it would write now.
    """

    format: str
    path: str
    options: Mapping[str, object] = dataclasses.field(default_factory=dict)
    version_dir: str | None = None


def one_line(error: BaseException | str, limit: int = 300) -> str:
    """The error's message on one line, at most `limit` characters."""
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


@contextlib.contextmanager
def _output_kept(log: io.StringIO) -> Iterator[None]:
    """Sends file descriptors 1 and 2, Python's streams, warnings and logging
    into `log` while the block runs."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    root = logging.getLogger()
    handler = logging.StreamHandler(log)
    with tempfile.TemporaryFile(mode="w+b") as capture:
        os.dup2(capture.fileno(), 1)
        os.dup2(capture.fileno(), 2)
        previous = root.handlers[:], root.level
        root.handlers = [handler]
        try:
            with (
                contextlib.redirect_stdout(log),
                contextlib.redirect_stderr(log),
                warnings.catch_warnings(),
            ):
                warnings.simplefilter("ignore")
                yield
        finally:
            root.handlers, _ = previous
            for fd, copy in zip((1, 2), saved, strict=True):
                os.dup2(copy, fd)
                os.close(copy)
            capture.seek(0)
            log.write(capture.read().decode(errors="replace"))


@contextlib.contextmanager
def converting(title: str, advice: str) -> Iterator[None]:
    """Runs a conversion quietly; a failure becomes one `ExportError` line.

    Args:
        title: The format's title, which starts the message.
        advice: What to do, appended to the cause.
    """
    log = io.StringIO()
    try:
        with _output_kept(log):
            yield
    except (ExportError, KeyboardInterrupt):
        raise
    except Exception as error:
        raise ExportError(
            f"{title} conversion failed: {cause(error, log.getvalue())}; {advice}",
            log.getvalue(),
        ) from error


# Lines that say why a converter failed, most telling first (a regex
# each): what it could not convert, then any error line. The first line
# of the exception stands in when none matches.
# Protobuf's and FlatBuffers' limit on one serialized message (an ONNX file,
# a frozen GraphDef, a LiteRT file).
MESSAGE_LIMIT = 2**31
# Weights from which a file keeps them apart (ONNX external data, LiteRT
# buffers after the flatbuffer): the rest of the limit is the graph's.
APART_BYTES = MESSAGE_LIMIT - 2**27


def weight_bytes(target: Signature) -> int:
    """The bytes of the weights of the target's model."""
    return model_weight_bytes(target.model)


def model_weight_bytes(model: keras.Model) -> int:
    """The bytes of `model`'s weights."""
    return sum(
        math.prod(weight.shape) * np.dtype(weight.dtype).itemsize
        for weight in model.weights
    )


# How `tf.custom_gradient` names the gradients it registers in a graph.
_CUSTOM_GRADIENT = "CustomGradient-"
# A full collection takes about 0.2 s in a process holding TensorFlow and
# Keras, longer as it grows: under this much weight, the dropped graphs are
# left to Python's own collections.
COLLECTED_BYTES = 2**27


def _gradient_registry() -> dict | None:
    """TensorFlow's gradient functions by name (private: no public route
    removes one), or None where TensorFlow is not imported or holds no
    such registry."""
    ops = sys.modules.get("tensorflow.python.framework.ops")
    registry = getattr(getattr(ops, "_gradient_registry", None), "_registry", None)
    return registry if isinstance(registry, dict) else None


@contextlib.contextmanager
def released(model: keras.Model) -> Iterator[None]:
    """Within the context, graphs of `model` may be traced; after it, the
    custom gradients they registered are dropped, and where the model
    holds `COLLECTED_BYTES` of weights or more, the memory they held goes
    back to the system (`return_freed_memory`)."""
    before = set(_gradient_registry() or ())
    try:
        yield
    finally:
        registry = _gradient_registry()
        if registry is not None:
            for name in [n for n in registry if n not in before]:
                if name.startswith(_CUSTOM_GRADIENT):
                    del registry[name]
        if model_weight_bytes(model) >= COLLECTED_BYTES:
            return_freed_memory()


def return_freed_memory() -> None:
    """Collects reference cycles and gives the memory this process freed
    back to the system (glibc's `malloc_trim`; nothing elsewhere)."""
    gc.collect()
    name = ctypes.util.find_library("c")
    try:
        ctypes.CDLL(name).malloc_trim(0)
    except (OSError, AttributeError, TypeError):  # not glibc
        pass


_CAUSES = (
    r"No conversion rule found for operations: .*",
    r"Select TensorFlow op\(s\).*",
    r"Exporting the operator .* is not supported.*",
    r"(?i:error): .*",
)


# A native (absl) log line of TensorFlow or XLA, such as "E0000 00:00:... ]
# failed call to cuInit: ... CUDA error": what the process printed on the
# side, never why a conversion failed.
_NATIVE_LOG = re.compile(r"^\s*[IWEF]\d{4} \d\d:\d\d:\d\d")


def cause(error: BaseException, log: str) -> str:
    """The line that says why a converter failed.

    Converters bury it: TensorFlow's converter among its MLIR diagnostics,
    OpenVINO under "Check 'false' failed" and a summary, torch.onnx after
    its frames. The first line matching `_CAUSES` (in that order of
    preference) is chosen, else the exception's first line.
    """
    lines = [
        line.strip()
        for line in (str(error) + "\n" + log).splitlines()
        if line.strip() and "Traceback" not in line and not _NATIVE_LOG.match(line)
    ]
    for pattern in _CAUSES:
        for line in lines:
            found = re.search(pattern, line)
            if found:
                text = found.group(0)
                if text.lower().startswith("error:"):
                    text = text[len("error:") :]
                return one_line(text, 200)
    return one_line(lines[0] if lines else type(error).__name__, 200)


class Format:
    """An export format: its table row and how it writes an artifact.

    Subclasses set `row` and implement `write`; those with options override
    `check_options`.

    Attributes:
        row: The format's `table.FormatRow`.
        quantized_form: How quantized layers are traced for this format
            (`quantization.VARIABLES` or `quantization.CONSTANTS`).
        advice: What to do when its converter fails (ends `ExportError`).
    """

    row: FormatRow
    quantized_form: str
    advice: str = "export the model to another format, or as .keras"

    @property
    def name(self) -> str:
        return self.row.name

    def require(self, backend: str | None = None) -> None:
        """Refuses a backend Keras has no route on, or a missing package.

        Args:
            backend: The backend that writes the artifact (default: this
                process's).

        Raises:
            ValueError: one line naming the backend and the way that works.
            ImportError: one line naming the missing package and its extra.
        """
        backend = backend or keras.backend.backend()
        refusal = self.row.refusal(backend)
        if refusal is not None:
            raise ValueError(refusal)
        modules = self.row.packages + tuple(self.row.backend_packages.get(backend, ()))
        for module in modules:
            try:
                importlib.import_module(module)
            except ImportError as error:
                raise ImportError(
                    f"{self.row.title} export needs {module} ({error}). "
                    f"Install it with: pip install 'keras_selfattn[{self.row.extra}]'"
                ) from error

    def check_options(
        self, options: Mapping[str, object], backend: str | None = None
    ) -> dict[str, object]:
        """The format's options, checked (none by default) for the backend
        that writes the artifact (`require`'s `backend`). Here: any option
        set that the format's row does not name is refused; a format that
        takes options checks their values after this.

        Raises:
            ValueError: for an option the format does not take.
        """
        for name, value in options.items():
            if name in self.row.options:
                continue
            if value is not None and value is not False:
                raise ValueError(
                    f"{self.row.title} export takes no `{name}`. "
                    f"Received: {name}={value!r}"
                )
        return {}

    def files(self, path: str) -> list[str]:
        """The files an artifact at `path` consists of."""
        return [path]

    def check_artifact(self, path: str) -> None:
        """Raises FileNotFoundError unless an artifact is at `path` (before
        a check runs it)."""
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{self.row.artifact} file not found: {path}")

    def runtime_options(self, keywords: Mapping[str, object]) -> dict[str, object]:
        """The options a check passes to this format's runtime module
        (`row.runtime_module`'s `load`), from the check's runtime keywords
        (`verify`'s `openvino_precision`): none by default. Every format
        sees every keyword, and checks those it reads.

        Raises:
            ValueError: naming the keyword and the value it refuses.
        """
        return {}

    def generator_runtime(
        self, path: str, options: Mapping[str, object]
    ) -> tuple[dict[str, object], str | None]:
        """The runtime options a generator's check runs the artifact at
        `path` with, from its `options`, and the report's note on why they
        differ, if they do: `options` as given by default."""
        return dict(options), None

    def generator_rows(self, path: str) -> int | None:
        """The most rows a request of a generator's check may hold for the
        artifact at `path` (the runtime's memory): None, any, by default."""
        return None

    def expected_generator_rows(self, weights: int) -> int | None:
        """`generator_rows` of the artifact of a model of `weights` bytes
        of float32 weights, before it is written (the check's references
        are computed while a converter runs): None by default."""
        return None

    def runtime_label(self, options: Mapping[str, object]) -> str:
        """The report's label of this format's artifact run with the
        `runtime_options` `options`: the format's name by default."""
        return self.name

    def label(self, destination: Destination, signature_name: str) -> str:
        """The line the command line prints while it stages `destination`
        (`signature_name`: the target's)."""
        detail = self.detail(destination.options)
        return f"Exporting {self.row.title}{detail} to {destination.path}"

    def detail(self, options: Mapping[str, object]) -> str:
        """What `label` says of the checked `options` (" (...)"), or ""."""
        return ""

    def messages(
        self, options: Mapping[str, object]
    ) -> contextlib.AbstractContextManager[list[str]]:
        """A context collecting lines to show about a write with the checked
        `options` (none by default), shown even when the write fails."""
        return contextlib.nullcontext([])

    def check_path(self, path: object, argument: str) -> str:
        """Checks a file target before any work; returns it as a str.

        Raises:
            ValueError: for an empty path, a folder, or a wrong suffix.
            FileExistsError: if one of its files exists.
        """
        path = _files.check_path(argument, path)
        suffix = self.row.suffix
        if path.endswith(("/", os.sep)) or os.path.isdir(path):
            raise ValueError(
                f"`{argument}` must name a file ({suffix}), not a folder. "
                f"Received: {argument}={path!r}"
            )
        if not path.endswith(suffix):
            raise ValueError(
                f"`{argument}` must end with {suffix!r} ({self.row.title}). "
                f"Received: {argument}={path!r}"
            )
        for file in self.files(path):
            _files.refuse_existing(file, "Output file")
        return path

    def destination(
        self,
        path: object,
        argument: str,
        options: Mapping[str, object],
        backend: str | None = None,
    ) -> Destination:
        """A checked destination (path and options), before any work;
        `backend` as in `require`."""
        self.require(backend)
        checked = self.check_options(options, backend)
        return Destination(self.name, self.check_path(path, argument), checked)

    @contextlib.contextmanager
    def stage(
        self,
        target: Signature,
        destination: Destination,
        writer: Writer | None = None,
    ) -> Iterator[_files.Staged]:
        """Writes the artifact beside its destination (with `writer`, default
        `write`); moves it in after the block (nothing is left if the block
        raises)."""
        path = destination.path
        with _files.atomic_files(self.files(path)) as folder:
            staged = os.path.join(folder, os.path.basename(path))
            (writer or self.write)(target, staged, destination.options)
            yield _files.Staged(staged, path)

    def write(
        self, target: Signature, path: str, options: Mapping[str, object]
    ) -> None:
        """Writes `target` as this format's artifact at `path`."""
        raise NotImplementedError
