"""A `Loop` body's tensor shapes in terms of the graph inputs' named axes.

onnx's shape inference (C++, with data propagation through the shape
arithmetic) is run on the model with every named axis of its inputs
("batch", "time") given a size, three times, each time other sizes. Its
`Loop` inference forgets the sizes of loop-carried values, so each body
is inferred on its own: a graph whose inputs are the body's, typed as the
values the loop starts from, plus the outer values the body reads (small
integer initializers with their values: axes, shapes).

A dimension is a size where every probe gives that size, and a named axis
where every probe gives that axis's size; anything else is unknown. The
probes' sizes (2, 3, 5, 7, ...) are distinct within a probe and in each
axis's sequence, and none is 1, where broadcasting hides sizes from the
inference. A fourth probe, every axis of size 1, only refutes: a dim it
knows must be the size found, or 1 for an axis (a batch clamped to 2 is
not taken for a fixed 2). A size clamped between the probes' sizes would
still pass for fixed or for the axis; the export's check runs other
sizes (8 prompts).
A body whose loop-carried values would change shape between iterations
(a probe infers another shape out than in) gives nothing.

Where a `Slice`'s bounds are the step's (the cache read up to the step),
onnx's inference forgets every dim of its output; `_slice_dims` gives
back those of the axes it does not slice, and the inference runs again.

ONNX Runtime's symbolic shape inference (sympy) finds the same shapes in
the generators of keras-hub's Llama, but its time grows with the square
of a generator's size: minutes at 28 layers, where these probes take about
a second.
"""

from __future__ import annotations

import onnx

from keras_selfattn.export.formats.onnx import graph as graph_lib
from keras_selfattn.export.formats.onnx import loop_select

# Named axis k of probe p has size _SIZES[p + k].
_SIZES = (2, 3, 5, 7, 11, 13, 17, 19, 23)
_PROBES = 3
# Inferences of a body at most, each after `_slice_dims` told it more.
_ROUNDS = 4
_SYMBOL = "__probe_slice_"


def body_shapes(
    proto: onnx.ModelProto, loop: onnx.NodeProto
) -> dict[str, list[int | str]]:
    """Tensor name -> dims (sizes, named axes) of the tensors of `loop`'s
    body (a `Loop` of `proto`'s main graph) whose every dim is known
    (module docstring); empty where the inference fails."""
    axes = sorted(named_axes(proto.graph))
    if len(axes) + _PROBES > len(_SIZES) + 1:
        return {}
    light = loop_select.light_copy(proto)
    index = next(
        i
        for i, node in enumerate(proto.graph.node)
        if node.op_type == "Loop" and node.output == loop.output
    )
    probes = []
    for probe in range(_PROBES):
        sizes = {axis: _SIZES[probe + k] for k, axis in enumerate(axes)}
        shapes = _probe(light, index, sizes)
        if shapes is None:
            return {}
        probes.append((sizes, shapes))
    # Every axis of size 1: where it knows a dim, it must agree.
    ones = _probe(light, index, dict.fromkeys(axes, 1), refute_only=True) or {}
    found = {}
    for name, dims in probes[0][1].items():
        seen = [shapes.get(name) for _, shapes in probes]
        if any(s is None or len(s) != len(dims) for s in seen):
            continue
        symbolic = [_dim(column, axes, probes) for column in zip(*seen, strict=True)]
        if None not in symbolic and _agrees(symbolic, ones.get(name), axes):
            found[name] = symbolic
    return found


def _agrees(symbolic, sizes, axes) -> bool:
    """Whether the dims found agree with the sizes (None: unknown) the
    probe of size-1 axes saw, where it saw the tensor."""
    if sizes is None:
        return True
    if len(sizes) != len(symbolic):
        return False
    return all(
        size is None or size == (1 if dim in axes else dim)
        for dim, size in zip(symbolic, sizes, strict=True)
    )


def _dim(sizes, axes, probes) -> int | str | None:
    """One dim's sizes across the probes as a size, an axis, or None."""
    if len(set(sizes)) == 1:
        return sizes[0]
    for axis in axes:
        if list(sizes) == [given[axis] for given, _ in probes]:
            return axis
    return None


def named_axes(graph: onnx.GraphProto) -> dict[str, tuple[str, int]]:
    """A graph input's named axis -> (that input, the axis)."""
    axes: dict[str, tuple[str, int]] = {}
    for info in graph.input:
        for axis, dim in enumerate(info.type.tensor_type.shape.dim):
            if dim.dim_param and dim.dim_param not in axes:
                axes[dim.dim_param] = (info.name, axis)
    return axes


