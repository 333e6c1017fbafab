"""The check of exported generators: each run in a fresh process of its
runtime against `keras_selfattn.generate` on the same requests, and the
"prefill" and "decode" pair of a format holding them
(`FormatRow.extra_signatures`: LiteRT) generating one token a call."""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator, Mapping

import keras
import numpy as np

from keras_selfattn.export import formats
from keras_selfattn.export.decode_step.graph import (
    INDEX_NAME,
    DecodeStep,
    build_decode_step,
)
from keras_selfattn.export.generator import near_ties
from keras_selfattn.export.generator.graph import (
    DECODE_SIGNATURE,
    PREFILL_SIGNATURE,
    Generator,
    build_generator,
    control_inputs,
    random_prompts,
)
from keras_selfattn.export.parity.engine import (
    artifact_paths,
    collect_artifacts,
    run_checked,
)
from keras_selfattn.export.parity.report import ParityReport, finish_report
from keras_selfattn.export.parity.rules import ParityRow, parity_row
from keras_selfattn.export.parity.runner import Artifact, Run
from keras_selfattn.generation import arguments, compiled
from keras_selfattn.generation.generate import generated
from keras_selfattn_runtimes import table

# Formats a generator can be written in (by TensorFlow, from every backend).
FORMATS = tuple(row.name for row in table.ROWS if row.generator)
# The check's report row of the LiteRT pair generating (`pair_runtime`).
PAIR_RUNTIME = "litert prefill/decode"
# The checks' generations: greedy, then seeded top-k / top-p with an end.
_SAMPLED = {"temperature": 0.9, "top_k": 12, "top_p": 0.9, "seed": 1234}
# Rows of the checks' requests and of the pair's, unless a format limits
# them (`Format.generator_rows`).
ROWS, PAIR_ROWS = 8, 4


