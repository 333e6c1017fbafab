"""tf2onnx's conversion of a `tf.function` whose weights come near
protobuf's 2 GiB.

`tf2onnx.convert.from_function` freezes the variables into a TensorFlow
GraphDef, which protobuf cannot hold past 2 GiB. Its `large_model` mode
keeps the constants out of that GraphDef (`compress_graph_def`), then
moves them to its own external storage (a zip), a step that calls NumPy's
`product`, which NumPy 2 removed. This is the same conversion, from the
same tf2onnx functions, with the constants kept out of the GraphDef and
left inside the ONNX model (in memory, where protobuf's limit does not
apply): the caller writes them as ONNX external data.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import onnx


def from_function(
    function, input_signature: Sequence, opset: int, custom_op_handlers: Mapping
) -> onnx.ModelProto:
    """`tf2onnx.convert.from_function(..., large_model=True)`'s model, its
    weights inline."""
    import tensorflow as tf
    from tf2onnx import optimizer, tf_loader
    from tf2onnx.convert import tensor_names_from_structed
    from tf2onnx.tf_utils import compress_graph_def
    from tf2onnx.tfonnx import process_tf_graph

    concrete = function.get_concrete_function(*input_signature)
    inputs = [t.name for t in concrete.inputs if t.dtype != tf.dtypes.resource]
    outputs = [t.name for t in concrete.outputs if t.dtype != tf.dtypes.resource]
    renames = tensor_names_from_structed(concrete, inputs, outputs)
    with tf.device("/cpu:0"):
        frozen = tf_loader.from_function(concrete, inputs, outputs, large_model=True)
        with tf.Graph().as_default() as graph:
            constants = compress_graph_def(frozen)
            tf.import_graph_def(frozen, name="")
            onnx_graph = process_tf_graph(
                graph,
                const_node_values=constants,
                custom_op_handlers=dict(custom_op_handlers),
                continue_on_error=True,
                opset=opset,
                input_names=inputs,
                output_names=outputs,
                tensors_to_rename=renames,
            )
            onnx_graph = optimizer.optimize_graph(onnx_graph, catch_errors=False)
            return onnx_graph.make_model(f"converted from {concrete.name}")
