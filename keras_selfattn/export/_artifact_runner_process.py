"""Runs exported artifacts in their own runtime, in a process of its own.

Started as a script (`python _artifact_runner_process.py REQUEST.json`), never
imported by the package's other modules at run time: it imports numpy and
the one runtime of the artifact it runs (TensorFlow for a SavedModel,
onnxruntime, ai_edge_litert, openvino, torch.export), never keras or
keras_selfattn, so a check through it proves the artifact stands alone.

The request (JSON) names the artifact's format and path and a list of runs.
A run is a list of steps, each an `.npz` of inputs keyed by the exporter's
input names; `feedback` maps output names to input names fed into the next
step (a decoding step's caches), `generated` output names to the input
their last position feeds, chosen as a generation chooses (`_generated`),
and `signatures` names each step's signature (the request's own when
empty; each is opened and bound by itself). The worker writes each step's
outputs, keyed by the artifact's own output names, to `<step file>.out.npz`,
and the reply (JSON) lists the artifact's input and output names, which of
keras and keras_selfattn were imported (TensorFlow imports keras itself),
and how the artifact computes a quantized model ("description": its scheme
and whether that is Keras's own), as the artifact says (the exporters write
it: ONNX metadata, the SavedModel's assets.extra, OpenVINO's rt_info) or as
its runtime shows (LiteRT's int8 weights, ONNX Runtime's quantizer ops).
A SavedModel runs as TF Serving would run it: with XLA disabled unless it
says it needs TF Serving's `--xla_cpu_compilation_enabled=true`.
"""

from __future__ import annotations

import json
import os
import re
import sys

if __name__ == "__main__":  # this folder holds no runtime modules to import
    sys.path.pop(0)

import numpy as np

_NUMBERED = re.compile(r"^(.*?)(\d+)$")
# Where the exporters say how a quantized artifact computes (see the
# formats' modules: onnx.integer.METADATA_KEY, saved_model.DESCRIPTION_PATH,
# openvino.SCHEME_KEY); this script imports none of them.
_ONNX_KEY = "keras_selfattn.quantization"
_SAVED_MODEL_DESCRIPTION = os.path.join("assets.extra", "keras_selfattn.json")
_OPENVINO_KEY = "keras_selfattn_quantization"
# What a SavedModel that needs XLA says (saved_model.XLA_FLAG), and
# TensorFlow's C++ switch that TF Serving flips without it.
_XLA_FLAG = "--xla_cpu_compilation_enabled=true"
_TF_LIBRARY = "libtensorflow_cc.so.2"
_DISABLE_XLA = "_ZN10tensorflow21DisableXlaCompilationEv"
_ONNX_RUNTIME_QUANTIZER = {
    "DynamicQuantizeLinear",
    "DynamicQuantizeMatMul",
    "MatMulIntegerToFloat",
}


def _natural(name: str) -> tuple:
    """Sort key putting output_2 before output_10."""
    match = _NUMBERED.match(name)
    return (match.group(1), int(match.group(2))) if match else (name, -1)


# Names that say nothing but a position, which Keras's own exports write
# (outputs output_0, Identity:0; inputs args_0_0, input): matched by position.
_POSITIONAL_NAME = re.compile(
    r"^(output_?\d+|Identity(_\d+)?(:\d+)?|\d+|args_\d+(_\d+)*|input(_\d+)?)$"
)


class BindError(Exception):
    """The artifact's inputs or outputs are not the exported ones."""


