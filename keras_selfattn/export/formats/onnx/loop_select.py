"""A `Loop` body's select on a request-fixed condition as an ONNX `If`.

The generator's token choice is `where(temperature > 0, sampled, greedy)`,
traced for converters as a select (`sampling.next_token`), which tf2onnx
writes for integers as arithmetic:

    Add(Mul(Cast(c), sampled), Mul(greedy, Cast(Not(c))))

so every greedy token also runs the sampling (two sorts of the vocabulary).
Once `c` is fixed for the request (read from the outer scope: after
`loop_invariant`'s hoisting), the nodes only `sampled` needs move into an
`If(c)` whose other branch returns `greedy`: the select then gives the
same integers either way, and a greedy request skips the sampling.
"""

from __future__ import annotations

import onnx

from keras_selfattn.export.formats.onnx import graph as graph_lib


def branch_selects(proto: onnx.ModelProto, loop: onnx.NodeProto) -> int:
    """Rewrites each such select of the body of `loop` (a node of `proto`'s
    main graph); returns how many."""
    graph = proto.graph
    body = next(a.g for a in loop.attribute if a.name == "body")
    graph_lib.topological_sort(body)
    types = _types(proto, loop)
    outer = {name: node for node in graph.node for name in node.output}
    count, seen = 0, set()
    while True:  # a rewrite replaces the body's nodes: look again each time
        inner = {name: node for node in body.node for name in node.output}
        found = [
            (add, match)
            for add in body.node
            if add.op_type == "Add" and add.output[0] not in seen
            for match in [_match(add, inner, outer)]
            if match is not None
        ]
        if not found:
            break
        add, (condition, selected, sampled, greedy) = found[0]
        seen.add(add.output[0])
        if _rank(types.get(condition)) != 0 or not _is_integer(types.get(sampled)):
            continue
        elem_type = types[sampled].tensor_type.elem_type
        count += _move_into_if(
            body, add, selected, (condition, sampled, greedy), elem_type
        )
    if count:
        graph_lib.topological_sort(body)
    return count


def _rank(value_type: onnx.TypeProto | None) -> int | None:
    if value_type is None or not value_type.tensor_type.HasField("shape"):
        return None
    return len(value_type.tensor_type.shape.dim)


def _is_integer(value_type: onnx.TypeProto | None) -> bool:
    return value_type is not None and value_type.tensor_type.elem_type in (
        onnx.TensorProto.INT32,
        onnx.TensorProto.INT64,
    )


def _types(proto: onnx.ModelProto, loop: onnx.NodeProto) -> dict:
    """Tensor name -> inferred type, in the main graph and `loop`'s body
    (ONNX's shape inference of `light_copy`)."""
    inferred = onnx.shape_inference.infer_shapes(light_copy(proto)).graph
    infos = [*inferred.value_info, *inferred.input, *inferred.output]
    for node in inferred.node:
        if node.op_type == "Loop" and list(node.output) == list(loop.output):
            body = next(a.g for a in node.attribute if a.name == "body")
            infos += [*body.value_info, *body.input, *body.output]
    return {info.name: info.type for info in infos}


def light_copy(proto: onnx.ModelProto) -> onnx.ModelProto:
    """`proto` for shape inference: its large initializers as typed inputs
    (the weights not copied: any size, external data alike)."""
    graph = proto.graph
    large = [i for i in graph.initializer if _elements(i) > _SMALL]
    light = onnx.helper.make_graph(
        graph.node,
        graph.name,
        [
            *graph.input,
            *(
                onnx.helper.make_tensor_value_info(i.name, i.data_type, i.dims)
                for i in large
            ),
        ],
        graph.output,
        [i for i in graph.initializer if _elements(i) <= _SMALL],
    )
    return onnx.helper.make_model(light, opset_imports=proto.opset_import)


# Initializers of at most this many elements keep their values for the
# inference (axes, shapes, scalars).
_SMALL = 1024


def _elements(initializer: onnx.TensorProto) -> int:
    count = 1
    for dim in initializer.dims:
        count *= dim
    return count


def _cast_of(name: str, outer: dict) -> str | None:
    """The bool tensor `name` is an outer-scope Cast of, or None."""
    node = outer.get(name)
    if node is None or node.op_type != "Cast":
        return None
    return node.input[0]


def _match(add, inner, outer):
    """(c, the Mul reading `sampled`, sampled, greedy) where `add` is
    Add(Mul(Cast(c), sampled), Mul(greedy, Cast(Not(c)))) with c a
    request-fixed scalar (outer scope), in either order; else None."""
    muls = [inner.get(name) for name in add.input]
    if len(muls) != 2 or any(m is None or m.op_type != "Mul" for m in muls):
        return None
    for chosen, other in (muls, muls[::-1]):
        for i in (0, 1):
            condition = _cast_of(chosen.input[i], outer)
            if condition is None:
                continue
            for j in (0, 1):
                negated = _cast_of(other.input[j], outer)
                producer = outer.get(negated) if negated else None
                if (
                    producer is not None
                    and producer.op_type == "Not"
                    and producer.input[0] == condition
                ):
                    return condition, chosen, chosen.input[1 - i], other.input[1 - j]
    return None


def _move_into_if(body, add, selected, select, elem_type) -> bool:
    """Moves the nodes only `sampled` needs into If(condition) (else:
    `greedy`), `select` = (condition, sampled, greedy); the If's output
    replaces the select's (`add`): the same integers either way."""
    condition, sampled, greedy = select
    consumers = graph_lib.consumers(body)
    outputs = {info.name for info in body.output}
    # Nodes by their first output (protobuf wrappers have no stable id).
    region = {selected.output[0]}
    needed = {sampled}
    # Reverse order: a node's consumers are decided before it.
    for node in reversed(body.node):
        users = [user for name in node.output for user in consumers.get(name, [])]
        if (
            needed.intersection(node.output)
            and users
            and all(user.output[0] in region for user in users)
            and not outputs.intersection(node.output)
        ):
            region.add(node.output[0])
            needed.update(name for name in node.input if name)
    region.discard(selected.output[0])
    moved = [node for node in body.node if node.output[0] in region]
    if not any(node.op_type == "TopK" for node in moved):
        return False
    chosen = f"{sampled}__branch"
    value = onnx.helper.make_tensor_value_info(sampled, elem_type, None)
    then_branch = onnx.helper.make_graph(
        [_copy(node) for node in moved], f"{chosen}_sampled", [], [value]
    )
    else_branch = onnx.helper.make_graph(
        [onnx.helper.make_node("Identity", [greedy], [f"{chosen}_greedy"])],
        f"{chosen}_greedy",
        [],
        [onnx.helper.make_tensor_value_info(f"{chosen}_greedy", elem_type, None)],
    )
    node = onnx.helper.make_node(
        "If",
        [condition],
        [chosen],
        then_branch=then_branch,
        else_branch=else_branch,
    )
    kept = [_copy(n) for n in body.node if n.output[0] not in region]
    for n in kept:
        if n.output[0] == add.output[0]:
            n.op_type = "Identity"
            del n.input[:]
            n.input.append(chosen)
    del body.node[:]
    body.node.extend([*kept, node])
    graph_lib.prune_dead(body)
    return True


def _copy(node: onnx.NodeProto) -> onnx.NodeProto:
    copy = onnx.NodeProto()
    copy.CopyFrom(node)
    return copy
