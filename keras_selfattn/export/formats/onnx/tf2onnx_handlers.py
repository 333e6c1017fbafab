"""tf2onnx's missing conversions: handlers of the TensorFlow ops it has no
conversion for, passed to its `process_tf_graph` by
`format.convert_to_onnx`.

- XlaDynamicUpdateSlice: the key/value cache write on TensorFlow (decoding
  steps, generators), as one ScatterND.
- Erfc: Keras's exact GELU on TensorFlow (`0.5 x erfc(-x / sqrt 2)`), as
  1 - Erf(x). 1 - erf(x) rounds erfc's tail below float32's epsilon to 0
  (erfc(4) = 1.5e-8): GELU of x < -5.6 gives exactly 0 instead of about
  -1e-8, an absolute error far below the float32 tolerance.
"""

from __future__ import annotations

import numpy as np


def _scattered_axes(ctx, operand: str, update: str, rank: int) -> int:
    """How many leading axes the write's indices must name: up to the last
    axis whose operand and update sizes are not the same known size (the
    later ones the update spans whole, XLA's clamped start 0 there)."""
    operand_shape, update_shape = ctx.get_shape(operand), ctx.get_shape(update)
    if operand_shape is None or update_shape is None:
        return rank
    if len(operand_shape) != len(update_shape):
        return rank
    axes = 1
    for axis, (full, part) in enumerate(zip(operand_shape, update_shape, strict=True)):
        if full is None or full < 0 or full != part:
            axes = axis + 1
    return axes


def dynamic_update_slice(ctx, node, name: str, args: list) -> None:
    """Rewrites an XlaDynamicUpdateSlice node into ONNX ops in place.

    `operand` with `update` written at `start` (clamped into the operand as
    XLA does): one ScatterND of `update` at the indices of its elements'
    first k axes (`_scattered_axes`; a key/value cache `(B, 2, L, G, K)`:
    3), each axis's `start + CumSum(ones, exclusive)`. The indices depend
    only on `start` and the update's shape, the same in every layer of a
    model (`common_nodes` keeps one of them); each layer copies its cache
    once, where a `Where` over padded copies of the update and of a mask
    read and wrote it about three times (2.5 times the bytes).
    """
    from onnx import TensorProto, helper
    from tf2onnx.utils import make_name

    def const(label: str, value: np.ndarray) -> str:
        return ctx.make_const(make_name(f"{name}_{label}"), value).output[0]

    operand, update, indices = node.input
    known = ctx.get_shape(operand) or ctx.get_shape(update)
    rank = len(known) if known is not None else ctx.get_shape(indices)[0]
    axes = _scattered_axes(ctx, operand, update, rank)
    start = ctx.make_node("Cast", [indices], attr={"to": TensorProto.INT64})
    operand_shape = ctx.make_node("Shape", [operand])
    update_shape = ctx.make_node("Shape", [update])
    limit = ctx.make_node("Sub", [operand_shape.output[0], update_shape.output[0]])
    zero = const("zero", np.zeros(1, np.int64))
    start = ctx.make_node("Min", [start.output[0], limit.output[0]])
    start = ctx.make_node("Max", [start.output[0], zero])
    to = const("to", np.array([axes], np.int64))
    leading = ctx.make_node("Slice", [update_shape.output[0], zero, to])
    ones = ctx.make_node(
        "ConstantOfShape",
        [leading.output[0]],
        attr={"value": helper.make_tensor("one", TensorProto.INT64, [1], [1])},
    )
    columns = []
    last = const("last", np.array([-1], np.int64))
    for axis in range(axes):
        position = const(f"axis{axis}", np.array(axis, np.int64))
        counted = ctx.make_node(
            "CumSum", [ones.output[0], position], attr={"exclusive": 1}
        )
        at = const(f"at{axis}", np.array([axis], np.int64))
        past = const(f"past{axis}", np.array([axis + 1], np.int64))
        first = ctx.make_node("Slice", [start.output[0], at, past])
        shifted = ctx.make_node("Add", [counted.output[0], first.output[0]])
        columns.append(ctx.make_node("Unsqueeze", [shifted.output[0], last]).output[0])
    grid = ctx.make_node("Concat", columns, attr={"axis": -1})
    node.type = "ScatterND"
    node.attr.clear()
    ctx.replace_inputs(node, [operand, grid.output[0], update])


def complementary_error_function(ctx, node, name: str, args: list) -> None:
    """Rewrites an Erfc node into Sub(1, Erf(x)) in place."""
    (x,) = node.input
    dtype = ctx.get_dtype(x)
    from onnx import helper

    one = ctx.make_const(
        f"{name}_one", np.ones((), helper.tensor_dtype_to_np_dtype(dtype))
    )
    erf = ctx.make_node("Erf", [x])
    node.type = "Sub"
    node.attr.clear()
    ctx.replace_inputs(node, [one.output[0], erf.output[0]])


# tf2onnx's `custom_op_handlers`: op type -> (handler, extra args).
CUSTOM_OP_HANDLERS = {
    "XlaDynamicUpdateSlice": (dynamic_update_slice, []),
    "Erfc": (complementary_error_function, []),
}
