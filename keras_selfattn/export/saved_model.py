"""Export to a TF Serving SavedModel: `base_dir/name/VERSION/`.

`export_saved_model` = `stage_saved_model` (write into a hidden temporary)
+ `verify` (against Keras) + move into place. The CLI stages every export
first and verifies them all in one step; `check_target` is the argument
check both run before any work.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Mapping

import keras

from keras_selfattn.export import _backends, _files, pipeline
from keras_selfattn.export._endpoint import Endpoint, build_endpoint
from keras_selfattn.export._inputs import example_inputs
from keras_selfattn.export._runtimes import SAVED_MODEL
from keras_selfattn.export._target import SERVING_SIGNATURE, ExportTarget
from keras_selfattn.export.verify import DEFAULT_ATOL, DEFAULT_RTOL, verify
from keras_selfattn.serving import layout

# Warmup requests: batch 1 and a few short lengths, the traces TF Serving
# would otherwise build on the first real requests.
WARMUP_TIMES = (1, 8, 32)


def _polymorphic_shape(shape: tuple[int | str, ...]) -> str:
    return "(" + ", ".join(str(dim) for dim in shape) + ")"


def write_saved_model(target: ExportTarget, directory: str) -> None:
    """Writes `target` as a SavedModel with one signature, `target.signature_name`.

    On JAX (through jax2tf) every dynamic axis after the batch is the one
    symbol "time", as in ONNX's axis names: inputs of one sequence have one
    length, which the signature then checks.
    """
    archive = keras.export.ExportArchive()
    archive.track(target.model)
    options = {}
    if keras.backend.backend() == "jax":
        shapes = [_polymorphic_shape(spec.axis_names()) for spec in target.inputs]
        options["jax2tf_kwargs"] = {"polymorphic_shapes": shapes}

    def serve(*tensors):
        return target.call_named(dict(zip(target.input_names, tensors, strict=True)))

    archive.add_endpoint(
        target.signature_name, serve, input_signature=target.tf_specs(), **options
    )
    archive.write_out(directory, verbose=False)


def write_warmup(endpoint: Endpoint, directory: str, model_name: str) -> None:
    """Writes TF Serving's warmup requests (`WARMUP_TIMES`) into `directory`."""
    from keras_selfattn.serving.warmup import write_warmup_file

    examples = {}  # by shapes: a fixed-length model has one warmup shape
    for time in WARMUP_TIMES:
        example = example_inputs(endpoint, batch=1, time=time, seed=time)
        examples.setdefault(tuple(a.shape for a in example.values()), example)
    write_warmup_file(
        os.path.join(directory, layout.WARMUP_PATH),
        model_name,
        list(examples.values()),
        SERVING_SIGNATURE,
    )


def check_target(
    base_dir: str | os.PathLike,
    name: str,
    version: int | None = None,
    *,
    argument: str = "base_dir",
) -> str:
    """Checks a SavedModel export's target; returns its version folder.

    Runs before any work: the backend (see `_backends`), the model name, the
    version and `base_dir`, and whether the version is taken.

    Args:
        base_dir: The export base dir.
        name: The model name (`layout.check_model_name`).
        version: A positive integer, or None for the next free version.
        argument: How the caller names `base_dir` in errors (the CLI:
            "--saved-model").

    Returns:
        The version folder `base_dir/name/VERSION` an export would write now.

    Raises:
        ValueError: for a backend that cannot export a SavedModel, or an
            invalid name, version or base dir.
        layout.VersionExistsError: if the explicit `version` is taken.
    """
    _backends.require_backend(_backends.SAVED_MODEL)
    name = layout.check_model_name(name, "name")
    version = layout.check_version(version)
    model_dir = os.path.join(_files.check_path(argument, base_dir), name)
    return os.path.join(model_dir, str(layout.new_version(model_dir, name, version)))


@contextlib.contextmanager
def stage_saved_model(
    model: keras.Model,
    base_dir: str | os.PathLike,
    name: str,
    version: int | None = None,
    *,
    attention_outputs: str | Mapping[str, str] | None = None,
    warmup: bool = False,
    models_config: bool = True,
) -> Iterator[_files.Staged]:
    """Writes the export into a hidden folder, moved into place after the block.

    Arguments as in `export_saved_model`. The block sees the export at
    `staged.path` (e.g. to `verify` it); an exception in the block removes
    it, and `staged.target` never appears. After the move, `models.config`
    is rewritten when `models_config` is True.

    Example:

    >>> with stage_saved_model(model, "serving", "clf") as staged:  # doctest: +SKIP
    ...     verify(model, staged.path)
    """
    destination = pipeline.check_destination(
        SAVED_MODEL, base_dir, name=name, version=version
    )
    endpoint = build_endpoint(model, attention_outputs)
    with pipeline.stage(
        endpoint.target(),
        destination,
        models_config=models_config,
        warmup=(lambda d: write_warmup(endpoint, d, name)) if warmup else None,
    ) as staged:
        yield staged


@contextlib.contextmanager
def stage_version(
    base_dir: str | os.PathLike,
    target: str,
    write: Callable[[str], None],
    *,
    models_config: bool,
) -> Iterator[_files.Staged]:
    """Stages a version folder: `write` fills a hidden folder, moved to `target`.

    The block sees the folder at `staged.path`; an exception in the block
    removes it. After the move, `base_dir/models.config` is rewritten when
    `models_config` is True.

    Args:
        base_dir: The export base dir holding the model folders.
        target: The version folder (from `check_target`).
        write: Writes the version's files into the folder it is given.
        models_config: Whether to rewrite `models.config`.
    """
    with _files.atomic_directory(target) as tmp:
        write(tmp)
        yield _files.Staged(tmp, target)
    if models_config:
        from keras_selfattn.serving.model_config import write_models_config

        base_dir = os.fspath(base_dir)
        write_models_config(base_dir, layout.served_model_names(base_dir))


def export_saved_model(
    model: keras.Model,
    base_dir: str | os.PathLike,
    name: str,
    version: int | None = None,
    *,
    attention_outputs: str | Mapping[str, str] | None = None,
    warmup: bool = False,
    models_config: bool = True,
    check: bool = True,
    atol: float = DEFAULT_ATOL,
    rtol: float = DEFAULT_RTOL,
) -> str:
    """Exports `model` for TF Serving as `base_dir/name/VERSION/`.

    The SavedModel has one signature, `serving_default`, whose inputs are
    named after the model's `keras.Input`s and whose outputs are named after
    the model's outputs, with dynamic batch and time dimensions. Everything
    is written into a hidden temporary folder beside the version folder and
    renamed into place at the end, so an interrupted or failed export leaves
    no version folder; an existing version is never touched, also when
    another process exports the same version meanwhile (the later rename
    fails with FileExistsError).

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
        check: Whether to load the written SavedModel and compare it with
            Keras (see `verify`) before moving it into place.
        atol, rtol: Tolerances of that check.

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
    with stage_saved_model(
        model,
        base_dir,
        name,
        version,
        attention_outputs=attention_outputs,
        warmup=warmup,
        models_config=models_config,
    ) as staged:
        if check:
            verify(
                model,
                staged.path,
                attention_outputs=attention_outputs,
                atol=atol,
                rtol=rtol,
            )
    return staged.target
