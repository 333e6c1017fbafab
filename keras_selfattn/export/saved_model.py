"""Export to a TF Serving SavedModel: `base_dir/name/VERSION/`."""

from __future__ import annotations

import os
from collections.abc import Mapping

import keras
import tensorflow as tf

from keras_selfattn.export import _files
from keras_selfattn.export._endpoint import Endpoint, build_endpoint
from keras_selfattn.export._inputs import example_inputs
from keras_selfattn.export.verify import (
    DEFAULT_ATOL,
    DEFAULT_RTOL,
    DEFAULT_SHAPES,
    compare_runtimes,
    saved_model_runner,
)

SIGNATURE_NAME = "serving_default"
WARMUP_PATH = os.path.join("assets.extra", "tf_serving_warmup_requests")
# Warmup requests: batch 1 and a few short lengths, the traces TF Serving
# would otherwise build on the first real requests.
WARMUP_TIMES = (1, 8, 32)


def _write_saved_model(endpoint: Endpoint, directory: str) -> None:
    """Writes the SavedModel with one `serving_default` signature."""
    archive = keras.export.ExportArchive()
    archive.track(endpoint.model)
    names = endpoint.output_names

    def serve(*tensors):
        outputs = endpoint.model(list(tensors), training=False)
        return dict(zip(names, keras.tree.flatten(outputs), strict=True))

    archive.add_endpoint(
        SIGNATURE_NAME,
        serve,
        input_signature=[
            tf.TensorSpec(spec.shape, tf.as_dtype(spec.dtype), name=spec.name)
            for spec in endpoint.inputs
        ],
    )
    archive.write_out(directory, verbose=False)


def _write_warmup(endpoint: Endpoint, directory: str, model_name: str) -> None:
    from keras_selfattn.serving.warmup import write_warmup_file

    examples = {}  # by shapes: a fixed-length model has one warmup shape
    for time in WARMUP_TIMES:
        example = example_inputs(endpoint, batch=1, time=time, seed=time)
        examples.setdefault(tuple(a.shape for a in example.values()), example)
    write_warmup_file(
        os.path.join(directory, WARMUP_PATH),
        model_name,
        list(examples.values()),
        SIGNATURE_NAME,
    )


def _served_models(base_dir: str) -> list[str]:
    """Names of the folders of `base_dir` holding at least one version."""
    return sorted(
        entry
        for entry in os.listdir(base_dir)
        if not entry.startswith(".")
        and _files.existing_versions(os.path.join(base_dir, entry))
    )


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
        version: A positive integer, or None for the highest existing
            version plus one (1 for a new model).
        attention_outputs: None, the name of a top-level SelfAttention layer
            whose attention weights `(batch, heads, time, time)` become an
            extra output "attention_weights", or a dict
            {layer name: output name}.
        warmup: Whether to write `assets.extra/tf_serving_warmup_requests`
            (PredictionLog records read with `--enable_model_warmup`):
            batch 1, times 1, 8 and 32.
        models_config: Whether to (re)write `base_dir/models.config` listing
            every model folder of `base_dir`.
        check: Whether to load the written SavedModel and compare it with
            Keras (see `verify`) before moving it into place.
        atol, rtol: Tolerances of that check.

    Returns:
        The version folder's path.

    Raises:
        FileExistsError: if the version folder exists (left untouched).
        ValueError: for an invalid name, version, or model input name.
        ParityError: if the check finds the SavedModel differs from Keras
            (nothing is left on disk).

    Example:

    >>> from keras_selfattn.export import export_saved_model  # doctest: +SKIP
    >>> export_saved_model(model, "artifacts/serving", "classifier")  # doctest: +SKIP
    'artifacts/serving/classifier/1'
    """
    name = _files.check_name(name)
    if version is not None:
        version = _files.check_version(version)
    base_dir = _files.check_path("base_dir", base_dir)
    endpoint = build_endpoint(model, attention_outputs)
    model_dir = os.path.join(base_dir, name)
    if version is None:
        version = _files.next_version(model_dir)
    elif version in _files.existing_versions(model_dir):
        raise FileExistsError(
            f"Version {version} of model {name!r} already exists in {model_dir} "
            "and is never overwritten; pass another `version` or None"
        )
    target = os.path.join(model_dir, str(version))
    with _files.atomic_directory(target) as tmp:
        _write_saved_model(endpoint, tmp)
        if warmup:
            _write_warmup(endpoint, tmp, name)
        if check:
            compare_runtimes(
                endpoint,
                {"saved_model": saved_model_runner(tmp, endpoint)},
                DEFAULT_SHAPES,
                atol,
                rtol,
                seed=0,
            )
    if models_config:
        from keras_selfattn.serving.model_config import write_models_config

        write_models_config(base_dir, _served_models(base_dir))
    return target
