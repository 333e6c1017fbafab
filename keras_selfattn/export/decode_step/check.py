"""The check of exported decoding steps: whole sequences decoded step by
step through each export, in a fresh process of its runtime, and through
Keras's cached calls, and those against the model's full forward."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import keras
import numpy as np

from keras_selfattn.attention.rope_frequencies import freeze, switch_length
from keras_selfattn.export.decode_step.graph import (
    INDEX_NAME,
    DecodeStep,
    build_decode_step,
    teacher_probe,
)
from keras_selfattn.export.parity import runner
from keras_selfattn.export.parity.engine import (
    artifact_paths,
    check_artifacts,
    check_tolerance,
    collect_artifacts,
)
from keras_selfattn.export.parity.report import ParityReport, finish_report
from keras_selfattn.export.parity.rules import DEFAULT_ATOL, DEFAULT_RTOL, parity_row
from keras_selfattn.export.signature import Signature
from keras_selfattn.self_attention import SelfAttention

# (batch, prompt length) of the sequences `verify_decode_step` decodes: one
# position per step from the start, a prompt of 3, and the whole sequence in
# one step (prompts longer than max_length are cut to it).
DEFAULT_SCHEDULES: tuple[tuple[int, int], ...] = ((1, 1), (2, 3), (3, 1 << 30))


def teacher_inputs(step: DecodeStep, batch: int, seed: int = 0) -> np.ndarray:
    """A whole random input sequence (batch, max_length, ...) without padding
    (`graph.teacher_probe`)."""
    return teacher_probe(step, step.max_length, batch, seed)


def schedule(step: DecodeStep, sequence: np.ndarray, prompt_length: int):
    """The `runner.Run` decoding `sequence`: the prompt, then one per step.

    The first step gets empty caches; later steps get the caches the step
    before returned (the run's feedback).
    """
    steps, index = [], 0
    while index < sequence.shape[1]:
        new = prompt_length if index == 0 else 1
        arrays = {
            step.input.name: sequence[:, index : index + new],
            INDEX_NAME: np.asarray(index, np.int32),
        }
        if index == 0:
            arrays.update(step.empty_caches(sequence.shape[0]))
        steps.append(arrays)
        index += new
    feedback = dict(zip(step.updated_cache_names, step.cache_names, strict=True))
    return runner.Run(tuple(steps), feedback)


def _reference_call(target: Signature):
    """`target.call_named`, under `jax.jit` on JAX: eagerly, every step's
    keys would have a new length (`cache_update_index` + new positions), and
    JAX compiles each op anew for each shape (about a second a step, most of
    an export's check). Compiled, the index is traced as in the exports (one
    program per input shape), with the model's variables as arguments."""
    if keras.backend.backend() != "jax":
        return target.call_named
    import jax

    variables = target.model.variables

    @jax.jit
    def stateless(values, arrays):
        mapping = list(zip(variables, values, strict=True))
        with keras.StatelessScope(state_mapping=mapping):
            return target.call_named(arrays)

    return lambda arrays: stateless([v.value for v in variables], arrays)


def keras_decode(step: DecodeStep, run: runner.Run) -> list[dict[str, np.ndarray]]:
    """Keras's cached calls over `run` (eager; compiled on JAX, see
    `_reference_call`): the exports' reference."""
    results, state, target = [], {}, step.target()
    call = _reference_call(target)
    for arrays in run.steps:
        outputs = call({**arrays, **state})
        result = {k: keras.ops.convert_to_numpy(v) for k, v in outputs.items()}
        results.append(result)
        state = {inp: result[out] for out, inp in run.feedback.items()}
    return results


def forward_positions(
    layers: Sequence[SelfAttention], prompt: int, max_length: int
) -> int:
    """How many leading positions of a decode (a prompt of `prompt`, then
    one per step, to `max_length`) one full forward pass computes: all, but
    for a LongRoPE layer (of `layers`, the step's) whose N
    (`original_max_position_embeddings`) is in [prompt, max_length): its
    calls ending past N rotate with the long table while the keys cached
    before keep the short one (the original model's rule, per call), which
    no single forward pass computes, so the first N are compared."""
    crossed = [
        switch
        for layer in layers
        if layer.rope_max_wavelength is not None
        and (switch := switch_length(freeze(layer.rope_frequency_scaling)))
        and prompt <= switch < max_length
    ]
    return min(crossed, default=max_length)


def verify_decode_step(
    model: keras.Model,
    saved_model_dir: str | os.PathLike | None = None,
    onnx_path: str | os.PathLike | None = None,
    *,
    max_length: int,
    litert_path: str | os.PathLike | None = None,
    openvino_path: str | os.PathLike | None = None,
    torch_path: str | os.PathLike | None = None,
    paths: Mapping[str, str | os.PathLike] | None = None,
    schedules: Sequence[tuple[int, int]] = DEFAULT_SCHEDULES,
    atol: float = DEFAULT_ATOL,
    rtol: float = DEFAULT_RTOL,
    seed: int = 0,
) -> ParityReport:
    """Decodes whole sequences step by step and compares every step.

    For each (batch, prompt length) in `schedules`, a random sequence of
    `max_length` positions (teacher forcing: the inputs are fixed, not
    generated) is decoded from empty caches: the prompt in one step, then
    one position per step. Rows of the report:

    - "keras_cache": Keras's cached calls, all steps' outputs concatenated,
      against the model's full uncached forward on the whole sequence (on
      its first N positions where a LongRoPE layer's tables switch at N
      inside the decode: `forward_positions`).
    - "saved_model" / "onnx" / "litert" / "openvino" / "torch": each step's
      output and updated caches against Keras's cached call on the same
      inputs and caches, the export decoding in a fresh process of its
      runtime (caches fed back there).

    With no export given, only the "keras_cache" rows are computed
    (whether the model decodes at all). The exports are given by their
    keywords (`saved_model_dir`, `onnx_path`, ... as in `verify`) or by
    `paths`, {format: path}, as in `verify`.

    Returns:
        The `ParityReport`, every row within |err| <= atol + rtol |keras|.

    Raises:
        ParityError: beyond tolerance, or if an export's names differ.
        ValueError: for an unsupported model or argument.
    """
    step = build_decode_step(model, max_length)
    atol = check_tolerance("atol", atol)
    rtol = check_tolerance("rtol", rtol)
    keywords = {
        "saved_model_dir": saved_model_dir,
        "onnx_path": onnx_path,
        "litert_path": litert_path,
        "openvino_path": openvino_path,
        "torch_path": torch_path,
    }
    paths = artifact_paths(keywords, paths)
    artifacts = (
        {} if all(p is None for p in paths.values()) else collect_artifacts(paths)
    )
    return check_step(model, step, artifacts, schedules, atol, rtol, seed)


def check_step(
    model: keras.Model,
    step: DecodeStep,
    artifacts: Mapping[str, runner.Artifact],
    schedules: Sequence[tuple[int, int]] = DEFAULT_SCHEDULES,
    atol: float = DEFAULT_ATOL,
    rtol: float = DEFAULT_RTOL,
    seed: int = 0,
) -> ParityReport:
    """The check `verify_decode_step` runs, on a step already built: the
    exporter passes its own (`DecodeStepExport`), `verify_decode_step`
    builds one from its arguments.

    Args:
        model: The model whose step `step` is (its full forward is the
            "keras_cache" rows' reference).
        step: The decoding step (`build_decode_step`).
        artifacts: {runtime label: artifact} (`collect_artifacts`), or {}.
        schedules, seed: As given to `verify_decode_step`.
        atol, rtol: Checked tolerances (`check_tolerance`).
    """
    runs, expected, labels, rows = [], [], [], []
    for number, (batch, prompt) in enumerate(schedules):
        prompt = min(prompt, step.max_length)
        label = f"{batch}x{step.max_length} prompt {prompt}"
        sequence = teacher_inputs(step, batch, seed + number)
        run = schedule(step, sequence, prompt)
        steps = keras_decode(step, run)
        compared = forward_positions(step.layers, prompt, step.max_length)
        full = keras.ops.convert_to_numpy(model(sequence[:, :compared], training=False))
        cached = np.concatenate([r[step.output_name] for r in steps], axis=1)
        cached = cached[:, :compared]
        rows.append(parity_row("keras_cache", label, [(full, cached)], atol, rtol))
        runs.append(run)
        expected.append(steps)
        labels.append(label)
    if artifacts:
        checked = check_artifacts(
            step.target(),
            artifacts,
            runs,
            expected,
            labels,
            atol,
            rtol,
            action="decoding {label}",
        )
        rows = [
            row for label in labels for row in [*rows, *checked] if row.shape == label
        ]
    worst = min(rows, key=lambda row: (row.ok, -row.max_abs_err))
    hint = (
        " (Keras's cached decode differs from the full forward: a layer "
        "outside SelfAttention mixes positions, so the model cannot be "
        "decoded step by step)"
        if worst.runtime == "keras_cache"
        else ""
    )
    return finish_report(rows, atol, rtol, "decode checks differ", hint)
