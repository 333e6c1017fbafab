"""The forward pass's exports: the public exporters, one per format, and
`export` for any format by its name; the forward pass as a `pipeline.Target`
is `target.Forward` (what it exports, the model's `Endpoint` from `graph`;
what it refuses; its check, `check`).

Each runs the model's forward pass (`Forward`, its `Endpoint`) through
`pipeline.export`: checks its destination, stages it in its format
(`formats`), checks the staged artifact against Keras in a fresh process of
its runtime (`verify`), and moves it into place; a failure leaves nothing.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import keras

from keras_selfattn.export import pipeline
from keras_selfattn.export.forward.check import DEFAULT_ATOL, DEFAULT_RTOL
from keras_selfattn.export.forward.target import COMMON_OPTIONS, Forward
from keras_selfattn_runtimes import table


def _export(
    row: table.FormatRow,
    model: keras.Model,
    path: str | os.PathLike,
    attention_outputs: str | Mapping[str, str] | None,
    check: bool,
    atol: float,
    rtol: float,
    precision: str,
    **options: object,
) -> str:
    """`model`'s endpoint exported in `row`'s format (module docstring)."""
    forward = Forward(model, attention_outputs, atol, rtol, precision, options)
    return pipeline.export(forward, {row.name: path}, check)[row.name]


def export(
    model: keras.Model,
    path: str | os.PathLike,
    format: str,
    **options: object,
) -> str:
    """Exports `model`'s forward pass in any format (`formats.table.NAMES`).

    The shape of Keras's `model.export(filepath, format=...)`: the same
    export, staging and check as the format's own exporter
    (`export_saved_model`, `export_onnx`, ...), with its options as keywords.

    Args:
        model: A Functional or Sequential model with named `keras.Input`s.
        path: The SavedModel base dir ("saved_model") or the file to create.
        format: "saved_model", "onnx", "litert", "openvino" or "torch".
        **options: Every format's `attention_outputs`, `check`, `atol`,
            `rtol` and `precision` (as in `export_saved_model`, with its
            defaults), and the format's own (`FormatRow.options`): `name`,
            `version`, `warmup`, `models_config`, `jit_compile` for a
            SavedModel (`name` required); `opset`, `fuse_attention`,
            `int8_matmul` for ONNX; `shape` for LiteRT.

    Returns:
        The version folder or the file.

    Raises:
        ValueError: for an unknown format (naming the known ones), an
            option the format does not take, or as its exporter does.
        FileExistsError: if the target exists.
        ParityError: if the check fails (nothing is left on disk).

    Example:

    >>> from keras_selfattn.export import export  # doctest: +SKIP
    >>> export(model, "artifacts/model.onnx", "onnx", opset=17)  # doctest: +SKIP
    'artifacts/model.onnx'
    """
    if format not in table.BY_NAME:
        raise ValueError(
            f"`format` must be one of {table.NAMES}. Received: format={format!r}"
        )
    common = {name: options.pop(name, value) for name, value in COMMON_OPTIONS.items()}
    return _export(table.BY_NAME[format], model, path, **common, **options)


def export_saved_model(
    model: keras.Model,
    base_dir: str | os.PathLike,
    name: str,
    version: int | None = None,
    *,
    attention_outputs: str | Mapping[str, str] | None = None,
    warmup: bool = False,
    models_config: bool = True,
    jit_compile: bool = False,
    check: bool = True,
    atol: float = DEFAULT_ATOL,
    rtol: float = DEFAULT_RTOL,
    precision: str = "float32",
) -> str:
    """Exports `model` for TF Serving as `base_dir/name/VERSION/`.

    The SavedModel has one signature, `serving_default`, whose inputs are
    named after the model's `keras.Input`s and whose outputs are named after
    the model's outputs, with dynamic batch and time dimensions. Everything
    is written into a hidden temporary folder beside the version folder and
    renamed into place at the end, so an interrupted or failed export leaves
    no version folder; an existing version is never touched, also when
    another process exports the same version meanwhile (the later rename
    fails with FileExistsError). A quantized model keeps Keras's integers;
    TensorFlow dequantizes int8 kernels once, when it optimizes the loaded
    graph, and the other modes once per call.

    Args:
        model: A Functional or Sequential model whose `keras.Input`s all have
            names (auto-generated names such as "input_layer" are refused).
        base_dir: The folder TF Serving is pointed at (holds one folder per
            model and `models.config`). Created when missing.
        name: The model's name: a single folder name (no path separators,
            not "." or "..", not starting with ".").
        version: A positive integer, or None for the highest taken version
            plus one (1 for a new model; see `serving.layout`).
        attention_outputs: None, the name of a top-level SelfAttention layer
            whose attention weights `(batch, heads, time, time)` become an
            extra output "attention_weights", or a dict
            {layer name: output name}.
        warmup: Whether to write `assets.extra/tf_serving_warmup_requests`
            (PredictionLog records read with `--enable_model_warmup`):
            batch 1, times 1, 8 and 32.
        models_config: Whether to (re)write `base_dir/models.config` listing
            every model folder of `base_dir` with a served version.
        jit_compile: TensorFlow only: whether the signature is compiled by
            XLA (`tf.function(jit_compile=True)`), once per input shape.
            TF Serving then needs `--xla_cpu_compilation_enabled=true`
            (the SavedModel says so in `assets.extra/keras_selfattn.json`);
            docs/export.md ("XLA") says where it pays.
        check: Whether to load the written SavedModel and compare it with
            Keras (see `verify`) before moving it into place.
        atol, rtol: Tolerances of that check.
        precision: For a model computing in float16 or bfloat16 (a mixed
            precision policy): "float32" (default) exports its float32
            arithmetic from its float32 variables; "model" keeps its own
            dtype where the format can (`formats.table`: SavedModel both,
            ONNX float16, .pt2 both; OpenVINO bfloat16, which it computes
            when it compiles a float32 IR on a CPU with AVX512-BF16, and
            is checked so). Float models ignore it.

    Returns:
        The version folder's path.

    Raises:
        FileExistsError: if the version folder exists (left untouched).
        ValueError: for an invalid name, version, or model input name, or
            a backend that cannot export a SavedModel (torch).
        ParityError: if the check finds the SavedModel differs from Keras
            (nothing is left on disk).

    Example:

    >>> from keras_selfattn.export import export_saved_model  # doctest: +SKIP
    >>> export_saved_model(model, "artifacts/serving", "classifier")  # doctest: +SKIP
    'artifacts/serving/classifier/1'
    """
    return _export(
        table.SAVED_MODEL,
        model,
        base_dir,
        attention_outputs,
        check,
        atol,
        rtol,
        precision,
        name=name,
        version=version,
        warmup=warmup,
        models_config=models_config,
        jit_compile=jit_compile,
    )


def export_onnx(
    model: keras.Model,
    path: str | os.PathLike,
    opset: int | None = None,
    *,
    attention_outputs: str | Mapping[str, str] | None = None,
    fuse_attention: bool = False,
    check: bool = True,
    atol: float = DEFAULT_ATOL,
    rtol: float = DEFAULT_RTOL,
    precision: str = "float32",
    int8_matmul: str = "any_cpu",
) -> str:
    """Exports `model` to an ONNX file (tf2onnx; jax2onnx / torch.onnx via Keras).

    Inputs and outputs are named like the model's, with dynamic axes named
    "batch" and "time"; integer and boolean inputs keep their dtypes. Before
    the file appears at `path`, the model passes `onnx.checker` and (with
    `check`) runs in onnxruntime on several shapes, compared with Keras. The
    file is written beside `path` and linked into place, so a failure leaves
    nothing at `path`; an existing file is never replaced. A quantized
    model's layers run on ONNX Runtime's integer kernels with Keras's
    integers (`formats.onnx.integer`).

    Args:
        model: A Functional or Sequential model with named `keras.Input`s.
        path: The ONNX file to create; missing parent folders are created.
        opset: ONNX opset, 13 to 18. Defaults to 17 on TensorFlow, to the
            converter's own on JAX and torch.
        attention_outputs: As in `export_saved_model`: a SelfAttention layer
            name (output "attention_weights") or {layer name: output name}.
        fuse_attention: If True, the model is upgraded to opset 23 and each
            SelfAttention call becomes one ONNX `Attention` node (see
            `keras_selfattn.export.formats.onnx.fused`); a layer that cannot
            be fused keeps its decomposed form and is logged with the reason.
        check: Whether to run the onnxruntime comparison (see `verify`).
        atol, rtol: Tolerances of that check.
        precision: As in `export_saved_model`.
        int8_matmul: Deprecated, to be removed: "any_cpu" (the default) or "vnni", which
            warns (`FutureWarning`, shown by default) and writes the default file. The
            file's int8 layers with quantized activations (Keras's `quantize("int8")`)
            run on ONNX Runtime's uint8 x int8 kernel where a probe of the machine's
            kernel, run when the session loads, finds it exact (VNNI, AMX), on uint8 x
            uint8 elsewhere: exact on every CPU.

    Returns:
        `path`, as a string.

    Raises:
        ValueError: for an unsupported opset or `int8_matmul`, an invalid
            model input name, or `fuse_attention` off the TensorFlow backend.
        FileExistsError: if `path` exists (left untouched).
        ParityError: if onnxruntime's results differ from Keras.

    Example:

    >>> from keras_selfattn.export import export_onnx  # doctest: +SKIP
    >>> export_onnx(model, "artifacts/model.onnx", opset=17)  # doctest: +SKIP
    'artifacts/model.onnx'
    """
    return _export(
        table.ONNX,
        model,
        path,
        attention_outputs,
        check,
        atol,
        rtol,
        precision,
        opset=opset,
        fuse_attention=fuse_attention,
        int8_matmul=int8_matmul,
    )


def export_litert(
    model: keras.Model,
    path: str | os.PathLike,
    *,
    shape: tuple[int, int] | None = None,
    attention_outputs: str | Mapping[str, str] | None = None,
    check: bool = True,
    atol: float = DEFAULT_ATOL,
    rtol: float = DEFAULT_RTOL,
    precision: str = "float32",
) -> str:
    """Exports `model` to a LiteRT (.tflite) file.

    On TensorFlow the TFLite converter keeps dynamic batch and time; on
    torch, litert-torch needs fixed shapes (`shape`). The file is checked
    in a fresh `ai_edge_litert` process (see `verify`) before it appears at
    `path`; a file that differs from Keras (Keras's torch route miscomputes
    grouped-query attention) raises ParityError and leaves nothing. A
    quantized model's int8 layers keep Keras's integers on LiteRT's
    dynamic-range kernels (`formats.litert`).

    Args:
        model: A Functional or Sequential model with named `keras.Input`s.
        path: The .tflite file to create; never replaced.
        shape: (batch, time) the file is fixed to; None keeps them dynamic
            (TensorFlow only).
        attention_outputs: As in `export_saved_model`.
        check: Whether to verify the file before it appears.
        atol, rtol: Tolerances of that check.
        precision: As in `export_saved_model`.

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
    return _export(
        table.LITERT,
        model,
        path,
        attention_outputs,
        check,
        atol,
        rtol,
        precision,
        shape=shape,
    )