def _bind(
    wanted: list[str], found: list[str], kind: str, owner: str, positional: bool
) -> dict[str, str]:
    """Maps the exporter's names to the artifact's.

    By name; by position when the artifact's names are only positions
    (`positional`, or every name like "output_0"). An artifact may have
    more anonymous outputs than wanted (Keras's OpenVINO export from
    TensorFlow adds stray ones after the model's): the first ones are used.
    """
    if all(name in found for name in wanted):
        return {name: name for name in wanted}
    anonymous = positional or all(_POSITIONAL_NAME.match(name) for name in found)
    if anonymous and len(found) == len(wanted):
        return dict(zip(wanted, found, strict=True))
    first = found[: len(wanted)]
    if len(found) > len(wanted) and all(_POSITIONAL_NAME.match(n) for n in first):
        return dict(zip(wanted, first, strict=True))
    missing = [name for name in wanted if name not in found]
    raise BindError(f"lacks the {owner}'s {kind} {missing}; it has {sorted(found)}")


def _as_tf_serving_would(tf, flags: list) -> None:
    """Disables XLA as TF Serving does on a CPU unless it is started with
    `--xla_cpu_compilation_enabled=true` (its main calls TensorFlow's
    `DisableXlaCompilation()`): an op that only XLA runs then fails."""
    if _XLA_FLAG in flags:
        return
    import ctypes

    library = ctypes.CDLL(os.path.join(os.path.dirname(tf.__file__), _TF_LIBRARY))
    getattr(library, _DISABLE_XLA)()


class _SavedModel:
    positional_inputs = False

    def __init__(self, path: str, signature: str):
        import tensorflow as tf

        self._tf = tf
        described = os.path.join(path, _SAVED_MODEL_DESCRIPTION)
        self.description = {}
        if os.path.isfile(described):
            with open(described) as file:
                self.description = json.load(file)
        _as_tf_serving_would(tf, self.description.get("tf_serving_flags", []))
        loaded = tf.saved_model.load(path)
        if signature not in loaded.signatures:
            raise ValueError(
                f"no {signature!r} signature; it has {sorted(loaded.signatures)}"
            )
        self._loaded = loaded  # keeps the signature's variables alive
        self._function = loaded.signatures[signature]
        _, specs = self._function.structured_input_signature
        self.input_names = list(specs)
        self.output_names = sorted(self._function.structured_outputs, key=_natural)

    def __call__(self, arrays):
        outputs = self._function(**{k: self._tf.constant(v) for k, v in arrays.items()})
        return {k: v.numpy() for k, v in outputs.items()}


class _Onnx:
    positional_inputs = False

    def __init__(self, path: str, signature: str):
        import onnxruntime

        self._session = onnxruntime.InferenceSession(
            path, providers=["CPUExecutionProvider"]
        )
        self.input_names = [i.name for i in self._session.get_inputs()]
        self.output_names = [o.name for o in self._session.get_outputs()]
        self.description = self._describe(path)

    def _describe(self, path: str) -> dict:
        stated = self._session.get_modelmeta().custom_metadata_map.get(_ONNX_KEY)
        if stated:
            stated = json.loads(stated)
            schemes = sorted(set(stated["layers"].values()))
            return {"scheme": "; ".join(schemes), "exact": stated["exact"]}
        import onnx  # the ONNX runtime's own package, no Keras

        ops = {node.op_type for node in onnx.load(path).graph.node}
        if ops & _ONNX_RUNTIME_QUANTIZER:
            scheme = "int8 activations per tensor, asymmetric (quantize_dynamic)"
            return {"scheme": scheme, "exact": False}
        return {}

    def __call__(self, arrays):
        values = self._session.run(None, dict(arrays))
        return dict(zip(self.output_names, values, strict=True))


