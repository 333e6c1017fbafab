"""Artifacts run in fresh processes, one per runtime, all started at once.

`run_artifacts` writes the inputs as `.npz` files, starts
`_runner_process.py` once per artifact (each loads only its format's
runtime, without keras or keras_selfattn) and reads back every step's
outputs, keyed by the export target's output names.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence

import numpy as np

import keras_selfattn_runtimes
from keras_selfattn.export.signature import Signature
from keras_selfattn_runtimes import table

# A fresh runtime process: imports and a handful of calls.
_WORKER_TIMEOUT_S = 600
_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_runner_process.py")
# The folder holding `keras_selfattn_runtimes`, which the runtime process
# imports by name: first on its path.
_RUNTIMES_ROOT = os.path.dirname(
    os.path.dirname(os.path.abspath(keras_selfattn_runtimes.__file__))
)


@dataclasses.dataclass(frozen=True)
class Artifact:
    """An export on disk and how to run it.

    Attributes:
        format: A format's name (`formats.table.NAMES`).
        path: The SavedModel folder or the file.
        options: The keyword options of its runtime module's `load`
            (`runtimes`, the format's `FormatRow.runtime_module`): OpenVINO's
            {"precision": "bf16"}; none: the module's defaults.
    """

    format: str
    path: str
    options: Mapping[str, object] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Run:
    """A sequence of calls: each step's inputs, and outputs fed back.

    Attributes:
        steps: Each step's inputs keyed by input name (fed-back inputs left
            out after the first step).
        feedback: {output name: input name} carried into the next step.
        signatures: Each step's signature (a LiteRT generator's "prefill",
            then "decode"); empty: the export target's, for every step.
        generated: {output name: input name}: the output's last position
            becomes the next step's input, as a generation chooses it: its
            argmax over the last axis for an integer input (a token model's
            greedy token), else as it is (a value model's output).
    """

    steps: tuple[Mapping[str, np.ndarray], ...]
    feedback: Mapping[str, str] = dataclasses.field(default_factory=dict)
    signatures: tuple[str, ...] = ()
    generated: Mapping[str, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What one artifact's process returned.

    Attributes:
        outputs: Per run, per step: outputs keyed by the target's names
            (empty when `error` is set).
        error: One line saying why the artifact did not run, or "".
        stage: Where it failed: "load", "bind" (names), "run", "process"
            (the runtime process died); "" without error.
        run: The index of the run that failed at stage "run".
        imported: Which of keras and keras_selfattn the process imported
            (neither: the process marks them absent).
        description: How the artifact computes a quantized model:
            {"scheme": str, "exact": bool} and, where it rounds inputs
            Keras does not, "rounds_inputs", as the artifact says or its
            runtime shows ({} when neither says).
    """

    outputs: tuple[tuple[dict[str, np.ndarray], ...], ...]
    error: str = ""
    stage: str = ""
    run: int = -1
    imported: tuple[str, ...] = ()
    description: Mapping[str, object] = dataclasses.field(default_factory=dict)


def _last_line(path: str) -> str:
    with open(path, errors="replace") as file:
        lines = [line.strip() for line in file if line.strip()]
    return lines[-1] if lines else "no output"


def run_artifacts(
    target: Signature, artifacts: Mapping[str, Artifact], runs: Sequence[Run]
) -> dict[str, Outcome]:
    """Runs every artifact on every run, each in a process of its own.

    Args:
        target: The export target the artifacts were made from (names).
        artifacts: {label: artifact}.
        runs: The calls to make.

    Returns:
        {label: Outcome}.
    """
    with tempfile.TemporaryDirectory(prefix="keras_selfattn_verify_") as work:
        step_files = []
        for run_index, run in enumerate(runs):
            files = []
            for step_index, arrays in enumerate(run.steps):
                path = os.path.join(work, f"run{run_index}_step{step_index}.npz")
                np.savez(path, **{k: np.asarray(v) for k, v in arrays.items()})
                files.append(path)
            step_files.append(files)
        search = (_RUNTIMES_ROOT, os.environ.get("PYTHONPATH", ""))
        env = {
            **os.environ,
            "TF_CPP_MIN_LOG_LEVEL": "3",
            "PYTHONPATH": os.pathsep.join(path for path in search if path),
        }
        started = {}
        for number, (label, artifact) in enumerate(artifacts.items()):
            folder = os.path.join(work, f"artifact{number}")
            os.mkdir(folder)
            request = {
                "runtime": table.BY_NAME[artifact.format].runtime_module,
                "path": os.path.abspath(artifact.path),
                "options": dict(artifact.options),
                "signature": target.signature_name,
                "owner": target.what,
                "input_names": [spec.name for spec in target.inputs],
                "output_names": list(target.output_names),
                "runs": [
                    {
                        "steps": [
                            os.path.join(folder, os.path.basename(f)) for f in files
                        ],
                        "feedback": dict(run.feedback),
                        "signatures": list(run.signatures),
                        "generated": dict(run.generated),
                    }
                    for files, run in zip(step_files, runs, strict=True)
                ],
            }
            for files in step_files:
                for file in files:
                    os.link(file, os.path.join(folder, os.path.basename(file)))
            request_path = os.path.join(folder, "request.json")
            with open(request_path, "w") as file:
                json.dump(request, file)
            log = open(os.path.join(folder, "stderr.txt"), "w")
            process = subprocess.Popen(
                [sys.executable, _WORKER, request_path],
                stdout=log,
                stderr=log,
                stdin=subprocess.DEVNULL,
                env=env,
            )
            started[label] = (process, log, request, folder)
        return {label: _collect(*started_one) for label, started_one in started.items()}


def _collect(process, log, request, folder) -> Outcome:
    try:
        process.wait(timeout=_WORKER_TIMEOUT_S)
    except BaseException:
        process.kill()
        process.wait()
        raise
    finally:
        log.close()
    reply_path = os.path.join(folder, "request.json.reply.json")
    if not os.path.exists(reply_path):
        return Outcome(
            (),
            f"its runtime process exited with status {process.returncode}: "
            f"{_last_line(os.path.join(folder, 'stderr.txt'))}",
            "process",
        )
    with open(reply_path) as file:
        reply = json.load(file)
    if not reply["ok"]:
        return Outcome((), reply["error"], reply["stage"], reply.get("run", -1))
    outputs = []
    for run in request["runs"]:
        steps = []
        for step in run["steps"]:
            with np.load(step + ".out.npz") as loaded:
                steps.append({k: loaded[k] for k in loaded.files})
        outputs.append(tuple(steps))
    return Outcome(
        tuple(outputs),
        imported=tuple(reply["imported"]),
        description=reply.get("description") or {},
    )