def _sizes(generator: Generator) -> tuple[int, int]:
    """The checks' (prompt width, new tokens): up to 9 and 12 that fit."""
    width = max(1, min(9, generator.max_length // 2))
    return width, min(12, generator.max_length - width)


def requests(
    generator: Generator, seed: int = 0, rows: int = ROWS
) -> list[tuple[str, dict]]:
    """The checks' requests: `rows` prompts of mixed lengths (the first
    full), greedy and (token models) seeded top-k / top-p with an end
    token; (label, inputs)."""
    width, steps = _sizes(generator)
    prompts, lengths = random_prompts(generator.read, rows, width, seed)
    base = {
        generator.prompt_name: prompts,
        "prompt_lengths": lengths,
        "max_new_tokens": np.int32(steps),
    }
    if not generator.read.tokens:
        return [(f"{rows}x{width} +{steps}", base)]
    sampled = {**_SAMPLED, "top_k": min(_SAMPLED["top_k"], generator.read.vocabulary)}
    return [
        (
            f"{rows}x{width} +{steps} greedy",
            {**base, **control_inputs({}, generator.read)},
        ),
        (
            f"{rows}x{width} +{steps} sampled",
            {**base, **control_inputs({**sampled, "end_token": 0}, generator.read)},
        ),
    ]


def keras_generate(generator: Generator, request: dict) -> dict[str, np.ndarray]:
    """`keras_selfattn.generate` on an exported generator's request."""
    read = generator.read
    options = {}
    if read.tokens:
        temperature = float(request["temperature"])
        top_k, top_p = int(request["top_k"]), float(request["top_p"])
        sampling = temperature > 0
        options = {
            "temperature": temperature,
            "top_k": top_k if sampling and top_k < read.vocabulary else None,
            "top_p": top_p if sampling and top_p < 1 else None,
            "seed": int(request["seed"]),
            "end_token": None
            if int(request["end_token"]) < 0
            else int(request["end_token"]),
        }
    checked = arguments.request(
        read,
        request[generator.prompt_name],
        int(request["max_new_tokens"]),
        prompt_lengths=request["prompt_lengths"],
        max_length=generator.max_length,
        **options,
    )
    # The reference: the loop as a tf.function, without an XLA compile; the
    # loop that samples for greedy requests too, as the generator's graph
    # holds it (one loop traced for all the check's requests: 20-30 s a
    # trace for a 0.59 B Llama).
    result = generated(read, checked, jit=False, greedy_loop=False)
    return dict(
        zip(generator.output_names, (result.tokens, result.lengths), strict=True)
    )


@contextlib.contextmanager
def _reference(generator: Generator) -> Iterator[None]:
    """The context the reference is computed in: its traced loops are not
    kept past it (`compiled.not_kept`, `formats.released`), so the fresh
    processes after it run beside the model alone."""
    model = generator.read.model
    with formats.released(model), compiled.not_kept(model):
        yield


def pair_run(
    generator: Generator, step: DecodeStep, seed: int = 0, rows: int = PAIR_ROWS
) -> tuple[str, Run, dict]:
    """The greedy generation the LiteRT pair is checked on: `rows` prompts of
    one length through "prefill", then one "decode" call per new token, each
    fed the argmax of the last logits (value models: the last output) and
    the caches the call before returned.

    Returns:
        (label, the `Run`, the generator request whose tokens it must give).
    """
    width, steps = _sizes(generator)
    prompts, lengths = random_prompts(generator.read, rows, width, seed, mixed=False)
    request = {
        generator.prompt_name: prompts,
        "prompt_lengths": lengths,
        "max_new_tokens": np.int32(steps),
    }
    if generator.read.tokens:
        request.update(control_inputs({}, generator.read))
    prefill = {
        step.input.name: prompts,
        **step.empty_caches(len(prompts)),
        INDEX_NAME: np.asarray(0, np.int32),
    }
    decode = [{INDEX_NAME: np.asarray(width + k, np.int32)} for k in range(steps - 1)]
    run = Run(
        (prefill, *decode),
        dict(zip(step.updated_cache_names, step.cache_names, strict=True)),
        signatures=(PREFILL_SIGNATURE,) + (DECODE_SIGNATURE,) * (steps - 1),
        generated={step.output_name: step.input.name},
    )
    label = f"{rows}x{width} +{steps}" + (" greedy" if generator.read.tokens else "")
    return label, run, request


def pair_runtime(export_format: str) -> str:
    """The report's row of a format's "prefill" and "decode" pair."""
    return f"{export_format} prefill/decode"


@dataclasses.dataclass
class _Pair:
    """The LiteRT pair's check (`pair_run`): its decoding step, label, run
    and request, and the request's reference once computed."""

    step: DecodeStep
    label: str
    run: Run
    request: dict
    reference: dict[str, np.ndarray] | None = None


def _pair(generator: Generator, seed: int, rows: int) -> _Pair:
    """The pair's check of `rows` prompts, its reference not yet computed."""
    read = generator.read
    step = build_decode_step(read.model, generator.max_length, read.reading)
    return _Pair(step, *pair_run(generator, step, seed, rows))


def _pair_row(
    generator: Generator, artifact: Artifact, tolerance: float, pair: _Pair
) -> tuple[ParityRow, str | None]:
    """The artifact's "prefill" and "decode" generating `pair.run` in a
    fresh process, against its reference, `keras_selfattn.generate`'s tokens
    (`_near_ties`)."""
    step, label = pair.step, pair.label
    runtime = pair_runtime(artifact.format)
    outcome = run_checked(
        step.target(PREFILL_SIGNATURE),
        {runtime: artifact},
        [pair.run],
        [label],
        "generating {label} through prefill and decode",
        tolerance,
        tolerance,
    )[runtime]
    last = np.concatenate(
        [outputs[step.output_name][:, -1:] for outputs in outcome.outputs[0]], axis=1
    )
    produced = np.argmax(last, axis=-1) if generator.read.tokens else last
    wanted, wanted_lengths = (pair.reference[name] for name in generator.output_names)
    row = parity_row(runtime, label, [(wanted, produced)], tolerance, tolerance)
    counts = np.full(len(produced), produced.shape[1])
    return _near_ties(
        generator,
        row,
        pair.request,
        (produced, counts),
        (wanted, wanted_lengths),
        outcome.description,
    )


def _near_ties(
    generator: Generator,
    row: ParityRow,
    request: dict,
    generated: tuple[np.ndarray, np.ndarray],
    reference: tuple[np.ndarray, np.ndarray],
    description: Mapping[str, object],
) -> tuple[ParityRow, str | None]:
    """`row`, judged by `near_ties` where its tokens differ and the model's
    layers, or the artifact's (its runtime's `description`), round their
    inputs to integers; with the report's note then. `generated` and
    `reference`: the runtime's and Keras's (tokens, lengths); only the rows
    where they differ are replayed."""
    rounds = generator.read.reading.quantizes_inputs or description.get("rounds_inputs")
    if row.ok or not (generator.read.tokens and rounds):
        return row, None
    found = near_ties.ties(
        generator.read.model, request, generator.prompt_name, *generated, reference
    )
    if found is None:
        return row, None
    return dataclasses.replace(row, ok=True), (
        f"{row.runtime} on {row.shape}: {found} token(s) chosen where Keras's "
        "logits on the runtime's own tokens tie within "
        f"{near_ties.BAND:g} x their largest (a quantized model's rounding); "
        "every other token is Keras's choice"
    )


def verify_generator(
    model: keras.Model,
    saved_model_dir: str | os.PathLike | None = None,
    onnx_path: str | os.PathLike | None = None,
    *,
    max_length: int,
    litert_path: str | os.PathLike | None = None,
    paths: Mapping[str, str | os.PathLike] | None = None,
    seed: int = 0,
) -> ParityReport:
    """Runs exported generators in fresh processes of their runtimes and
    compares their outputs with `keras_selfattn.generate` on the same
    requests (`requests`): tokens and lengths must be identical (value
    models: values within float32 rounding, 1e-5). A LiteRT file (a format
    holding the pair: `FormatRow.extra_signatures`) also generates through
    its "prefill" and "decode" signatures (`pair_run`; report row "litert
    prefill/decode"), whose greedy tokens must be generate's. The
    generators are given by their keywords or by `paths`, {format: path}
    of `FORMATS`, as in `verify`.

    Returns:
        The `ParityReport`.

    Raises:
        ParityError: if any output differs, or an export's names differ.
    """
    generator = build_generator(model, max_length)
    keywords = {
        "saved_model_dir": saved_model_dir,
        "onnx_path": onnx_path,
        "litert_path": litert_path,
    }
    paths = artifact_paths(keywords, paths, FORMATS)
    return check_generator(generator, collect_artifacts(paths), seed)


def _unpacked(artifacts: Mapping[str, Artifact]) -> tuple[dict, list[str], int]:
    """`artifacts`, each with the runtime options its format checks a
    generator with (`Format.generator_runtime`: a large LiteRT file on the
    builtin kernels); with the report's notes, and the most rows every
    artifact's requests may hold (`Format.generator_rows`; `ROWS` if none
    limits them)."""
    runs, notes, rows = {}, [], ROWS
    for label, artifact in artifacts.items():
        export_format = formats.get(artifact.format)
        options, note = export_format.generator_runtime(artifact.path, artifact.options)
        runs[label] = dataclasses.replace(artifact, options=options)
        rows = min(rows, export_format.generator_rows(artifact.path) or rows)
        if note is not None:
            notes.append(note)
    return runs, notes, rows


@dataclasses.dataclass
class References:
    """The check's Keras side (`references`): its requests of `rows` rows
    from `seed` (label, inputs), each one's reference, and the LiteRT
    pair's check with its reference (None: no artifact holds the pair)."""

    seed: int
    rows: int
    labelled: list[tuple[str, dict]]
    expected: list[list[dict[str, np.ndarray]]]
    pair: _Pair | None

    def fits(self, seed: int, rows: int, paired: bool) -> bool:
        """Whether these are the references of a check of `rows` rows from
        `seed`, with the pair (`paired`) or without."""
        return (self.seed, self.rows, self.pair is not None) == (seed, rows, paired)


def references(generator: Generator, seed: int, rows: int, paired: bool) -> References:
    """The check's requests of `rows` rows and their references
    (`keras_generate`; `paired`: the pair's too), computed in one context:
    a request of the same shapes as one before it reuses that one's traced
    loop (a large file's requests and pair all hold one row)."""
    labelled = requests(generator, seed, rows)
    pair = _pair(generator, seed, min(rows, PAIR_ROWS)) if paired else None
    with _reference(generator):
        expected = [[keras_generate(generator, request)] for _, request in labelled]
        if pair is not None:
            pair.reference = keras_generate(generator, pair.request)
    return References(seed, rows, labelled, expected, pair)


def check_generator(
    generator: Generator,
    artifacts: Mapping[str, Artifact],
    seed: int = 0,
    computed: References | None = None,
) -> ParityReport:
    """The check `verify_generator` runs, on a generator already built: the
    exporter passes its own (`GeneratorExport`), `verify_generator` builds
    one from its arguments. A LiteRT file past the LiteRT format's
    `XNNPACK_CHECK_MAX_BYTES` runs on LiteRT's builtin kernels, and every
    artifact's requests (the pair's too) then hold one row, as the report
    notes.

    Args:
        generator: The generator (`build_generator`).
        artifacts: {runtime label: artifact} (`collect_artifacts`).
        seed: As given to `verify_generator`.
        computed: References computed before the artifacts were written
            (the exporter's, while LiteRT's converter ran), used where they
            are this check's (`References.fits`); else they are computed
            here.
    """
    artifacts, unpacked, most_rows = _unpacked(artifacts)
    paired = [a for a in artifacts.values() if table.BY_NAME[a.format].extra_signatures]
    if computed is None or not computed.fits(seed, most_rows, bool(paired)):
        computed = references(generator, seed, most_rows, bool(paired))
    labelled, expected, pair = computed.labelled, computed.expected, computed.pair
    labels = [label for label, _ in labelled]
    runs = [Run((request,)) for _, request in labelled]
    tolerance = 0.0 if generator.read.tokens else 1e-5
    outcomes = run_checked(
        generator.target(),
        artifacts,
        runs,
        labels,
        "generating {label}",
        tolerance,
        tolerance,
    )
    judged = []
    names = generator.output_names
    for index, (label, request) in enumerate(labelled):
        (wanted,) = expected[index]
        for runtime, outcome in outcomes.items():
            (produced,) = outcome.outputs[index]
            pairs = [(wanted[name], produced[name]) for name in names]
            row = parity_row(runtime, label, pairs, tolerance, tolerance)
            runtime_pair = tuple(produced[name] for name in names)
            keras_pair = tuple(wanted[name] for name in names)
            judged.append(
                _near_ties(
                    generator,
                    row,
                    request,
                    runtime_pair,
                    keras_pair,
                    outcome.description,
                )
            )
    for artifact in paired:
        judged.append(_pair_row(generator, artifact, tolerance, pair))
    rows = [row for row, _ in judged]
    notes = unpacked + [note for _, note in judged if note]
    return finish_report(rows, tolerance, tolerance, "generations differ", "", notes)
