"""tf2onnx's missing conversions: handlers of the TensorFlow ops it has no
conversion for, passed to its `process_tf_graph` by
`format.convert_to_onnx`.

- XlaDynamicUpdateSlice: the key/value cache write on TensorFlow (decoding
  steps, generators).
- Erfc: Keras's exact GELU on TensorFlow (`0.5 x erfc(-x / sqrt 2)`), as
  1 - Erf(x). 1 - erf(x) rounds erfc's tail below float32's epsilon to 0
  (erfc(4) = 1.5e-8): GELU of x < -5.6 gives exactly 0 instead of about
  -1e-8, an absolute error far below the float32 tolerance.
"""

from __future__ import annotations

import numpy as np


def dynamic_update_slice(ctx, node, name: str, args: list) -> None:
    """Rewrites an XlaDynamicUpdateSlice node into ONNX ops in place.

    `operand` with `update` written at `start` (clamped into the operand as
    XLA does): Where(Pad(ones, pads), Pad(update, pads), operand), with pads
    (start, operand.shape - update.shape - start) on every axis.
    """
    from onnx import TensorProto, helper
    from tf2onnx.utils import make_name

    operand, update, indices = node.input
    start = ctx.make_node("Cast", [indices], attr={"to": TensorProto.INT64})
    operand_shape = ctx.make_node("Shape", [operand])
    update_shape = ctx.make_node("Shape", [update])
    limit = ctx.make_node("Sub", [operand_shape.output[0], update_shape.output[0]])
    zero = ctx.make_const(make_name(f"{name}_zero"), np.zeros(1, np.int64))
    start = ctx.make_node("Min", [start.output[0], limit.output[0]])
    start = ctx.make_node("Max", [start.output[0], zero.output[0]])
    end = ctx.make_node("Sub", [limit.output[0], start.output[0]])
    pads = ctx.make_node("Concat", [start.output[0], end.output[0]], attr={"axis": 0})
    padded = ctx.make_node("Pad", [update, pads.output[0]])
    ones = ctx.make_node(
        "ConstantOfShape",
        [update_shape.output[0]],
        attr={"value": helper.make_tensor("one", TensorProto.UINT8, [1], [1])},
    )
    mask = ctx.make_node("Pad", [ones.output[0], pads.output[0]])
    mask = ctx.make_node("Cast", [mask.output[0]], attr={"to": TensorProto.BOOL})
    node.type = "Where"
    node.attr.clear()
    ctx.replace_inputs(node, [mask.output[0], padded.output[0], operand])


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
