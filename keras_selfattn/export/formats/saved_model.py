"""SavedModel for TF Serving: `base_dir/name/VERSION/`, one signature.

The version folder is written into a hidden temporary beside it and renamed
into place (`_files.atomic_directory`), then `base_dir/models.config` is
rewritten. Quantized layers keep Keras's integers and TensorFlow computes
in float (its CPU has no faster integer matmul for Keras's scheme; Keras's
own quantized call runs slower than float there): an int8 kernel's integers
and scales are constants of the graph, whose dequantization TensorFlow
folds into a float kernel once, when it optimizes the loaded graph, so a
call costs what the float file's does; other modes (and int8 kernels too
large to fold) read their stored integers and dequantize them once per call
(`quantization.INTEGERS`).

TF Serving disables XLA on CPUs unless started with
`--xla_cpu_compilation_enabled=true` (`XLA_FLAG`): a graph with an op that
only XLA runs (jax2tf's XlaCallModule, so every SavedModel written on JAX;
a `jit_compile=True` function; an Xla* op) fails every request without
it. Such a SavedModel says so in `DESCRIPTION_PATH` (`tf_serving_flags`),
the export logs it, and the runtime check runs every SavedModel under the
setting TF Serving would give it (`parity._runner_process`). Option
`jit_compile` writes a model's forward pass so (on TensorFlow): its
signature calls one `jit_compile=True` function, which XLA compiles once
per input shape.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
from collections.abc import Iterator, Mapping

import keras

from keras_selfattn import _checks
from keras_selfattn._model_layers import every_layer
from keras_selfattn.export import _files, quantization
from keras_selfattn.export.formats._base import (
    Destination,
    Format,
    Writer,
    converting,
)
from keras_selfattn.export.formats.saved_model_shapes import drop_inferred_shapes
from keras_selfattn.export.signature import SERVING_SIGNATURE, Signature, example_inputs
from keras_selfattn.serving import layout
from keras_selfattn_runtimes import table

# Warmup requests: batch 1 and a few short lengths, the traces TF Serving
# would otherwise build on the first real requests.
WARMUP_TIMES = (1, 8, 32)
# What a quantized export computes, beside the SavedModel (TF Serving reads
# nothing in assets.extra but its warmup file).
DESCRIPTION_PATH = os.path.join("assets.extra", "keras_selfattn.json")


def _polymorphic_shape(shape: tuple[int | str, ...]) -> str:
    return "(" + ", ".join(str(dim) for dim in shape) + ")"


def write_saved_model(target: Signature, directory: str) -> None:
    """Writes `target` as a SavedModel with one signature, `target.signature_name`.

    Each weight is stored once: on TensorFlow the endpoint tracks the
    variables its function reads (Keras's `ExportArchive.track` would save
    every one a second time, as the Keras variable wrapping it), on JAX
    the tracked model's variables are the function's arguments. On JAX
    (through jax2tf) every dynamic axis after the batch is the one symbol
    "time", as in ONNX's axis names: inputs of one sequence have one
    length, which the signature then checks. Its functions keep only the
    output shapes TensorFlow cannot infer again (`drop_inferred_shapes`).
    """
    archive = keras.export.ExportArchive()
    options = {}
    if keras.backend.backend() != "tensorflow":
        archive.track(target.model)
    if keras.backend.backend() == "jax":
        shapes = [_polymorphic_shape(spec.axis_names()) for spec in target.inputs]
        options["jax2tf_kwargs"] = {"polymorphic_shapes": shapes}

    def serve(*tensors):
        return target.call_named(dict(zip(target.input_names, tensors, strict=True)))

    archive.add_endpoint(
        target.signature_name, serve, input_signature=target.tf_specs(), **options
    )
    import tensorflow as tf  # Keras's quantized calls' gradients: not served

    no_gradients = tf.saved_model.SaveOptions(experimental_custom_gradients=False)
    archive.write_out(directory, verbose=False, options=no_gradients)
    drop_inferred_shapes(directory)


def write_warmup(target: Signature, directory: str, model_name: str) -> None:
    """Writes TF Serving's warmup requests (`WARMUP_TIMES`) into `directory`."""
    from keras_selfattn.serving.warmup import write_warmup_file

    examples = {}  # by shapes: a fixed-length model has one warmup shape
    for time in WARMUP_TIMES:
        example = example_inputs(target, batch=1, time=time, seed=time)
        examples.setdefault(tuple(a.shape for a in example.values()), example)
    write_warmup_file(
        os.path.join(directory, layout.WARMUP_PATH),
        model_name,
        list(examples.values()),
        target.signature_name,
    )


