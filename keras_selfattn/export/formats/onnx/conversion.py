"""tf2onnx's conversion of a target, its weights never in a graph: the
TensorFlow graph it converts, and its optimizers without their copies.

The graph (`traced`, `graph_def`). tf2onnx's own `from_function` freezes
the variables into constants, once per function reading them (a
generator's prompt pass and its loop body), and runs grappler and its
passes over them: about 40 times the weights resident. Here the function
is traced with every variable of the model read as its current value
(`keras.StatelessScope`), which the trace captures as an input
placeholder: no graph holds a weight. Grappler then inlines the functions
the trace calls (loops kept as loops, tf2onnx's `Loop`s) and runs
tf2onnx's passes, as freezing and tf2onnx would, with the weights'
placeholders given unknown sizes while it runs: grappler feeds every
placeholder a tensor of its shape, which would allocate the weights again.

The optimizers (`optimize`). tf2onnx's `optimize_graph` with
`catch_errors` deep-copies the whole graph before each optimizer of each
round, and every optimizer rewrites the graph's protos and prunes it even
where it finds nothing to do: on a generator of many layers, most of the
conversion's time. `optimize` runs the same optimizers, with the same
result, without the copies and without the optimizers of op types the
graph lacks. Each optimizer then prunes the graph as tf2onnx's
`delete_unused_nodes` does, in one walk back from all the graph's outputs
and inputs (`_prune`) where tf2onnx walks back from each of them anew: a
loop body's outputs are its layers' caches, each reached through every
layer before it, so tf2onnx's pruning takes time in the square of the
layers (56 of the 117 s that a 28-layer, hidden-64 generator's export
took). And the nodes' protos, which tf2onnx writes after each optimizer
(making each `Loop`'s body anew and pruning it its way), are written once,
by `make_model` (`_pruning_once`): that export took 81 s, the same nodes.

TensorFlow and tf2onnx are imported on use.
"""

from __future__ import annotations

from collections.abc import Callable

import keras

from keras_selfattn.export.signature import Signature


def traced(target: Signature):
    """The target's concrete `tf.function`, traced with the model's
    variables read as their values (captured tensors that share the
    variables' memory: placeholders of the function, not variables).

    Raises:
        ValueError: if the function still reads a variable outside the
            model (it would be frozen into the converted graph).
    """
    import tensorflow as tf

    function = target.tf_function()
    values = [(v, tf.convert_to_tensor(v)) for v in target.model.variables]
    with keras.StatelessScope(state_mapping=values):
        concrete = function.get_concrete_function(*target.tf_specs())
    read = [t for t in concrete.captured_inputs if t.dtype == tf.resource]
    if read:
        raise ValueError(
            f"The {target.what}'s function reads {len(read)} TensorFlow "
            "variables outside its model's variables; the ONNX conversion "
            "takes the model's weights only"
        )
    return concrete


def graph_def(concrete, inputs: list[str], outputs: list[str]):
    """The function's GraphDef, functions inlined and optimized by grappler
    as tf2onnx's conversion does (`tf_loader.tf_optimize`), the weights'
    placeholders keeping their shapes."""
    import tensorflow as tf
    from tensorflow.python.grappler import tf_optimizer  # tf2onnx's own way
    from tf2onnx import tf_loader

    graph = concrete.graph.as_graph_def()
    _keep_control_flow(graph)
    captured = {inner.op.name for inner in concrete.graph.internal_captures}
    shapes = {}
    for node in graph.node:
        if node.name in captured and node.op == "Placeholder":
            shape = node.attr["shape"].shape
            shapes[node.name] = [dim.size for dim in shape.dim]
            for dim in shape.dim:
                dim.size = -1
    config = tf.compat.v1.ConfigProto()
    rewrite = config.graph_options.rewrite_options
    rewrite.min_graph_nodes = -1
    rewrite.optimizers.append("function")
    rewrite.function_optimization = rewrite.AGGRESSIVE
    with tf.Graph().as_default():
        meta_graph = tf.compat.v1.train.export_meta_graph(graph_def=graph)
        meta_graph.collection_def["train_op"].node_list.value.extend(inputs + outputs)
        graph = tf_optimizer.OptimizeGraph(config, meta_graph)
        graph = tf_loader.tf_optimize(inputs, outputs, graph)
    for node in graph.node:
        if node.name in shapes:
            for dim, size in zip(
                node.attr["shape"].shape.dim, shapes[node.name], strict=True
            ):
                dim.size = size
    return graph


