"""tf2onnx's optimizers over a converted graph, without their copies.

tf2onnx's `optimize_graph` with `catch_errors` deep-copies the whole graph
before each optimizer of each round, and every optimizer rewrites the
graph's protos and prunes it even where it finds nothing to do: on a
generator of many layers, most of the conversion's time. `optimize` runs
the same optimizers, with the same result, without the copies and
without the optimizers of op types the graph lacks. tf2onnx is imported
on use.
"""

from __future__ import annotations

from collections.abc import Callable


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
        name: factory
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


def _op_types(graph) -> set[str]:
    """The op types of a tf2onnx graph and of its nodes' body graphs."""
    ops = set()
    for node in graph.get_nodes():
        ops.add(node.type)
        for body in (node.get_body_graphs() or {}).values():
            ops |= _op_types(body)
    return ops
