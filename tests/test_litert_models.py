"""LiteRT files of SelfAttention models, run in ai_edge_litert, against Keras.

Two problems of LiteRT export, each checked on the numbers of the converted
file (Keras's own float32 call is the reference) on shapes with padding:

- `chunk_size` is a memory option: traced within `dispatch.exact_unchunked()`
  a chunked model takes the exact unchunked path, which the converter turns
  into builtin LiteRT ops. Traced without it, the chunked path's loop over
  blocks needs TensorFlow's Flex ops ("Select TensorFlow op(s)"), which
  ai_edge_litert cannot run.
- Rotary models: the rotary table is built from float64 constants, the same
  to the bit in TensorFlow and in LiteRT (`rotary.table`). It used to be the
  runtime's own `sin` and `cos` of float32 angles, which differ between
  TensorFlow and LiteRT by 1-2 ulps; scores of tens amplified them past the
  export check (the issue's grouped-query, gated, rotary model with
  key_dim=6 and value_dim=10 was refused with max abs err 1.7e-3 at 2x512;
  here, with the old table, 7e-4 at 3x64 and 1.3e-3 at 2x128). Unequal key
  and value sizes play no part: the same model with key_dim = value_dim, or
  without the gate, fails alike, and without rotary passes.

Issue 39's model (`ISSUE_39`) is written and checked by `export_litert`.
Where the check refused it (2.0e-3 from Keras at 2x512 padded), the cause
is float32 conditioning, not LiteRT: with weights that give scores in the
hundreds, Keras's own output is ~2e-3 from the exact one, and so are
LiteRT's (XNNPACK or builtin kernels, every op within 2e-7 of float64 on
its inputs), Keras on JAX and PyTorch, and OpenVINO; which of them land
within 1e-4 of Keras on TensorFlow depends on each one's summation order,
so on the CPU. No argument causes it: without the gate, the grouped heads,
the bias or the scaling the errors are the same. The check now accepts
such a runtime: a row beyond the tolerance passes when the artifact is no
further from the model computed in float64 than Keras is
(`parity.rules.float64_judged`), and a runtime off by Keras's own distance
from it is still refused.

Every model is converted once per module (module-scoped fixtures); the longer
shapes are in the slow suite.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

import keras
import numpy as np
import pytest

from keras_selfattn import SelfAttention
from keras_selfattn.attention import dispatch, rotary
from keras_selfattn.export import export_litert, export_openvino, verify
from keras_selfattn.export.forward.graph import build_endpoint
from keras_selfattn.export.parity import exact, rules
from tests.reference import for_layer

pytestmark = pytest.mark.tensorflow_only("LiteRT conversion from TensorFlow")

FEATURES = 16
VOCAB = 50
# The export check's tolerance: |litert - keras| <= ATOL + RTOL * |keras|.
ATOL, RTOL = 1e-5, 1e-4
FAST_SHAPES = [(1, 1), (2, 7), (3, 33)]
SLOW_SHAPES = [(2, 128), (2, 300)]
# Head sizes of the rotary table checks (6: the issue's key_dim).
DEPTHS = (6, 64)
SHAPES = [*FAST_SHAPES, *(pytest.param(s, marks=pytest.mark.slow) for s in SLOW_SHAPES)]


def _convert(model: keras.Model, path: Path) -> str:
    """`model.export(format="litert")` traced within `exact_unchunked()`."""
    with dispatch.exact_unchunked(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.export(str(path), format="litert", verbose=False)
    return str(path)


def _runner(path: str, kernels: str = "xnnpack") -> Callable[[np.ndarray], np.ndarray]:
    """The file's single input to its single output, in ai_edge_litert, at any
    batch and time: with its default XNNPACK delegate ("xnnpack") or on
    LiteRT's own builtin kernels ("builtin")."""
    from ai_edge_litert.interpreter import Interpreter, OpResolverType

    resolver = {
        "xnnpack": OpResolverType.AUTO,
        "builtin": OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES,
    }[kernels]
    interpreter = Interpreter(model_path=path, experimental_op_resolver_type=resolver)

    def run(x: np.ndarray) -> np.ndarray:
        index = interpreter.get_input_details()[0]["index"]
        interpreter.resize_tensor_input(index, x.shape, strict=True)
        interpreter.allocate_tensors()
        interpreter.set_tensor(index, x)
        interpreter.invoke()
        return interpreter.get_tensor(interpreter.get_output_details()[0]["index"])

    return run


