"""A generator's matmuls read their input itself, not its reshape to rows.

tf2onnx writes a Keras `Dense` of a `(B, T, K)` input as TensorFlow's
`Tensordot`: a `Reshape` to `(B * T, K)` rows, the matmul, and a `Reshape`
of the rows back. ONNX's `MatMul` and `MatMulNBits` take the `(B, T, K)`
tensor as it is (its leading axes are the rows), so the first reshape is
a kernel per layer and token that computes nothing.

`read_rows_in_place` has a matmul read the reshape's input where the
reshape only merges leading axes: its shape is the constant `(-1, K)`, the
input's last dim is known to be K (`_LastDims`), and every reader of the
matmul's output is a `Reshape` (which sees the same elements in the same
order whatever the leading axes). The values computed are unchanged.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

from keras_selfattn.export.formats.onnx import graph as graph_lib

# Ops whose output has their first input's last dim.
_SAME_LAST = frozenset(
    {
        "Cast",
        "Erf",
        "Identity",
        "Neg",
        "Relu",
        "Sigmoid",
        "Softmax",
        "Tanh",
    }
)
# Normalizations: their output has their input's shape, whose last dim is
# their scale's where that is more than 1.
_NORMS = frozenset({"LayerNormalization", "RMSNormalization"})
# Elementwise ops of two inputs, broadcast.
_BROADCAST = frozenset({"Add", "Div", "Mul", "Sub"})
_MATMULS = frozenset({"MatMul", "MatMulNBits"})
_SMALL = 16  # constants read for their values (a reshape's shape)


def read_rows_in_place(proto: onnx.ModelProto) -> int:
    """Rewrites the matmuls of `proto`'s main graph and `Loop` bodies that
    read a reshape to rows (module docstring); returns how many."""
    outer = _Constants(proto.graph)  # read once, for the bodies too
    return graph_lib.rewrite_with_bodies(
        proto,
        lambda graph, main: _rewrite(
            graph, outer if graph is main else outer.with_graph(graph)
        ),
    )


class _Constants:
    """The dims (every constant) and values (small ones held in the file) of
    the initializers and `Constant` outputs a graph can read."""

    def __init__(self, graph: onnx.GraphProto, outer: _Constants | None = None):
        self.dims: dict[str, tuple[int, ...]] = dict(outer.dims) if outer else {}
        self.values: dict[str, np.ndarray] = dict(outer.values) if outer else {}
        for tensor in graph.initializer:
            self.dims[tensor.name] = tuple(tensor.dims)
            small = int(np.prod(tensor.dims)) <= _SMALL
            if small and tensor.data_location != onnx.TensorProto.EXTERNAL:
                self.values[tensor.name] = numpy_helper.to_array(tensor)
        for node in graph.node:
            if node.op_type == "Constant" and node.attribute[0].name == "value":
                value = numpy_helper.to_array(node.attribute[0].t)
                self.dims[node.output[0]] = value.shape
                if value.size <= _SMALL:
                    self.values[node.output[0]] = value

    def with_graph(self, graph: onnx.GraphProto) -> _Constants:
        """These constants and `graph`'s own (a subgraph's view)."""
        return _Constants(graph, self)


def _rewrite(graph: onnx.GraphProto, constants: _Constants) -> int:
    producers = {out: node for node in graph.node for out in node.output}
    readers = graph_lib.consumers(graph)
    outputs = {info.name for info in graph.output}
    last_dims = _LastDims(producers, constants)
    changed: set[str] = set()
    for node in graph.node:
        if node.op_type not in _MATMULS:
            continue
        reshape = producers.get(node.input[0])
        if reshape is None or reshape.op_type != "Reshape":
            continue
        depth = _depth(node, constants)
        shape = constants.values.get(reshape.input[1])
        if depth is None or shape is None or list(shape) != [-1, depth]:
            continue
        if last_dims.of(reshape.input[0]) != depth or node.output[0] in outputs:
            continue
        later = readers.get(node.output[0], [])
        if not later or any(
            r.op_type != "Reshape" or list(r.input).index(node.output[0]) != 0
            for r in later
        ):
            continue
        node.input[0] = reshape.input[0]
        changed.add(node.output[0])
    # Their outputs' recorded shapes were the rows'.
    kept = [info for info in graph.value_info if info.name not in changed]
    del graph.value_info[:]
    graph.value_info.extend(kept)
    return len(changed)


def _depth(node: onnx.NodeProto, constants: _Constants) -> int | None:
    """K, the matmul's input depth, or None where it is not known."""
    if node.op_type == "MatMulNBits":
        return next((a.i for a in node.attribute if a.name == "K"), None)
    dims = constants.dims.get(node.input[1])
    return dims[0] if dims is not None and len(dims) == 2 else None


class _LastDims:
    """Tensors' last dims where a graph's ops and constants give them."""

    def __init__(self, producers: dict, constants: _Constants):
        self._producers = producers
        self._constants = constants
        self._found: dict[str, int | None] = {}

    def of(self, name: str) -> int | None:
        """`name`'s last dim (1 for a scalar), or None where unknown."""
        if name not in self._found:
            self._found[name] = None  # a cycle (none in a graph) stays unknown
            self._found[name] = self._find(name)
        return self._found[name]

    def _find(self, name: str) -> int | None:
        dims = self._constants.dims.get(name)
        if dims is not None:
            return dims[-1] if dims else 1
        node = self._producers.get(name)
        if node is None or name != node.output[0]:
            return None
        if node.op_type in _NORMS:
            # The scale broadcasts to the normalized axes, which end with
            # the last: a last dim over 1 is the input's.
            scale = self.of(node.input[1])
            return scale if scale is not None and scale > 1 else self.of(node.input[0])
        if node.op_type in _SAME_LAST:
            return self.of(node.input[0])
        if node.op_type in _BROADCAST:
            return _broadcast(self.of(node.input[0]), self.of(node.input[1]))
        if node.op_type == "MatMulNBits":
            return next((a.i for a in node.attribute if a.name == "N"), None)
        if node.op_type == "MatMul":
            weight = self._constants.dims.get(node.input[1])
            return weight[-1] if weight and len(weight) >= 2 else None
        if node.op_type == "Reshape":
            shape = self._constants.values.get(node.input[1])
            last = int(shape[-1]) if shape is not None and shape.size else 0
            return last if last > 0 else None
        if node.op_type == "Gather":
            data = self._dims(node.input[0])
            axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
            if data is not None and len(data) >= 2 and axis in (0, -len(data)):
                return data[-1]
        return None

    def _dims(self, name: str) -> tuple[int, ...] | None:
        """All of a constant's dims, or of a transpose of one (a tied
        embedding's table)."""
        dims = self._constants.dims.get(name)
        node = self._producers.get(name)
        if dims is None and node is not None and node.op_type == "Transpose":
            source = self._constants.dims.get(node.input[0])
            if source is not None:
                perm = next(
                    (list(a.ints) for a in node.attribute if a.name == "perm"),
                    list(reversed(range(len(source)))),
                )
                dims = tuple(source[axis] for axis in perm)
        return dims


def _broadcast(first: int | None, second: int | None) -> int | None:
    """The last dim of two broadcast inputs' result, or None."""
    if first is None or second is None:
        return None
    if first == second or second == 1:
        return first
    return second if first == 1 else None