def export_openvino(
    model: keras.Model,
    path: str | os.PathLike,
    *,
    attention_outputs: str | Mapping[str, str] | None = None,
    check: bool = True,
    atol: float = DEFAULT_ATOL,
    rtol: float = DEFAULT_RTOL,
    precision: str = "float32",
) -> str:
    """Exports `model` to OpenVINO IR (`path` .xml and its .bin).

    Checked in a fresh `openvino` process at f32
    (`INFERENCE_PRECISION_HINT`), not OpenVINO's bf16 default on CPUs with
    AVX512-BF16; both files appear only after the check. A quantized
    model's kernels stay Keras's integers, compressed (`formats.openvino`).

    Args:
        model: A Functional or Sequential model with named `keras.Input`s.
        path: The .xml file to create (the .bin goes beside it).
        attention_outputs, check, atol, rtol, precision: As in
            `export_litert`.

    Returns:
        `path`, as a string.

    Raises:
        ValueError: on the JAX backend or for a bad path.
        FileExistsError: if the .xml or .bin exists.
        ParityError: if OpenVINO's results differ from Keras.

    Example:

    >>> export_openvino(model, "artifacts/model.xml")  # doctest: +SKIP
    'artifacts/model.xml'
    """
    return _export(
        table.OPENVINO, model, path, attention_outputs, check, atol, rtol, precision
    )


def export_torch(
    model: keras.Model,
    path: str | os.PathLike,
    *,
    attention_outputs: str | Mapping[str, str] | None = None,
    check: bool = True,
    atol: float = DEFAULT_ATOL,
    rtol: float = DEFAULT_RTOL,
    precision: str = "float32",
) -> str:
    """Exports `model` as a `torch.export` program (.pt2), torch backend only.

    The program takes the inputs as one list, in the model's input order,
    with dynamic "batch" and "time" dimensions, and returns the outputs as
    a list; it is checked with `torch.export.load` in a fresh process.

    Args:
        model: A Functional or Sequential model with named `keras.Input`s.
        path: The .pt2 file to create.
        attention_outputs, check, atol, rtol, precision: As in
            `export_litert`.

    Returns:
        `path`, as a string.

    Raises:
        ValueError: off the torch backend or for a bad path.
        FileExistsError: if `path` exists.
        ParityError: if the program's results differ from Keras.

    Example:

    >>> export_torch(model, "artifacts/model.pt2")  # doctest: +SKIP
    'artifacts/model.pt2'
    """
    return _export(
        table.TORCH, model, path, attention_outputs, check, atol, rtol, precision
    )
