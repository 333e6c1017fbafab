"""One `MatMulNBits` for the weight-only layers that read the same input.

A Llama layer's query, key and value projections read one normalized
input, and so do its feed-forward's gate and up projections. Written as
one `MatMulNBits` each (`integer`), each quantizes that input again (at
`accuracy_level` 4) and waits on the thread pool once more, every token.
onnxruntime-genai's builder packs query, key and value; `pack` packs
every such set in a generator's graphs: the layers' codes, scales and zero
points (each laid out by output row) are stacked into one layer's, and a
`Split` along the last axis gives each layer's output back. Every output
column is computed from its own rows as before, so the values are the
same (`tests/test_onnx_packed_matmuls.py` checks them bit for bit); the
integers are stored once, in the main graph, for the prompt pass and the
loop body alike (packed where both read them).

Layers are packed only where they agree on everything but their output
size: the input, K, bits, block size, accuracy level and inputs (codes,
scales, zero points; no `g_idx` or bias), held in the file (not external
data, whose stacking would be a second copy of large weights in memory).
"""

from __future__ import annotations

import collections

import numpy as np
import onnx
from onnx import helper, numpy_helper

from keras_selfattn.export.formats.onnx import graph as graph_lib

_OP, _DOMAIN = "MatMulNBits", "com.microsoft"
_SAME = ("K", "bits", "block_size", "accuracy_level")


def pack(proto: onnx.ModelProto) -> int:
    """Packs the `MatMulNBits` nodes of `proto`'s main graph and `Loop`
    bodies that read one input (module docstring); returns how many nodes
    now do the work of more."""
    stored = {tensor.name: tensor for tensor in proto.graph.initializer}
    packed: dict[tuple[str, ...], list[str]] = {}
    return graph_lib.rewrite_with_bodies(
        proto, lambda graph, main: _pack_graph(graph, main, stored, packed)
    )


def _attributes(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _key(node: onnx.NodeProto, stored: dict) -> tuple | None:
    """What packed layers must share, or None where the node is not packed."""
    if node.op_type != _OP or node.domain != _DOMAIN or len(node.input) not in (3, 4):
        return None
    if any(
        name not in stored or stored[name].data_location == onnx.TensorProto.EXTERNAL
        for name in node.input[1:]
    ):
        return None
    # Zero points packed per row (N, bytes): a flat (N * blocks / 2,) 4-bit
    # tensor may share a byte between two rows.
    if len(node.input) == 4 and len(stored[node.input[3]].dims) != 2:
        return None
    attributes = _attributes(node)
    if set(attributes) - {*_SAME, "N"}:
        return None
    return (node.input[0], len(node.input), *(attributes.get(a) for a in _SAME))


def _pack_graph(graph: onnx.GraphProto, main: onnx.GraphProto, stored, packed) -> int:
    """Packs `graph`'s groups; their integers go into `main` once."""
    groups = collections.defaultdict(list)
    for node in graph.node:
        key = _key(node, stored)
        if key is not None:
            groups[key].append(node)
    packs = [members for members in groups.values() if len(members) > 1]
    added = []
    for members in packs:
        names = tuple(name for node in members for name in node.input[1:])
        if names not in packed:
            packed[names] = _stacked(members, main, stored)
        added += _packed_nodes(members, packed[names])
    # At once: removing rebuilds the node list, whose old nodes then are
    # copies no longer in the graph.
    graph_lib.remove_nodes(graph, [node for members in packs for node in members])
    graph.node.extend(added)
    count = len(packs)
    if count:
        graph_lib.topological_sort(graph)
    return count


def _stacked(members: list, main: onnx.GraphProto, stored: dict) -> list[str]:
    """The members' codes, scales and zero points stacked by output row, as
    new initializers of `main`; their names."""
    names = []
    for position in range(1, len(members[0].input)):
        parts = [
            numpy_helper.to_array(stored[node.input[position]]) for node in members
        ]
        name = f"{members[0].input[position]}/packed"
        # Codes (N, blocks, bytes), scales (N * blocks,) or (N, blocks) and
        # zero points (N, bytes), each row-major by N: the first axis stacks
        # (flat scales hold whole rows in order too).
        main.initializer.append(numpy_helper.from_array(np.concatenate(parts), name))
        stored[name] = main.initializer[-1]
        names.append(name)
    return names


def _packed_nodes(members: list, stacked: list[str]) -> list[onnx.NodeProto]:
    """One `MatMulNBits` of the stacked integers and a `Split` writing each
    member's output."""
    first = members[0]
    sizes = [_attributes(node)["N"] for node in members]
    output = f"{first.output[0]}/packed"
    split = f"{output}_sizes"
    return [
        helper.make_node(
            _OP,
            [first.input[0], *stacked],
            [output],
            output,
            domain=_DOMAIN,
            **{**_attributes(first), "N": sum(sizes)},
        ),
        helper.make_node(
            "Constant",
            [],
            [split],
            split,
            value=numpy_helper.from_array(np.asarray(sizes, np.int64)),
        ),
        helper.make_node(
            "Split",
            [output, split],
            [node.output[0] for node in members],
            f"{output}/split",
            axis=-1,
        ),
    ]
