"""int8 layers with Keras's activation quantizer (symmetric, per token) in
an ONNX graph: Keras's exact scheme on ONNX Runtime's integer matmul.

Per row of the input,
scale = high / (max |x| + epsilon) and y = x * scale, with the same float
operations as Keras (so the same integers q = round(y), |q| <= 127),
stored as q + 128: `QuantizeLinear(y, 1, 128)` (uint8, rounding half to
even as Keras's `round`). ONNX Runtime's fast x86 kernel multiplies
uint8 by int8; with VNNI or AMX (`vpdpbusd`, AMX tiles) it is exact, but
without (AVX2, AVX-512 before VNNI) it adds pairs of products in
saturating 16-bit lanes (`vpmaddubsw`), which codes up to 255 times
weights up to 127 overflow: there the file would compute something else
than on the machine that checked it. So the file
asks the machine that runs it: a probe multiplies the largest pairs the
codes can form (255 x 127 and 255 x -127, along a whole inner dimension)
on that same uint8 x int8 kernel (`MatMulInteger`, constants), and an
`If` on its exactness multiplies the codes by Keras's int8 integers W
(exact kernel) or by W + 128 as uint8 with zero point 128 (ONNX Runtime's
uint8 x uint8 kernel, which widens its products to 16 bits before
adding: exact on every CPU). ONNX Runtime folds the probe and the `If`
when the session loads (constant folding: the same kernel the matmuls
then run), so a session keeps one plain matmul per layer: the uint8 x
int8 one on VNNI / AMX CPUs, the uint8 x uint8 one elsewhere. W is
stored once; W + 128 is computed from it in the graph.
`MatMulIntegerToFloat` scales the int32 products by 1 / kernel_scale per
column and the result is multiplied by the row's (max |x| + epsilon) /
high: Keras divides by kernel_scale * scale, which rounds differently by
a few ulp (the integers, which decide the result, are the same). Layers
reading one input (query, key and value) share its quantization, each
with its own matmul. Keras's clip to [low, high] is left out where it
cannot bind (|x * scale| < high * (1 + 2**-23) rounds to at most high).

The nodes are added through `integer`'s graph builder (`make`, `node`,
`constant`: unique names), for its `rewrite`.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from keras_selfattn.export.quantized_kernels import QuantizedDense

# The probe's inner dimension: every pair of products along it is 255 x 127
# (or 255 x -127), the largest the shifted codes can form with Keras's
# integers; a kernel that saturates 16-bit pair sums gets every one wrong.
PROBE_INNER = 64


def _quantized_input(
    builder, x: str, activations, cache: dict, few_rows: bool
) -> tuple:
    """(uint8 codes, per-row 1 / scale) of `x` by Keras's AbsMaxQuantizer; shared
    by every layer reading the same tensor. The codes are Keras's integers +
    128."""
    if (x, activations) in cache:
        return cache[(x, activations)]
    low, high, epsilon = activations
    prefix = f"{x.replace(':', '_')}_int8"
    if few_rows:  # a loop body's new token: the fewest kernels
        largest = builder.reduce(
            "ReduceMax", builder.node("Abs", [x], f"{prefix}_abs_x"), f"{prefix}_abs"
        )
    else:
        # max |x| as max(max x, -min x): two reading passes, where Abs
        # would write a whole copy of x first (the same value, bit for bit).
        highest = builder.reduce("ReduceMax", x, f"{prefix}_max")
        lowest = builder.reduce("ReduceMin", x, f"{prefix}_min")
        negated = builder.node("Neg", [lowest], f"{prefix}_neg")
        largest = builder.node("Max", [highest, negated], f"{prefix}_abs")
    denominator = builder.node(
        "Add",
        [largest, builder.constant(f"{prefix}_eps", np.float32(epsilon))],
        f"{prefix}_den",
    )
    scale = builder.node(
        "Div",
        [builder.constant(f"{prefix}_high", np.float32(high)), denominator],
        f"{prefix}_scale",
    )
    scaled = builder.node("Mul", [x, scale], f"{prefix}_scaled")
    if low > -high:  # the clip can bind only when the range is narrower below
        scaled = builder.node(
            "Clip",
            [
                builder.node("Round", [scaled], f"{prefix}_rounded"),
                builder.constant(f"{prefix}_low", np.float32(low)),
                builder.constant(f"{prefix}_hi", np.float32(high)),
            ],
            f"{prefix}_clipped",
        )
    codes = builder.node(
        "QuantizeLinear",
        [
            scaled,
            builder.constant(f"{prefix}_unit", np.float32(1.0)),
            builder.constant(f"{prefix}_128", np.uint8(128)),
        ],
        f"{prefix}_u8",
    )
    # The output's per-row factor: 1 / scale, as (max + eps) / high (a
    # multiply by it costs a fraction of a divide by the scale, and differs
    # from Keras's division by an ulp, like the rest of the output side).
    inverse = builder.node(
        "Div",
        [denominator, builder.constant(f"{prefix}_high_again", np.float32(high))],
        f"{prefix}_inverse",
    )
    cache[(x, activations)] = (codes, inverse)
    return codes, inverse


def _kernel_is_exact(builder, cache: dict) -> str:
    """A boolean scalar, one per graph: whether the uint8 x int8 kernel of
    the machine running the file multiplies the probe (`PROBE_INNER`)
    exactly. Constants only, so ONNX Runtime computes it once, when the
    session loads, on the kernel the layers' matmuls use."""
    if "probe" not in cache:
        codes = np.full((2, PROBE_INNER), 255, np.uint8)
        weights = np.tile(np.array([127, -127], np.int8), (PROBE_INNER, 1))
        exact = codes.astype(np.int32) @ weights.astype(np.int32)
        products = builder.node(
            "MatMulInteger",
            [
                builder.constant("int8_probe_codes", codes),
                builder.constant("int8_probe_weights", weights),
            ],
            "int8_probe_products",
        )
        error = builder.node(
            "Abs",
            [
                builder.node(
                    "Sub",
                    [products, builder.constant("int8_probe_exact", exact)],
                    "int8_probe_difference",
                )
            ],
            "int8_probe_error",
        )
        worst = builder.node("ReduceMax", [error], "int8_probe_worst", keepdims=0)
        cache["probe"] = builder.node(
            "Equal",
            [worst, builder.constant("int8_probe_zero", np.int32(0))],
            "int8_probe_exact_kernel",
        )
    return cache["probe"]


