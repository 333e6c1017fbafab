"""tf2onnx handler of XlaDynamicUpdateSlice, the key/value cache write on TF.

tf2onnx has no conversion of its own for XlaDynamicUpdateSlice; the
converter (`onnx.convert_to_onnx`, used by the decode step) passes
`CUSTOM_OP_HANDLERS` to `tf2onnx.convert.from_function`.
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


# tf2onnx's `custom_op_handlers`: op type -> (handler, extra args).
CUSTOM_OP_HANDLERS = {"XlaDynamicUpdateSlice": (dynamic_update_slice, [])}