def _features(batch: int, time: int) -> np.ndarray:
    rng = np.random.default_rng(1000 * batch + time)
    return rng.standard_normal((batch, time, FEATURES)).astype("float32")


def _tokens(batch: int, time: int) -> np.ndarray:
    """Token ids; row 0 is full, the next rows padded at the end, the last
    (from 3 rows) at the start."""
    rng = np.random.default_rng(1000 * batch + time)
    tokens = rng.integers(1, VOCAB, size=(batch, time))
    for row in range(1, batch):
        length = max(1, time // (row + 1))
        if row == 2:
            tokens[row, : time - length] = 0
        else:
            tokens[row, length:] = 0
    return tokens.astype("int32")


def _check(model: keras.Model, run, x: np.ndarray) -> None:
    expected = keras.ops.convert_to_numpy(model(x))
    got = run(x)
    assert got.shape == expected.shape
    error = np.abs(got - expected)
    allowed = ATOL + RTOL * np.abs(expected)
    assert np.all(error <= allowed), (
        f"shape {x.shape}: max abs err {error.max():.3g}, "
        f"{int(np.sum(error > allowed))} elements beyond the tolerance"
    )


def _token_model(layer: SelfAttention) -> keras.Model:
    tokens = keras.Input((None,), dtype="int32", name="tokens")
    embedded = keras.layers.Embedding(VOCAB, FEATURES, mask_zero=True)(tokens)
    return keras.Model(tokens, layer(embedded))


@pytest.fixture(scope="module")
def chunked_float(tmp_path_factory):
    """SelfAttention(num_heads=2, chunk_size=16) on float features, converted."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((None, FEATURES), name="x")
    layer = SelfAttention(num_heads=2, chunk_size=16)
    model = keras.Model(inputs, layer(inputs))
    path = _convert(model, tmp_path_factory.mktemp("litert") / "chunked.tflite")
    return model, layer, _runner(path)


@pytest.fixture(scope="module")
def chunked_tokens(tmp_path_factory):
    """Padded tokens into a causal, windowed SelfAttention with chunk_size=4."""
    keras.utils.set_random_seed(1)
    layer = SelfAttention(
        num_heads=2, use_bias=True, causal=True, sliding_window=9, chunk_size=4
    )
    model = _token_model(layer)
    path = _convert(model, tmp_path_factory.mktemp("litert") / "tokens.tflite")
    return model, layer, _runner(path)


@pytest.fixture(scope="module")
def rotary_issue(tmp_path_factory):
    """The issue's model (grouped-query, gated, rotary, causal, key_dim 6 and
    value_dim 10), with weights large enough for scores of tens: a ulp of
    difference in the rotary table moves its outputs past the tolerance."""
    layer = SelfAttention(
        num_heads=2,
        key_dim=6,
        value_dim=10,
        num_key_value_heads=1,
        use_gate=True,
        rope_max_wavelength=10000,
        causal=True,
    )
    model = _token_model(layer)
    rng = np.random.default_rng(0)
    for weight in model.weights:
        value = 2.0 * rng.standard_normal(tuple(weight.shape))
        weight.assign(value.astype("float32"))
    path = _convert(model, tmp_path_factory.mktemp("litert") / "rotary.tflite")
    return model, _runner(path)


@pytest.mark.parametrize("shape", SHAPES)
def test_chunked_model_converts_unchunked(chunked_float, shape):
    model, layer, run = chunked_float
    x = _features(*shape)
    if shape[1] > 16:  # Keras computes it in blocks, the file whole
        assert layer.implementation(x) == "chunked"
    _check(model, run, x)


@pytest.mark.parametrize("shape", SHAPES)
def test_chunked_model_with_padding_converts_unchunked(chunked_tokens, shape):
    model, _, run = chunked_tokens
    _check(model, run, _tokens(*shape))


def test_keras_keeps_the_chunked_path_after_conversion(chunked_tokens):
    """The context only lasts while the export traces."""
    _, layer, _ = chunked_tokens
    x = np.zeros((2, 9, FEATURES), "float32")
    assert layer.implementation(x) == "chunked"
    with dispatch.exact_unchunked():
        assert layer.implementation(x) == "explicit"
    assert layer.implementation(x) == "chunked"


# Not longer: with these weights (scores of tens) float32 accumulation
# order alone moves a few outputs past the tolerance at 128 and 300
# positions on an AVX2 CPU (measured 3.6e-4 and 1.0e-3, with LiteRT's
# XNNPACK delegate or without; an AVX-512 CPU passed): that is the model's
# conditioning, not the table, which test_rotary_table_is_the_same_in_litert
# _and_exact checks to the bit at those lengths.
@pytest.mark.parametrize("shape", [(2, 33), (3, 64)])
def test_rotary_grouped_gated_model_matches_keras(rotary_issue, shape):
    model, run = rotary_issue
    _check(model, run, _tokens(*shape))


@pytest.fixture(scope="module")
def rotary_table_file(tmp_path_factory):
    """`rotary.table(time, depth, 10000, offset=offset)` for each of
    `DEPTHS`, traced with time and offset unknown, converted to LiteRT
    builtins."""
    import tensorflow as tf

    @tf.function(
        input_signature=[tf.TensorSpec((), tf.int32), tf.TensorSpec((), tf.int32)]
    )
    def tables(time, offset):
        return tf.concat(
            [tf.stack(rotary.table(time, d, 10000.0, 1.0, offset)) for d in DEPTHS],
            axis=-1,
        )

    converter = tf.lite.TFLiteConverter.from_concrete_functions(
        [tables.get_concrete_function()], tables
    )
    converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS]
    path = tmp_path_factory.mktemp("litert") / "table.tflite"
    path.write_bytes(converter.convert())
    from ai_edge_litert.interpreter import Interpreter

    interpreter = Interpreter(model_path=str(path))

    def run(time: int, offset: int) -> dict[int, np.ndarray]:
        """{depth: (2, T, depth) cosines and sines}."""
        inputs = {"time": time, "offset": offset}
        interpreter.allocate_tensors()
        for detail in interpreter.get_input_details():
            name = next(n for n in inputs if n in detail["name"])
            interpreter.set_tensor(detail["index"], np.array(inputs[name], np.int32))
        interpreter.invoke()
        output = interpreter.get_output_details()[0]["index"]
        both = interpreter.get_tensor(output)
        parts = np.split(both, np.cumsum(DEPTHS)[:-1], axis=-1)
        return dict(zip(DEPTHS, parts, strict=True))

    return run


def _true_table(time: int, depth: int, offset: int) -> np.ndarray:
    """(2, T, D) cosines and sines, in float64."""
    positions = np.arange(offset, offset + time, dtype=np.float64)
    angles = positions[:, None] / 10000.0 ** (np.arange(0, depth, 2) / depth)
    angles = np.concatenate([angles, angles], axis=-1)
    return np.stack([np.cos(angles), np.sin(angles)])


@pytest.mark.parametrize(
    "time,offset", [(1, 0), (33, 0), (512, 0), (7, 4093), (5, 100_000), (3, 2**31 - 4)]
)
def test_rotary_table_is_the_same_in_litert_and_exact(rotary_table_file, time, offset):
    """The same bits as Keras's eager table (built with only the digits its
    positions need, the file with all of them), within 3e-7 of float64 at
    any position (float32 angles lost p * 2^-24 radians)."""
    found = rotary_table_file(time, offset)
    for depth in DEPTHS:
        eager = np.stack(
            [
                keras.ops.convert_to_numpy(t)
                for t in rotary.table(time, depth, 10000.0, offset=offset)
            ]
        )
        np.testing.assert_array_equal(found[depth], eager)
        np.testing.assert_allclose(
            eager, _true_table(time, depth, offset), atol=3e-7, rtol=0
        )


# Issue 39's model: refused by the LiteRT export check (2.0e-3 from Keras at
# 2x512 with padding, on another CPU). Built as a user builds it (Keras's
# initializers), it is written and checked here.
ISSUE_39 = dict(
    num_heads=4,
    key_dim=6,
    value_dim=10,
    num_key_value_heads=1,
    rope_max_wavelength=500,
    rope_scaling_factor=2.0,
    use_gate=True,
    use_bias=True,
)


def _float64_error(model: keras.Model, layer, x: np.ndarray, got: np.ndarray):
    """Largest |got - exact| over the real (unpadded) positions, and the
    tolerance's worst use (largest err / (ATOL + RTOL |exact|)), against the
    float64 numpy reference of the layer on the model's embedded tokens."""
    embedded = keras.ops.convert_to_numpy(model.layers[1](x)).astype("float64")
    exact = for_layer(layer, embedded, padding_mask=x != 0)[0]
    real = (x != 0)[..., None]
    error = np.abs(got.astype("float64") - exact) * real
    return error.max(), (error / (ATOL + RTOL * np.abs(exact))).max()


