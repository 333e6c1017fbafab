"""The export formats, one row each: the table everything else reads.

The exporters, `verify`, the refusals and the command line's options all
come from these rows. This module imports only the standard library: the
command line imports it by name from `keras_selfattn_runtimes`, without
importing keras_selfattn (whose `__init__` imports Keras and TensorFlow), so
that `--help` stays instant (see keras_selfattn_cli/_table.py).

Which backend writes which format is Keras 3.15's (measured: README's
"Export from every backend"): SavedModel from TensorFlow and JAX (jax2tf),
ONNX from all three (tf2onnx; Keras's jax2onnx and torch.onnx routes),
LiteRT from TensorFlow and torch (litert-torch, fixed shapes), OpenVINO from
TensorFlow and torch, `.pt2` from torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

BACKENDS = ("tensorflow", "jax", "torch")
# What a command-line argument's value is: its argparse type, or a flag.
ARGUMENT_KINDS = ("flag", "int", "positive_int", "shape", "text")
# What the command line exports: the forward pass, the decoding step, the
# generator.
EXPORTS = ("forward", "decode_step", "generate")


@dataclasses.dataclass(frozen=True)
class CliArgument:
    """One command-line argument holding a format's option.

    Attributes:
        dest: The argument's name ("litert_shape"); its flag is
            "--litert-shape".
        option: The option of the format's `check_options` it holds
            ("shape"), or None for one the command passes on itself (the
            generator's `jit_compile`).
        help: The command line's help of the argument.
        kind: One of `ARGUMENT_KINDS`: "flag" (store_true), "int",
            "positive_int", "shape" ("BATCH,TIME") or "text".
        metavar: The command line's metavar, or None (argparse's).
        exports: What it applies to, of `EXPORTS`: an argument given with
            another export is refused; one of "generate" alone also needs
            `--generate`.
        verify: Whether `verify` takes it too (the LiteRT file's shape).
        verify_help: Its help under `verify` (default: `help`).
        choices: The values it takes, or () for any of its kind.
        default: Its value when not given (None: the format's default).
    """

    dest: str
    option: str | None
    help: str
    kind: str = "flag"
    metavar: str | None = None
    exports: tuple[str, ...] = EXPORTS
    verify: bool = False
    verify_help: str | None = None
    choices: tuple[str, ...] = ()
    default: str | None = None

    @property
    def flag(self) -> str:
        """The argument as typed: "--litert-shape"."""
        return "--" + self.dest.replace("_", "-")


@dataclasses.dataclass(frozen=True)
class FormatRow:
    """One export format.

    Attributes:
        name: The format's name ("onnx"): `export_decode_step`'s
            `export_format`, the report's label.
        title: How messages name the format ("ONNX").
        artifact: How messages name one artifact ("ONNX model").
        suffix: The file name's required ending, or None for a folder
            (the SavedModel's version folder).
        path_argument: `verify`'s keyword naming this format's artifact.
        export_metavar: The command line's `export --NAME` metavar.
        verify_metavar: The command line's `verify --NAME` metavar.
        help: The command line's help of `export --NAME`.
        runtime: The package that runs the artifact in its check.
        runtime_module: The module of `keras_selfattn_runtimes` that
            loads and calls the artifact in that runtime, without Keras
            (the check's runtime process, the benchmarks).
        packages: What exporting needs on every backend.
        backend_packages: What it needs besides on one backend.
        extra: The pip extra installing `packages`, or None (always there).
        refused: {backend: why Keras has no route there}; the backends not
            named export it.
        half: The half-precision dtypes whose arithmetic an artifact of this
            format keeps (`precision="model"`); other models it computes in
            float32 only.
        options: The options its `Format.check_options` takes; the
            exporters of the decoding step and the generator pass it only
            these of their keywords.
        decoding_refused: {backend: why a decoding step cannot export to
            this format from it (one sentence or more, ending with the way
            that works)}.
        generator: Whether a generator (its loop in the graph) exports to
            this format (`export_generator`, the command line's `--generate`).
        jit_compile: Whether its runtime runs a generator's loop compiled
            with XLA (`export_generator`'s `jit_compile`).
        cli_arguments: The command line's arguments holding its options
            (`CliArgument`), in the order `--help` lists them; an option
            named "name" is the command's model name.
        no_quantized_decoding: Why a quantized model's decoding step or
            generator is refused in this format (its converter cannot take
            Keras's quantized layers there; the forward export gives them
            their own quantized forms, which a step-by-step check would not
            accept), or None.
        runtime_half: {half dtype of `half`: the check's runtime keywords}
            for a dtype the format keeps by a float32 artifact its runtime
            computes in that dtype (OpenVINO compiles a float32 IR in bf16):
            the artifact is exported in float32 and checked so.
        extra_signatures: Whether an artifact holds a target's extra
            signatures (`Signature.extra_signatures`: a generator's
            "prefill" and "decode"), which the generator's check then runs.
        runtime_keywords: The check's runtime keywords its format reads
            (`Format.runtime_options`: `verify`'s `openvino_precision`); a
            check loads the format's module for its artifact or for one of
            these keywords, never otherwise.
    """

    name: str
    title: str
    artifact: str
    suffix: str | None
    path_argument: str
    export_metavar: str
    verify_metavar: str
    help: str
    runtime: str
    runtime_module: str
    packages: tuple[str, ...] = ()
    backend_packages: Mapping[str, tuple[str, ...]] = dataclasses.field(
        default_factory=dict
    )
    extra: str | None = None
    refused: Mapping[str, str] = dataclasses.field(default_factory=dict)
    half: tuple[str, ...] = ()
    options: tuple[str, ...] = ()
    decoding_refused: Mapping[str, str] = dataclasses.field(default_factory=dict)
    generator: bool = False
    jit_compile: bool = False
    cli_arguments: tuple[CliArgument, ...] = ()
    no_quantized_decoding: str | None = None
    runtime_half: Mapping[str, Mapping[str, object]] = dataclasses.field(
        default_factory=dict
    )
    extra_signatures: bool = False
    runtime_keywords: tuple[str, ...] = ()

    @property
    def option(self) -> str:
        """The command line's option: "--onnx", "--saved-model"."""
        return "--" + self.name.replace("_", "-")

    @property
    def cli_options(self) -> dict[str, str]:
        """{option of the format's `check_options`: the command line's
        argument holding it}."""
        return {a.option: a.dest for a in self.cli_arguments if a.option}

    @property
    def backends(self) -> tuple[str, ...]:
        """The backends that export this format, in `BACKENDS` order."""
        return tuple(b for b in BACKENDS if b not in self.refused)

    def refusal(self, backend: str) -> str | None:
        """One line saying why `backend` cannot export this format and the
        way that works, or None when it can."""
        if backend not in self.refused:
            return None
        return (
            f"{self.title} export does not run on the {backend} backend "
            f"({self.refused[backend]}): save the model as .keras, load it under "
            f"KERAS_BACKEND={self.backends[0]} and export there"
        )


SAVED_MODEL = FormatRow(
    name="saved_model",
    title="SavedModel",
    artifact="SavedModel",
    suffix=None,
    path_argument="saved_model_dir",
    export_metavar="BASE_DIR",
    verify_metavar="VERSION_DIR",
    help="write BASE_DIR/NAME/VERSION/ (TF Serving layout)",
    runtime="tensorflow",
    runtime_module="saved_model",
    # Not in the base install: JAX and PyTorch users need no TensorFlow.
    packages=("tensorflow", "tensorflow_serving"),
    extra="tensorflow",
    refused={"torch": "Keras exports torch models to it only through torch_xla"},
    half=("float16", "bfloat16"),
    options=("name", "version", "warmup", "models_config", "jit_compile"),
    generator=True,
    jit_compile=True,
    cli_arguments=(
        CliArgument("name", "name", "model name (default: MODEL file name)", "text"),
        CliArgument(
            "version",
            "version",
            "version number (default: highest existing + 1)",
            "positive_int",
        ),
        CliArgument(
            "warmup",
            "warmup",
            "add assets.extra/tf_serving_warmup_requests",
            exports=("forward", "generate"),
        ),
        CliArgument(
            "jit_compile",
            None,
            "with --generate and --saved-model: compile the loop with XLA "
            "(faster; TF Serving on a CPU then needs --xla_cpu_compilation_enabled)",
            exports=("generate",),
        ),
    ),
)
ONNX = FormatRow(
    name="onnx",
    title="ONNX",
    artifact="ONNX model",
    suffix=".onnx",
    path_argument="onnx_path",
    export_metavar="OUT.onnx",
    verify_metavar="PATH",
    help="write an ONNX file",
    runtime="onnxruntime",
    runtime_module="onnx",
    packages=("onnx", "tf2onnx", "onnxruntime"),
    backend_packages={"jax": ("jax2onnx",), "torch": ("onnxscript",)},
    extra="onnx",
    half=("float16",),
    options=("opset", "fuse_attention", "int8_matmul", "int4_inputs"),
    generator=True,
    cli_arguments=(
        CliArgument(
            "opset",
            "opset",
            "ONNX opset, 13 to 18 (default 17 on TensorFlow, the converter's own "
            "on JAX and torch)",
            "int",
        ),
        CliArgument(
            "fuse_attention",
            "fuse_attention",
            "make each SelfAttention one ONNX Attention node (upgrades to opset "
            "23; TensorFlow)",
            exports=("forward",),
        ),
        CliArgument(
            "int8_matmul",
            "int8_matmul",
            "deprecated: any_cpu (default) or vnni, which writes the default file "
            "(it picks the CPU's fast exact int8 kernel itself)",
            "text",
            "KERNEL",
        ),
        CliArgument(
            "int4_inputs",
            "int4_inputs",
            "with --generate and --onnx: the 4-bit layers' inputs, float (Keras's, "
            "default) or int8 (rounded in blocks as onnxruntime-genai's int4 "
            "models: faster, tokens judged at Keras's near ties)",
            "text",
            "KIND",
            exports=("generate",),
            choices=("float", "int8"),
        ),
    ),
)
LITERT = FormatRow(
    name="litert",
    title="LiteRT",
    artifact="LiteRT model",
    suffix=".tflite",
    path_argument="litert_path",
    export_metavar="OUT.tflite",
    verify_metavar="PATH",
    help="write a LiteRT (.tflite) file",
    runtime="ai_edge_litert",
    runtime_module="litert",
    packages=("ai_edge_litert", "ai_edge_quantizer"),
    backend_packages={"torch": ("litert_torch",)},
    extra="litert",
    refused={"jax": "Keras converts to LiteRT only from TensorFlow and torch"},
    options=("shape",),
    decoding_refused={
        "torch": "A decoding step exports to LiteRT from TensorFlow: litert-torch "
        "fixes every input's shape, and a step's number of new positions "
        "changes from prefill to decode. Save the model as .keras, load it "
        "under KERAS_BACKEND=tensorflow and export there."
    },
    generator=True,
    cli_arguments=(
        CliArgument(
            "litert_shape",
            "shape",
            "fix the LiteRT file's input shape (required on torch)",
            "shape",
            "BATCH,TIME",
            verify=True,
            verify_help="the LiteRT file's fixed input shape, if it has one",
        ),
    ),
    no_quantized_decoding="LiteRT's converter has no int8 batch matmul",
    extra_signatures=True,
)
OPENVINO = FormatRow(
    name="openvino",
    title="OpenVINO",
    artifact="OpenVINO model",
    suffix=".xml",
    path_argument="openvino_path",
    export_metavar="OUT.xml",
    verify_metavar="PATH",
    help="write OpenVINO IR (.xml + .bin)",
    runtime="openvino",
    runtime_module="openvino",
    packages=("openvino",),
    extra="openvino",
    refused={
        "jax": "Keras's jax2tf route gives XlaCallModule ops, which OpenVINO "
        "cannot convert"
    },
    # OpenVINO picks its arithmetic when it compiles (bf16 by default on CPUs
    # with AVX512-BF16): the IR is float32, checked at bf16.
    half=("bfloat16",),
    runtime_half={"bfloat16": {"openvino_precision": "bf16"}},
    runtime_keywords=("openvino_precision",),
    cli_arguments=(
        CliArgument(
            "openvino_precision",
            None,
            "OpenVINO's inference precision (default f32; bf16 is OpenVINO's "
            "default on CPUs with AVX512-BF16: pass tolerances that fit it)",
            "text",
            exports=(),
            verify=True,
            choices=("f32", "bf16"),
            default="f32",
        ),
    ),
    no_quantized_decoding="OpenVINO's conversion computes other numbers",
)
TORCH = FormatRow(
    name="torch",
    title="torch (.pt2)",
    artifact="torch program",
    suffix=".pt2",
    path_argument="torch_path",
    export_metavar="OUT.pt2",
    verify_metavar="PATH",
    help="write a torch.export program (torch)",
    runtime="torch",
    runtime_module="torch",
    refused={
        "tensorflow": "torch.export needs the torch backend",
        "jax": "torch.export needs the torch backend",
    },
    half=("float16", "bfloat16"),
)

# Every format, in the order exports are staged and reported.
ROWS: tuple[FormatRow, ...] = (SAVED_MODEL, ONNX, LITERT, OPENVINO, TORCH)
BY_NAME: Mapping[str, FormatRow] = {row.name: row for row in ROWS}
NAMES: tuple[str, ...] = tuple(BY_NAME)
# The formats written as files (every one but the SavedModel's folder).
FILE_ROWS: tuple[FormatRow, ...] = tuple(r for r in ROWS if r.suffix is not None)