class _LiteRT:
    positional_inputs = False

    def __init__(self, path: str, signature: str):
        from ai_edge_litert.interpreter import Interpreter

        interpreter = Interpreter(model_path=path)
        self.description = self._describe(interpreter)
        signatures = interpreter.get_signature_list()
        if len(signatures) > 1 and signature not in signatures:
            raise ValueError(f"no {signature!r} signature; it has {sorted(signatures)}")
        if signatures:  # Keras's export names its one "serving_default"
            key = signature if signature in signatures else next(iter(signatures))
            self._runner = interpreter.get_signature_runner(key)
            details = self._runner.get_input_details()
            order = sorted(details, key=lambda n: details[n]["index"])
            self.input_names = order
            outputs = self._runner.get_output_details()
            self.output_names = sorted(outputs, key=_natural)
        else:  # no signature: positional tensors
            self._runner = None
            self._interpreter = interpreter
            self.input_names = [d["name"] for d in interpreter.get_input_details()]
            self.output_names = [d["name"] for d in interpreter.get_output_details()]

    @staticmethod
    def _describe(interpreter) -> dict:
        """Dynamic range (int8 weight matrices, float inputs), or float."""
        for detail in interpreter.get_tensor_details():
            scales = detail["quantization_parameters"]["scales"]
            if detail["dtype"] == np.int8 and len(detail["shape"]) == 2 and len(scales):
                scheme = "int8 weights, activations quantized per row (dynamic range)"
                return {"scheme": scheme, "exact": False}
        return {"scheme": "float weights", "exact": False}

    def __call__(self, arrays):
        if self._runner is not None:
            return {k: np.asarray(v) for k, v in self._runner(**arrays).items()}
        interpreter = self._interpreter
        details = interpreter.get_input_details()
        for detail in details:
            interpreter.resize_tensor_input(
                detail["index"], arrays[detail["name"]].shape
            )
        interpreter.allocate_tensors()
        for detail in details:
            interpreter.set_tensor(detail["index"], arrays[detail["name"]])
        interpreter.invoke()
        return {
            d["name"]: interpreter.get_tensor(d["index"])
            for d in interpreter.get_output_details()
        }


class _OpenVINO:
    positional_inputs = False

    def __init__(self, path: str, signature: str, precision: str):
        import openvino

        core = openvino.Core()
        model = core.read_model(path)
        config = {"INFERENCE_PRECISION_HINT": precision} if precision else {}
        self._compiled = core.compile_model(model, "CPU", config)
        self.description = {}
        if model.has_rt_info(_OPENVINO_KEY):
            stated = json.loads(model.get_rt_info(_OPENVINO_KEY).astype(str))
            scheme = "; ".join(sorted(set(stated["layers"].values())))
            self.description = {"scheme": scheme, "exact": stated["exact"]}
        self.input_names = [port.get_any_name() for port in model.inputs]
        self.output_names = [
            port.get_any_name() if port.get_names() else f"output_{index}"
            for index, port in enumerate(model.outputs)
        ]

    def __call__(self, arrays):
        result = self._compiled([arrays[name] for name in self.input_names])
        values = [result[port] for port in self._compiled.outputs]
        return dict(zip(self.output_names, values, strict=True))


class _Torch:
    positional_inputs = True  # torch.export keeps argument positions only

    def __init__(self, path: str, signature: str):
        import torch
        from torch.utils import _pytree

        self._torch = torch
        self._pytree = _pytree
        program = torch.export.load(path)
        self._spec = program.call_spec.in_spec
        self._module = program.module()
        self.input_names = [
            spec.arg.name
            for spec in program.graph_signature.input_specs
            if spec.kind == torch.export.graph_signature.InputKind.USER_INPUT
        ]
        count = program.call_spec.out_spec.num_leaves
        self.output_names = [f"output_{index}" for index in range(count)]
        self.description = {}

    def __call__(self, arrays):
        torch = self._torch
        # A copy in C order that keeps 0-d inputs (cache_update_index) 0-d:
        # np.ascontiguousarray makes them 1-d.
        flat = [
            torch.from_numpy(np.array(arrays[n], order="C")) for n in self.input_names
        ]
        args, kwargs = self._pytree.tree_unflatten(flat, self._spec)
        with torch.no_grad():
            outputs = self._pytree.tree_leaves(self._module(*args, **kwargs))
        values = [  # numpy has no bfloat16: widened, exactly
            (o.float() if o.dtype == torch.bfloat16 else o).detach().numpy()
            for o in outputs
        ]
        return dict(zip(self.output_names, values, strict=True))