@pytest.mark.slow
def test_issue_39_model_exports_and_matches_float64(tmp_path):
    """`export_litert` writes it (its own check runs 1x1 to 2x512 padded in a
    fresh process, and raises ParityError beyond the tolerance), and the
    file is within the tolerance of the exact outputs at 2x512 padded, with
    XNNPACK and on LiteRT's builtin kernels."""
    keras.utils.set_random_seed(0)
    layer = SelfAttention(**ISSUE_39)
    model = _token_model(layer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        path = export_litert(model, tmp_path / "issue_39.tflite")
    x = _tokens(2, 512)
    for kernels in ("xnnpack", "builtin"):
        error, used = _float64_error(model, layer, x, _runner(path, kernels)(x))
        assert used <= 1.0, f"{kernels}: max abs err {error:.3g} from float64"


@pytest.fixture(scope="module")
def issue_39_large_scores(tmp_path_factory):
    """Issue 39's model with weights 2 * N(0, 1): scores in the hundreds
    (ulps of 6e-5), where float32 itself is ~2e-3 from the exact outputs."""
    keras.utils.set_random_seed(0)
    layer = SelfAttention(**ISSUE_39)
    model = _token_model(layer)
    rng = np.random.default_rng(0)
    for weight in model.weights:
        weight.assign(2.0 * rng.standard_normal(tuple(weight.shape)).astype("float32"))
    path = _convert(model, tmp_path_factory.mktemp("litert") / "large.tflite")
    return model, layer, path


# Measured on the 2-core AMD EPYC (AVX-512 VNNI) at 2x512 padded, largest
# error from float64: Keras (TensorFlow) 1.8e-3, the file 1.8e-3 with
# XNNPACK and 2.2e-3 on the builtin kernels (every op within 2e-7 relative
# of float64 on its own inputs); Keras on JAX 2.5e-3 and PyTorch 2.5e-3
# (3.4e-3 and 1.8e-3 from Keras on TensorFlow: refused by the same check).
@pytest.mark.slow
@pytest.mark.parametrize("kernels", ["xnnpack", "builtin"])
def test_issue_39_large_scores_litert_as_exact_as_keras(issue_39_large_scores, kernels):
    """Where the export check refuses this model, LiteRT is not the cause:
    Keras's own float32 output is as far from the exact one, and the file
    stays within 3x Keras's distance from it (a runtime that lost precision,
    e.g. bfloat16 products, would be ~50x)."""
    model, layer, path = issue_39_large_scores
    x = _tokens(2, 512)
    own, _ = _float64_error(model, layer, x, keras.ops.convert_to_numpy(model(x)))
    found, _ = _float64_error(model, layer, x, _runner(path, kernels)(x))
    assert own > 1e-4, f"Keras is {own:.3g} from float64: not the conditioned case"
    assert found <= 3 * own, f"{kernels}: {found:.3g} from float64, Keras {own:.3g}"


@pytest.fixture(scope="module")
def large_scores_float64(issue_39_large_scores):
    """(tokens, Keras's output, the model's output in float64) at 2x512
    padded: the check's second reference (`parity.exact`)."""
    model, _, _ = issue_39_large_scores
    x = _tokens(2, 512)
    reference = exact.Float64Reference(build_endpoint(model), None, [{"tokens": x}])
    (outputs,) = reference([0])[0]
    keras_out = keras.ops.convert_to_numpy(model(x))
    return x, keras_out, next(iter(outputs.values()))


def _judged(keras_out, float64_out, actual) -> rules.ParityRow:
    """One run's row, beyond the tolerance, judged against float64."""
    row = rules.ParityRow("litert", "2x512 padded", 0.0, 0.0, False)
    triples = [[(keras_out, float64_out, actual)]]
    return rules.float64_judged([row], triples, ATOL, RTOL)[0]


# Behaviour changed by the float64 reference: OpenVINO (2.5e-3 from Keras
# at 2x512 padded on the AMD EPYC, 2.5e-3 on the Intel Xeon) and LiteRT's
# builtin kernels (3.1e-3 and 3.2e-3) are beyond the check's tolerance,
# which refused them; both are as far from the model in float64 as Keras
# is, and now pass.
@pytest.mark.slow
def test_issue_39_large_scores_pass_the_export_check(issue_39_large_scores, tmp_path):
    """`export_openvino` writes it (its check ran), and `verify` passes the
    LiteRT file and the OpenVINO IR, judging the rows beyond the tolerance
    against the model in float64."""
    model, _, path = issue_39_large_scores
    openvino = export_openvino(model, tmp_path / "large.xml")
    report = verify(model, litert_path=path, openvino_path=openvino)
    assert report.ok, report.table()
    beyond = [row for row in report.rows if row.float64_err is not None]
    assert any(row.runtime == "openvino" for row in beyond), report.table()
    for row in beyond:
        assert row.max_abs_err > 1e-4 and row.keras_float64_err > 1e-4, row


@pytest.mark.slow
def test_issue_39_large_scores_builtin_kernels_pass_the_float64_rule(
    issue_39_large_scores, large_scores_float64
):
    """LiteRT's builtin kernels sum in another order than TensorFlow: beyond
    the tolerance from Keras, within the float64 rule."""
    _, _, path = issue_39_large_scores
    x, keras_out, float64_out = large_scores_float64
    found = _runner(path, "builtin")(x)
    assert not rules.compare(keras_out, found, ATOL, RTOL)[2]
    row = _judged(keras_out, float64_out, found)
    assert row.ok, row
    assert row.keras_float64_err > 1e-4, row  # the ill-conditioned case


@pytest.mark.slow
def test_issue_39_large_scores_a_miscomputing_runtime_is_refused(
    issue_39_large_scores, large_scores_float64
):
    """The file's own outputs pass; the same outputs off by Keras's own
    largest distance from float64 on every element, or by 4 times it on
    one, are refused."""
    _, _, path = issue_39_large_scores
    x, keras_out, float64_out = large_scores_float64
    found = _runner(path)(x)
    assert _judged(keras_out, float64_out, found).ok
    own = float(np.abs(keras_out - float64_out).max())
    everywhere = _judged(keras_out, float64_out, found + np.float32(own))
    assert not everywhere.ok and everywhere.rms_ratio > rules.FLOAT64_MARGIN
    # The real output nearest 0, where the tolerance is atol alone.
    where = np.unravel_index(
        np.argmin(np.where((x != 0)[..., None], np.abs(float64_out), np.inf)),
        found.shape,
    )
    one = found.copy()
    one[where] = float64_out[where] + 4 * own
    assert not _judged(keras_out, float64_out, one).ok