SCHEME = (
    "float activations; integer weights dequantized in the graph (int8 kernels "
    "once, when TensorFlow optimizes it)"
)
# The TF Serving flag without which XLA does not run on a CPU.
XLA_FLAG = "--xla_cpu_compilation_enabled=true"

logger = logging.getLogger(__name__)


def needs_xla(directory: str) -> bool:
    """Whether the SavedModel in `directory` has an op that only XLA runs (an
    Xla* op) or a function XLA must compile (`jit_compile=True`)."""
    from tensorflow.core.protobuf import saved_model_pb2

    saved = saved_model_pb2.SavedModel()
    with open(os.path.join(directory, "saved_model.pb"), "rb") as file:
        saved.ParseFromString(file.read())
    for graph in saved.meta_graphs:
        functions = graph.graph_def.library.function
        nodes = [*graph.graph_def.node]
        nodes += [node for function in functions for node in function.node_def]
        if any(node.op.startswith("Xla") for node in nodes):
            return True
        if any(f.attr["_XlaMustCompile"].b for f in functions):
            return True
    return False


def _write_description(target: Signature, directory: str, xla: bool) -> None:
    """Says in `DESCRIPTION_PATH` what TF Serving needs (`XLA_FLAG` where
    `xla`) and how a quantized export computes: Keras's own scheme unless
    a layer quantizes its activations (int8) or is float8."""
    description = {}
    if xla:
        description["tf_serving_flags"] = [XLA_FLAG]
    if target.quantized:
        description["scheme"] = SCHEME
        description["exact"] = all(
            q.activations is None and q.mode != "float8" for q in target.quantized
        )
    if not description:
        return
    path = os.path.join(directory, DESCRIPTION_PATH)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as file:
        json.dump(description, file)


def compiled(target: Signature) -> Signature:
    """`target` with its function compiled by XLA (option `jit_compile`):
    one `tf.function(jit_compile=True)`, which the signature calls.

    Raises:
        ValueError: for a model with a layer XLA cannot compile
            (`supports_jit` False: a causal `chunk_size` without a window).
    """
    import tensorflow as tf

    for layer in every_layer(target.model):
        if not getattr(layer, "supports_jit", True):
            raise ValueError(
                f"Layer '{layer.name}' cannot be compiled by XLA (supports_jit is "
                "False), so its SavedModel cannot be written with jit_compile: "
                "export it without. Received: jit_compile=True"
            )
    function = tf.function(target.function, jit_compile=True, autograph=False)
    return dataclasses.replace(target, function=function)


