"""Export to LiteRT (.tflite), OpenVINO IR (.xml + .bin) and torch (.pt2).

Each goes through `pipeline` (checked destination, staged beside it) and
Keras's own `model.export` (`artifacts.write`), and is verified in a fresh
process running only its runtime before it appears (`verify`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping

import keras

from keras_selfattn.export import pipeline
from keras_selfattn.export._endpoint import build_endpoint
from keras_selfattn.export._runtimes import LITERT, OPENVINO, TORCH
from keras_selfattn.export.verify import (
    DEFAULT_ATOL,
    DEFAULT_RTOL,
    PATH_ARGUMENT,
    verify,
)


def _export(
    export_format: str,
    model: keras.Model,
    path: str | os.PathLike,
    shape: tuple[int, int] | None,
    attention_outputs: str | Mapping[str, str] | None,
    check: bool,
    atol: float,
    rtol: float,
) -> str:
    """`model` staged, written in `export_format`, verified (if `check`), then
    moved to `path`; the public functions' arguments, in their order."""
    destination = pipeline.check_destination(export_format, path, shape=shape)
    target = build_endpoint(model, attention_outputs).target()
    with pipeline.stage(target, destination) as staged:
        if check:
            verify(
                model,
                attention_outputs=attention_outputs,
                atol=atol,
                rtol=rtol,
                shapes=None if destination.shape is None else [destination.shape],
                **{PATH_ARGUMENT[export_format]: staged.path},
            )
    return staged.target


def export_litert(
    model: keras.Model,
    path: str | os.PathLike,
    *,
    shape: tuple[int, int] | None = None,
    attention_outputs: str | Mapping[str, str] | None = None,
    check: bool = True,
    atol: float = DEFAULT_ATOL,
    rtol: float = DEFAULT_RTOL,
) -> str:
    """Exports `model` to a LiteRT (.tflite) file with Keras's exporter.

    On TensorFlow the TFLite converter keeps dynamic batch and time; on
    torch, litert-torch needs fixed shapes (`shape`). The file is checked
    in a fresh `ai_edge_litert` process (see `verify`) before it appears at
    `path`; a file that differs from Keras (Keras's torch route miscomputes
    grouped-query attention) raises ParityError and leaves nothing.

    Args:
        model: A Functional or Sequential model with named `keras.Input`s.
        path: The .tflite file to create; never replaced.
        shape: (batch, time) the file is fixed to; None keeps them dynamic
            (TensorFlow only).
        attention_outputs: As in `export_saved_model`.
        check: Whether to verify the file before it appears.
        atol, rtol: Tolerances of that check.

    Returns:
        `path`, as a string.

    Raises:
        ValueError: on the JAX backend, for a bad path or shape, or on torch
            without `shape`.
        FileExistsError: if `path` exists.
        ParityError: if the file differs from Keras.

    Example:

    >>> export_litert(model, "artifacts/model.tflite")  # doctest: +SKIP
    'artifacts/model.tflite'
    """
    return _export(LITERT, model, path, shape, attention_outputs, check, atol, rtol)


def _dynamic_exporter(export_format: str, name: str, doc: str) -> Callable[..., str]:
    """The public exporter `name` to `export_format`: `export_litert`'s
    arguments but `shape` (these formats keep batch and time dynamic)."""

    def export(
        model: keras.Model,
        path: str | os.PathLike,
        *,
        attention_outputs: str | Mapping[str, str] | None = None,
        check: bool = True,
        atol: float = DEFAULT_ATOL,
        rtol: float = DEFAULT_RTOL,
    ) -> str:
        return _export(
            export_format, model, path, None, attention_outputs, check, atol, rtol
        )

    export.__name__ = export.__qualname__ = name
    export.__doc__ = doc
    return export


export_openvino = _dynamic_exporter(
    OPENVINO,
    "export_openvino",
    """Exports `model` to OpenVINO IR (`path` .xml and its .bin) with Keras.

    Checked in a fresh `openvino` process at f32
    (`INFERENCE_PRECISION_HINT`), not OpenVINO's bf16 default on CPUs with
    AVX512-BF16; both files appear only after the check.

    Args:
        model: A Functional or Sequential model with named `keras.Input`s.
        path: The .xml file to create (the .bin goes beside it).
        attention_outputs, check, atol, rtol: As in `export_litert`.

    Returns:
        `path`, as a string.

    Raises:
        ValueError: on the JAX backend or for a bad path.
        FileExistsError: if the .xml or .bin exists.
        ParityError: if OpenVINO's results differ from Keras.

    Example:

    >>> export_openvino(model, "artifacts/model.xml")  # doctest: +SKIP
    'artifacts/model.xml'
    """,
)

export_torch = _dynamic_exporter(
    TORCH,
    "export_torch",
    """Exports `model` as a `torch.export` program (.pt2), torch backend only.

    The program takes the inputs as one list, in the model's input order,
    with dynamic "batch" and "time" dimensions, and returns the outputs as
    a list; it is checked with `torch.export.load` in a fresh process.

    Args:
        model: A Functional or Sequential model with named `keras.Input`s.
        path: The .pt2 file to create.
        attention_outputs, check, atol, rtol: As in `export_litert`.

    Returns:
        `path`, as a string.

    Raises:
        ValueError: off the torch backend or for a bad path.
        FileExistsError: if `path` exists.
        ParityError: if the program's results differ from Keras.

    Example:

    >>> export_torch(model, "artifacts/model.pt2")  # doctest: +SKIP
    'artifacts/model.pt2'
    """,
)