def _keep_control_flow(graph) -> None:
    """Marks the GraphDef's loops and conditionals, its functions' included,
    to stay loops and conditionals through grappler (tf2onnx converts them
    to `Loop` and `If`), as TensorFlow's freezing does
    (`convert_to_constants.disable_lower_using_switch_merge`), in place."""
    nodes = list(graph.node)
    for function in graph.library.function:
        nodes += function.node_def
    for node in nodes:
        if node.op in _CONTROL_FLOW_OPS:
            node.attr["_lower_using_switch_merge"].b = False


# The ops `_keep_control_flow` marks.
_CONTROL_FLOW_OPS = frozenset({"If", "StatelessIf", "While", "StatelessWhile"})


def optimize(process: Callable[[], object]):
    """tf2onnx's optimizers over the graph `process()` converts, each one
    that fails skipped (tf2onnx's `catch_errors`).

    tf2onnx skips a failing optimizer by running each on a deep copy of the
    graph (every optimizer, every round: a third of the optimizers' time on
    a generator of many layers, and a copy of every constant). Here they
    run on the graph itself; only if one fails is the graph converted again
    and optimized tf2onnx's way. An optimizer of op types the graph lacks
    (`_OPTIMIZED_OPS`) is left out: it would change nothing, at the cost of
    every optimizer's update of the whole graph. Either way the optimizers
    that do not fail give the same graph.

    Args:
        process: Converts the TensorFlow graph (tf2onnx's
            `process_tf_graph`); called again only if an optimizer fails.

    Returns:
        The optimized tf2onnx graph.
    """
    from tf2onnx import optimizer

    converted = process()
    ops = _op_types(converted)
    optimizers = {
        name: _pruning_once(factory)
        for name, factory in optimizer._get_optimizers().items()
        if name not in _OPTIMIZED_OPS or _OPTIMIZED_OPS[name] & ops
    }
    try:
        return optimizer.optimize_graph(
            converted, catch_errors=False, optimizers=optimizers
        )
    except Exception:  # noqa: BLE001 - tf2onnx's own fallback decides
        return optimizer.optimize_graph(
            process(), catch_errors=True, optimizers=optimizers
        )


# tf2onnx's optimizers that change only nodes of these op types (which no
# other optimizer writes).
_OPTIMIZED_OPS = {
    "remove_redundant_upsample": {"Upsample"},
    "const_dequantize_optimizer": {"DequantizeLinear"},
    "q_dq_optimizer": {"QuantizeLinear", "DequantizeLinear"},
    "einsum_optimizer": {"Einsum"},
}


def _pruning_once(factory: type) -> type:
    """tf2onnx's optimizer class `factory`, its `optimize` as tf2onnx's
    (`GraphOptimizerBase.optimize`) but for two things. Its graph is pruned
    by `_prune`. And the nodes' protos are not written after each optimizer:
    no optimizer reads them (a node's inputs, outputs and attributes are
    read from its Python fields), and writing them makes each `Loop`'s body
    anew, pruned tf2onnx's way; `make_model` writes them all once, at the
    end."""

    class PruningOnce(factory):
        def optimize(self, graph, iteration):
            self.opt_iteration = iteration
            graph = self._optimize(graph)
            _prune(graph)
            return graph

    PruningOnce.__name__ = factory.__name__
    return PruningOnce


def _prune(graph) -> None:
    """tf2onnx's `graph.delete_unused_nodes(graph.outputs)`: keeps the nodes
    the graph's outputs and inputs are computed from (inputs of a node's
    body graphs included), then prunes the body graphs of those it keeps;
    the kept nodes stay in the graph's order."""
    if not graph.outputs:
        return

    def producer(name: str):
        return graph.get_node_by_output(name, search_in_parent_graphs=False)

    names = [*graph.outputs, *(node.output[0] for node in graph.inputs)]
    pending = [producer(name) for name in names]
    kept = set()
    while pending:
        node = pending.pop()
        if node is None or node in kept:
            continue
        kept.add(node)
        pending.extend(map(producer, [*node.input, *node.get_implicit_inputs()]))
    nodes = [node for node in graph.get_nodes() if node in kept]
    for node in nodes:
        for body in (node.get_body_graphs() or {}).values():
            _prune(body)
    graph.reset_nodes(nodes)


def _op_types(graph) -> set[str]:
    """The op types of a tf2onnx graph and of its nodes' body graphs."""
    ops = set()
    for node in graph.get_nodes():
        ops.add(node.type)
        for body in (node.get_body_graphs() or {}).values():
            ops |= _op_types(body)
    return ops