def _plain(value) -> np.ndarray:
    """`value` as a numpy array `.npz` keeps: bfloat16 (an ml_dtypes type,
    which numpy reloads as raw bytes) widened to float32, exactly."""
    array = np.asarray(value)
    if array.dtype.name == "bfloat16":
        return array.astype(np.float32)
    return array


def _generated(output: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """The next input from an output's last position: its argmax over the
    last axis for an integer input (greedy: the first largest), else the
    output itself, (batch, 1, ...) in the input's dtype."""
    last = output[:, -1:]
    if np.issubdtype(dtype, np.integer):
        return np.argmax(last, axis=-1).astype(dtype)
    return last.astype(dtype)


def _open(request: dict, signature: str):
    fmt, path = request["format"], request["path"]
    if fmt == "saved_model":
        return _SavedModel(path, signature)
    if fmt == "onnx":
        return _Onnx(path, signature)
    if fmt == "litert":
        return _LiteRT(path, signature)
    if fmt == "openvino":
        return _OpenVINO(path, signature, request.get("precision", "f32"))
    if fmt == "torch":
        return _Torch(path, signature)
    raise ValueError(f"unknown format {fmt!r}")


def serve(request: dict) -> dict:
    """Runs every step of every run of `request`; returns the reply.

    The reply's "stage" says where a failure happened: "load" (the runtime
    cannot open the artifact), "bind" (its names are not the exported
    ones) or "run" (with the run's index).
    """
    default, owner = request["signature"], request["owner"]
    names = [default] + [s for run in request["runs"] for s in run["signatures"]]
    opened = {}  # signature: (artifact, its input names, its output names)
    for signature in dict.fromkeys(names):
        try:
            artifact = _open(request, signature)
        except Exception as error:
            return _failure("load", error)
        wanted_in, wanted_out = request["input_names"], request["output_names"]
        positional = artifact.positional_inputs
        try:
            inputs = _bind(wanted_in, artifact.input_names, "inputs", owner, positional)
            outputs = _bind(wanted_out, artifact.output_names, "outputs", owner, False)
        except BindError as error:
            return _failure("bind", error)
        opened[signature] = (artifact, inputs, outputs)
    for index, run in enumerate(request["runs"]):
        state: dict[str, np.ndarray] = {}
        signatures = run["signatures"] or [default] * len(run["steps"])
        try:
            for step, signature in zip(run["steps"], signatures, strict=True):
                artifact, inputs, outputs = opened[signature]
                with np.load(step) as loaded:
                    arrays = {**{k: loaded[k] for k in loaded.files}, **state}
                produced = artifact({inputs[k]: v for k, v in arrays.items()})
                result = {name: _plain(produced[outputs[name]]) for name in outputs}
                np.savez(step + ".out.npz", **result)
                state = {inp: result[out] for out, inp in run["feedback"].items()}
                for out, inp in run["generated"].items():
                    state[inp] = _generated(result[out], arrays[inp].dtype)
        except Exception as error:
            return {**_failure("run", error), "run": index}
    artifact = opened[default][0]
    return {
        "ok": True,
        "input_names": artifact.input_names,
        "output_names": artifact.output_names,
        "description": artifact.description,
        "imported": [
            name for name in ("keras", "keras_selfattn") if name in sys.modules
        ],
    }


def _failure(stage: str, error: BaseException) -> dict:
    text = " ".join(str(error).split()) or type(error).__name__
    return {"ok": False, "stage": stage, "error": text}


def main(request_path: str) -> int:
    with open(request_path) as file:
        request = json.load(file)
    reply = serve(request)
    with open(request_path + ".reply.json", "w") as file:
        json.dump(reply, file)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    sys.exit(main(sys.argv[1]))