class SavedModelFormat(Format):
    """TF Serving's SavedModel (TensorFlow; JAX through jax2tf)."""

    row = table.SAVED_MODEL
    quantized_form = quantization.INTEGERS
    advice = "export ONNX instead, or report the model's layers"

    def check_options(
        self, options: Mapping[str, object], backend: str | None = None
    ) -> dict[str, object]:
        """`name` (required), `version`, `warmup`, `models_config`,
        `jit_compile` (TensorFlow only: a SavedModel written on JAX is one
        XLA op already)."""
        super().check_options(options)
        if options.get("name") is None:
            raise ValueError("A SavedModel export needs `name`. Received: name=None")
        jit_compile = _checks.boolean("jit_compile", options.get("jit_compile", False))
        backend = backend or keras.backend.backend()
        if jit_compile and backend != "tensorflow":
            raise ValueError(
                "`jit_compile` compiles a SavedModel written on TensorFlow with "
                "XLA; one written on JAX is compiled by XLA already (jax2tf). "
                f"Received: jit_compile=True on the {backend} backend"
            )
        return {
            "name": layout.check_model_name(options["name"], "name"),
            "version": layout.check_version(options.get("version")),
            "warmup": _checks.boolean("warmup", options.get("warmup", False)),
            "models_config": _checks.boolean(
                "models_config", options.get("models_config", True)
            ),
            "jit_compile": jit_compile,
        }

    def check_artifact(self, path: str) -> None:
        """Raises FileNotFoundError unless `path` is a version folder holding
        a saved_model.pb."""
        if not os.path.isdir(path):
            raise FileNotFoundError(f"SavedModel directory not found: {path}")
        if not os.path.isfile(os.path.join(path, "saved_model.pb")):
            raise FileNotFoundError(
                f"No saved_model.pb in {path}: pass a version folder "
                "(BASE_DIR/NAME/VERSION)"
            )

    def label(self, destination: Destination, signature_name: str) -> str:
        """The model's name, a signature not TF Serving's default, the base
        dir and the warmup requests."""
        options = destination.options
        signature = ""
        if signature_name != SERVING_SIGNATURE:
            signature = f" (signature {signature_name!r})"
        warmup = " with warmup requests" if options["warmup"] else ""
        return (
            f"Exporting SavedModel {options['name']!r}{signature} "
            f"under {destination.path}{warmup}"
        )

    def destination(
        self,
        path: object,
        argument: str,
        options: Mapping[str, object],
        backend: str | None = None,
    ) -> Destination:
        """The version folder `base_dir/name/VERSION` an export would write now
        (`backend` as in `require`).

        Raises:
            ValueError: for a backend that cannot export a SavedModel, or an
                invalid name, version or base dir.
            layout.VersionExistsError: if the explicit `version` is taken.
        """
        self.require(backend)
        checked = self.check_options(options, backend)
        base_dir = _files.check_path(argument, path)
        if os.path.lexists(base_dir) and not os.path.isdir(base_dir):
            raise ValueError(
                f"`{argument}` must be a folder (TF Serving's base dir), not a "
                f"file. Received: {argument}={base_dir!r}"
            )
        model_dir = os.path.join(base_dir, checked["name"])
        version = layout.new_version(model_dir, checked["name"], checked["version"])
        return Destination(
            self.name, base_dir, checked, os.path.join(model_dir, str(version))
        )

    @contextlib.contextmanager
    def stage(
        self,
        target: Signature,
        destination: Destination,
        writer: Writer | None = None,
    ) -> Iterator[_files.Staged]:
        """The version folder, written hidden (with `writer`, default
        `write`) and renamed in after the block; then `models.config` is
        rewritten (option `models_config`)."""
        options = destination.options
        with _files.atomic_directory(destination.version_dir) as directory:
            (writer or self.write)(target, directory, options)
            yield _files.Staged(directory, destination.version_dir)
        if options["models_config"]:
            from keras_selfattn.serving.model_config import write_models_config

            base_dir = destination.path
            write_models_config(base_dir, layout.served_model_names(base_dir))

    def write(
        self, target: Signature, path: str, options: Mapping[str, object]
    ) -> None:
        if options.get("jit_compile"):
            target = compiled(target)
        with (
            converting(self.row.title, self.advice),
            target.traced(self.quantized_form),
        ):
            write_saved_model(target, path)
        if options.get("warmup"):
            write_warmup(target, path, options["name"])
        xla = needs_xla(path)
        if xla:
            logger.warning(
                "This SavedModel runs in TF Serving only when it is started with "
                "%s (its graph compiles with XLA: written on JAX, or jit_compile)",
                XLA_FLAG,
            )
        _write_description(target, path, xla)


FORMAT = SavedModelFormat()