def _probe(
    light: onnx.ModelProto, index: int, sizes: dict[str, int], refute_only=False
):
    """The body tensors' sizes (None: unknown) with the named axes given
    `sizes`; None where the inference fails or, unless `refute_only`, a
    loop-carried value's shape would change or is unknown on the way out."""
    model = onnx.ModelProto()
    model.CopyFrom(light)
    for info in model.graph.input:
        for dim in info.type.tensor_type.shape.dim:
            if dim.dim_param in sizes:
                dim.dim_value = sizes[dim.dim_param]
    try:
        outer = onnx.shape_inference.infer_shapes(model, data_prop=True)
        loop = outer.graph.node[index]
        model = _body_model(outer, loop)
        for _ in range(_ROUNDS):
            model = onnx.shape_inference.infer_shapes(model, data_prop=True)
            if not _slice_dims(model.graph):
                break
        body = model.graph
    except Exception:  # noqa: BLE001 - an optimization: skipped where it fails
        return None
    shapes = {}
    for info in [*body.input, *body.value_info, *body.output]:
        tensor = info.type.tensor_type
        if tensor.HasField("shape"):
            shapes[info.name] = [
                dim.dim_value if dim.HasField("dim_value") else None
                for dim in tensor.shape.dim
            ]
    if refute_only:
        return shapes
    states = len(loop.input) - 2
    carried = zip(body.input[2 : 2 + states], body.output[1 : 1 + states], strict=True)
    for before, after in carried:
        if shapes.get(before.name) != shapes.get(after.name):
            return None
    return shapes


def _body_model(outer: onnx.ModelProto, loop: onnx.NodeProto) -> onnx.ModelProto:
    """`loop`'s body as a model of its own: the body's inputs typed as the
    loop's, the outer values it reads as typed inputs (small integer
    initializers with their values)."""
    types = {
        info.name: info.type
        for info in [*outer.graph.input, *outer.graph.value_info, *outer.graph.output]
    }
    initializers = {i.name: i for i in outer.graph.initializer}
    body = onnx.GraphProto()
    body.CopyFrom(next(a.g for a in loop.attribute if a.name == "body"))
    del body.value_info[:]
    for info in body.output:  # tf2onnx's shapes: the inference's own instead
        info.type.tensor_type.ClearField("shape")
    for position, info in enumerate(body.input):
        source = loop.input[position] if position >= 2 else ""
        if source in types:
            info.type.CopyFrom(types[source])
        elif source in initializers:
            info.type.CopyFrom(_initializer_type(initializers[source]))
    inner = {info.name for info in body.input} | {i.name for i in body.initializer}
    inner |= {name for node in body.node for name in node.output}
    reads = set().union(*(graph_lib.node_inputs(node) for node in body.node))
    for name in sorted(reads - inner):
        if name in initializers:
            body.initializer.append(initializers[name])  # light_copy: small
        elif name in types:
            body.input.append(onnx.helper.make_value_info(name, types[name]))
    return onnx.helper.make_model(body, opset_imports=outer.opset_import)


def _slice_dims(graph: onnx.GraphProto) -> bool:
    """Gives `Slice` outputs the dims onnx's inference leaves unknown when
    the bounds are the step's (the cache read up to the step): each axis
    not sliced keeps its input's dim, a sliced one gets a symbol of its
    own. Returns whether it told the inference anything new."""
    infos = {
        info.name: info for info in [*graph.input, *graph.value_info, *graph.output]
    }
    constants = {i.name: i for i in graph.initializer}
    changed = False
    for position, node in enumerate(graph.node):
        if node.op_type != "Slice" or len(node.input) < 4:
            continue
        source, output = infos.get(node.input[0]), infos.get(node.output[0])
        axes = constants.get(node.input[3])
        if source is None or output is None or axes is None:
            continue
        dims = source.type.tensor_type.shape.dim
        out = output.type.tensor_type.shape.dim
        if len(out) != len(dims) or not dims:
            continue
        sliced = {int(a) % len(dims) for a in onnx.numpy_helper.to_array(axes)}
        for axis, (dim, target) in enumerate(zip(dims, out, strict=True)):
            if target.HasField("dim_value") or _known_symbol(target):
                continue
            if axis in sliced:
                target.dim_param = f"{_SYMBOL}{position}_{axis}"
            elif dim.HasField("dim_value"):
                target.dim_value = dim.dim_value
            elif _known_symbol(dim):
                target.dim_param = dim.dim_param
            else:
                continue
            changed = True
    return changed


def _known_symbol(dim) -> bool:
    """Whether `dim` is one of `_slice_dims`'s symbols (onnx's inference
    names its unknown dims "unk__N")."""
    return dim.dim_param.startswith(_SYMBOL)


def _initializer_type(initializer: onnx.TensorProto) -> onnx.TypeProto:
    return onnx.helper.make_tensor_type_proto(
        initializer.data_type, list(initializer.dims)
    )
