"""Runs exported artifacts in their own runtime, in a process of its own.

Started as a script (`python _runner_process.py REQUEST.json`), never
imported by the package's other modules at run time: it imports numpy and
the one runtime of the artifact it runs (TensorFlow for a SavedModel,
onnxruntime, ai_edge_litert, openvino, torch.export), never keras or
keras_selfattn, so a check through it proves the artifact stands alone.
As on a serving host, keras, keras_selfattn and JAX cannot be imported
here (marked absent in `sys.modules`): TensorFlow imports Keras and JAX by
itself when they are installed (0.2 GiB more resident), and does without
them.

The runtimes are `keras_selfattn_runtimes`, imported by name (the runner
puts the folder holding it on the process's path): it stands beside
keras_selfattn, whose `__init__` would import Keras.
The request (JSON) names the artifact's path, the module of `runtimes` that
loads it (its format's `FormatRow.runtime_module`) with that module's
options (OpenVINO's precision), and a list of runs.
A run is a list of steps, each an `.npz` of inputs keyed by the exporter's
input names; `feedback` maps output names to input names fed into the next
step (a decoding step's caches), `generated` output names to the input
their last position feeds, chosen as a generation chooses (`_generated`),
and `signatures` names each step's signature (the request's own when
empty; each is opened and bound by itself). The worker writes each step's
outputs, keyed by the artifact's own output names, to `<step file>.out.npz`,
and the reply (JSON) lists the artifact's input and output names, which of
keras and keras_selfattn were imported (none, where they are marked absent),
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

if __name__ == "__main__":
    sys.path.pop(0)  # this folder holds no runtime modules to import
    # The modules the runtimes do without, marked absent: importing one
    # raises ModuleNotFoundError, which optional imports expect.
    sys.modules.update(dict.fromkeys(("keras", "keras_selfattn", "jax")))

import numpy as np

import keras_selfattn_runtimes as runtimes

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
            artifact = runtimes.load(
                request["runtime"], request["path"], signature, **request["options"]
            )
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
            name for name in ("keras", "keras_selfattn") if sys.modules.get(name)
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