def _branch(name: str, nodes: list[onnx.NodeProto]) -> onnx.GraphProto:
    """An `If` branch computing `nodes`, its output the last one's."""
    output = helper.make_tensor_value_info(nodes[-1].output[0], TensorProto.FLOAT, None)
    return helper.make_graph(nodes, name, [], [output])


def exact_int8(
    builder,
    x: str,
    output: str,
    quantized: QuantizedDense,
    cache,
    stored,
    few_rows: bool = False,
) -> None:
    """Keras's int8 scheme for one layer reading `x`: a `MatMulIntegerToFloat`
    of the input's codes (shared by the layers reading `x`: query, key and
    value) by the layer's kernel, times the row's 1 / scale; on the uint8 x
    int8 kernel where the probe finds it exact,
    else on uint8 x uint8 (module doc). One matmul per layer: measured
    faster than one over the three kernels side by side, whose wide output
    a Split then copies apart. The layer's integers and scales are stored
    once (`stored`: a layer read in a generator's prompt pass and in its
    loop body). `few_rows` (a generator's loop body, one new token a row):
    max |x| as `ReduceMax(Abs(x))`, two kernels where the main graph's
    two-pass form takes four."""
    codes, inverse = _quantized_input(
        builder, x, quantized.activations, cache, few_rows
    )
    name = quantized.layer.name
    if id(quantized) not in stored:
        stored[id(quantized)] = (
            builder.constant(f"{name}_kernel", quantized.integers.astype(np.int8)),
            builder.constant(
                f"{name}_inverse_scale", (1.0 / quantized.scale).astype("float32")
            ),
        )
    kernel, inverse_scale = stored[id(quantized)]
    operands = [
        builder.constant(f"{name}_unit", np.float32(1.0)),
        inverse_scale,
        builder.constant(f"{name}_zero_point", np.uint8(128)),
    ]
    signed = builder.make(
        "MatMulIntegerToFloat",
        [codes, kernel, *operands, builder.constant(f"{name}_int8_zero", np.int8(0))],
        f"{name}_products",
    )
    # W + 128 as uint8 (1 to 255), computed when the session loads
    wide = builder.make("Cast", [kernel], f"{name}_kernel_int16", to=TensorProto.INT16)
    shifted = builder.make(
        "Add",
        [wide.output[0], builder.constant(f"{name}_kernel_128", np.int16(128))],
        f"{name}_kernel_shifted",
    )
    unsigned = builder.make(
        "Cast", [shifted.output[0]], f"{name}_kernel_uint8", to=TensorProto.UINT8
    )
    widened = builder.make(
        "MatMulIntegerToFloat",
        [
            codes,
            unsigned.output[0],
            *operands,
            builder.constant(f"{name}_uint8_zero", np.uint8(128)),
        ],
        f"{name}_products_uint8",
    )
    products = builder.node(
        "If",
        [_kernel_is_exact(builder, cache)],
        f"{name}_products_checked",
        then_branch=_branch(f"{name}_uint8_x_int8", [signed]),
        else_branch=_branch(
            f"{name}_uint8_x_uint8", [wide, shifted, unsigned, widened]
        ),
    )
    builder.nodes.append(
        helper.make_node("Mul", [products, inverse], [output], name=output)
    )
