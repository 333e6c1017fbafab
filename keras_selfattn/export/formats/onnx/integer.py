"""Quantized layers of an ONNX graph, stored as Keras's integers and run on
ONNX Runtime's integer kernels.

The graph was traced with `quantization.CAPTURED`: each quantized `Dense`
is a `MatMul` by its dequantized kernel, a constant, which `rewrite` finds
by value, or, an int8 `Dense` on TensorFlow (`quantization.in_graph`), by
Keras's dequantization of its stored integers, `Div(Cast(integers),
scale)`, which `rewrite` finds by the integers' value. Each is replaced:

- int8 with Keras's activation quantizer (symmetric, per token): Keras's
  exact scheme on ONNX Runtime's integer matmul, exact on every CPU by
  default (`int8_layers`).
- weight-only modes (int4 per channel or per group, int8 without
  activation quantization, gptq, awq): `MatMulNBits` (4 or 8 bits, blocks
  along the input axis, codes - zero point times scale) with float
  activations (`accuracy_level` 0), as Keras computes them; 4-bit layers
  asked to (`rewrite`'s `round_inputs`) on inputs rounded to int8 in the
  weights' blocks instead (`accuracy_level` 4, onnxruntime-genai's int4
  default: not Keras's computation). AWQ's per-input divisor divides the
  input first. Groups that do not fit (a
  size that is not a power of two of at least 16, or `g_idx` out of
  order) keep the float kernel, and say so.
- float8: kept as float32 (the float8-rounded kernel; ONNX Runtime has no
  CPU float8 matmul).

The model's metadata (`METADATA_KEY`) names the scheme of every layer,
whether the file computes Keras's own scheme (`exact`) and whether it
rounds float inputs Keras does not (`rounds_inputs`), which `verify`
reads.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

from keras_selfattn.export.formats.onnx import graph as og
from keras_selfattn.export.formats.onnx import int8_layers
from keras_selfattn.export.integer_layers import nbits_fits
from keras_selfattn.export.quantization import CAPTURED, in_graph
from keras_selfattn.export.quantized_kernels import QuantizedDense, value_key

METADATA_KEY = "keras_selfattn.quantization"
CONTRIB_DOMAIN = "com.microsoft"
_CONTRIB_OPS = ("MatMulNBits", "MatMulIntegerToFloat")
EXACT_INT8 = (
    "int8 activations per token, symmetric (Keras's scheme): MatMulIntegerToFloat"
)
# The kernel of int8 layers with quantized activations (`int8_layers`).
INT8_KERNEL = (
    " uint8 x int8 where a probe of the machine's kernel finds it exact "
    "(VNNI, AMX), uint8 x uint8 elsewhere (exact on every CPU)"
)
WEIGHT_ONLY = "float activations, {bits}-bit weights in blocks of {block}: MatMulNBits"
ROUNDED_INPUTS = (
    "int8 activations in blocks of {block} (onnxruntime-genai's int4 default, "
    "not Keras's float ones), 4-bit weights: MatMulNBits accuracy level 4"
)
# MatMulNBits' `accuracy_level`: float inputs; inputs rounded to int8.
FLOAT_INPUTS_LEVEL, INT8_INPUTS_LEVEL = 0, 4
FLOAT8 = "float32 (float8-rounded kernel; activations not rounded to float8)"
NOT_FOUND = "float32: its kernel is not a MatMul weight in the converted graph"
NO_FIT = "float32: groups of {size} do not fit MatMulNBits (powers of two >= 16)"


@dataclasses.dataclass(frozen=True)
class LayerScheme:
    """How one quantized layer is computed in the file.

    Attributes:
        layer: The layer's name.
        scheme: What ONNX Runtime computes for it.
        exact: Whether that is Keras's own computation of the layer.
        rounds_inputs: Whether it rounds float inputs to integers where
            Keras does not (`ROUNDED_INPUTS`).
    """

    layer: str
    scheme: str
    exact: bool
    rounds_inputs: bool = False


class _Builder:
    """Adds uniquely named nodes and initializers to a graph."""

    def __init__(self, graph: onnx.GraphProto, opset: int, round_inputs: bool):
        self.graph = graph
        self.opset = opset
        self.round_inputs = round_inputs  # `rewrite`'s
        self.nodes: list[onnx.NodeProto] = []
        taken = {i.name for i in graph.initializer}
        taken |= {out for node in graph.node for out in node.output}
        self._taken = taken

    def take(self, graph: onnx.GraphProto) -> None:
        """Reserves the names `graph` (a subgraph) defines."""
        self._taken |= {i.name for i in graph.initializer}
        self._taken |= {i.name for i in graph.input}
        self._taken |= {out for node in graph.node for out in node.output}

    def name(self, hint: str) -> str:
        candidate, index = hint, 0
        while candidate in self._taken:
            index += 1
            candidate = f"{hint}_{index}"
        self._taken.add(candidate)
        return candidate

    def constant(self, hint: str, value: np.ndarray) -> str:
        name = self.name(hint)
        self.graph.initializer.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def make(
        self, op: str, inputs: Sequence[str], hint: str, **attrs
    ) -> onnx.NodeProto:
        """A uniquely named node with one output (named like the node), not
        added to the graph (for subgraphs)."""
        output = self.name(hint)
        domain = CONTRIB_DOMAIN if op in _CONTRIB_OPS else ""
        return helper.make_node(
            op, list(inputs), [output], name=output, domain=domain, **attrs
        )

    def node(self, op: str, inputs: Sequence[str], hint: str, **attrs) -> str:
        """Adds a `make` node to the graph; returns its output's name."""
        self.nodes.append(self.make(op, inputs, hint, **attrs))
        return self.nodes[-1].output[0]

    def reduce(self, op: str, x: str, hint: str) -> str:
        """`op` ("ReduceMax", "ReduceMin") over the last axis, kept."""
        if self.opset >= 18:
            axes = self.constant(f"{hint}_axes", np.array([-1], np.int64))
            return self.node(op, [x, axes], hint, keepdims=1)
        return self.node(op, [x], hint, axes=[-1], keepdims=1)


def _blocks(
    quantized: QuantizedDense,
) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
    """(block size, codes (in, out) uint8, per-block scale and zero (blocks, out))
    for MatMulNBits; raises ValueError when the groups do not fit."""
    inputs = quantized.shape[0]
    if quantized.zero is None:  # per channel: symmetric, one block repeated
        block = 1 << max(4, (min(inputs, 256) - 1).bit_length())
        blocks = -(-inputs // block)
        shift = 1 << (quantized.bits - 1)
        codes = (quantized.integers.astype(np.int16) + shift).astype(np.uint8)
        scale = np.repeat((1.0 / quantized.scale)[None, :], blocks, axis=0)
        zero = np.full_like(scale, shift)
        return block, codes, scale.astype(np.float32), zero
    size = quantized.group_size
    if not nbits_fits(quantized):
        raise ValueError(NO_FIT.format(size=size or "unordered g_idx"))
    return size, quantized.integers, quantized.scale, quantized.zero


def _pack(codes_in_out: np.ndarray, bits: int, block: int) -> np.ndarray:
    """B of MatMulNBits: (out, blocks, block * bits / 8), low bits first."""
    inputs, outputs = codes_in_out.shape
    blocks = -(-inputs // block)
    padded = np.zeros((blocks * block, outputs), np.uint8)
    padded[:inputs] = codes_in_out
    codes = padded.T.reshape(outputs, blocks, block)
    if bits == 8:
        return codes
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def _pack_zero(zero: np.ndarray, bits: int) -> np.ndarray:
    """Zero points of MatMulNBits: (out, ceil(blocks * bits / 8)) uint8."""
    zero = np.rint(zero.T).astype(np.uint8)  # (out, blocks)
    if bits == 8:
        return zero
    if zero.shape[1] % 2:
        zero = np.concatenate([zero, np.zeros((zero.shape[0], 1), np.uint8)], 1)
    return (zero[:, 0::2] | (zero[:, 1::2] << 4)).astype(np.uint8)


def _weight_only(
    builder, x, output, quantized: QuantizedDense, stored
) -> tuple[str, bool]:
    """A `MatMulNBits` of `x`; its codes, scales and zeros stored once per
    layer (`stored`: a layer read in the prompt pass and in a loop body).
    Returns its scheme and whether it rounds its inputs (4 bits and
    `builder.round_inputs`)."""
    block, codes, scale, zero = _blocks(quantized)
    inputs, outputs = quantized.shape
    name = quantized.layer.name
    if quantized.input_divisor is not None:
        divisor = builder.constant(f"{name}_awq_divisor", quantized.input_divisor)
        x = builder.node("Div", [x, divisor], f"{name}_awq_input")
    bits = quantized.bits
    rounds = builder.round_inputs and bits == 4
    if id(quantized) not in stored:
        stored[id(quantized)] = [
            builder.constant(f"{name}_codes", _pack(codes, bits, block)),
            builder.constant(f"{name}_scales", np.ascontiguousarray(scale.T)),
            builder.constant(f"{name}_zeros", _pack_zero(zero, bits)),
        ]
    builder.nodes.append(
        helper.make_node(
            "MatMulNBits",
            [x, *stored[id(quantized)]],
            [output],
            name=output,
            domain=CONTRIB_DOMAIN,
            K=inputs,
            N=outputs,
            bits=bits,
            block_size=block,
            accuracy_level=INT8_INPUTS_LEVEL if rounds else FLOAT_INPUTS_LEVEL,
        )
    )
    if rounds:
        return ROUNDED_INPUTS.format(block=block), True
    return WEIGHT_ONLY.format(bits=bits, block=block), False


def _kernels_by_value(
    quantized: Sequence[QuantizedDense],
) -> dict[tuple, QuantizedDense]:
    """Layers traced with their dequantized kernel, by its value; those
    traced as Keras's dequantization of their int8 variable
    (`quantization.in_graph`), by their integers (`_stored_integers`
    confirms the scales)."""
    return {
        value_key(q.integers if in_graph(q, CAPTURED) else q.kernel): q
        for q in quantized
    }


def rewrite(
    proto: onnx.ModelProto,
    quantized: Sequence[QuantizedDense],
    round_inputs: bool = False,
) -> tuple[onnx.ModelProto, tuple[LayerScheme, ...]]:
    """Stores each quantized layer's kernel as Keras's integers (module doc).

    The layers' matmuls are found in the main graph and in its subgraphs (a
    generator's `Loop` body), their integers stored once, in the main graph.

    Args:
        proto: The converted model, traced with `quantization.CAPTURED`.
        quantized: The model's quantized `Dense` layers.
        round_inputs: Whether 4-bit weight-only layers round their inputs
            to int8 in blocks (`ROUNDED_INPUTS`: faster on CPUs with int8
            dot products, not Keras's computation) instead of multiplying
            Keras's float inputs.

    Returns:
        The model (changed in place) and each layer's `LayerScheme`, also
        written to the model's metadata under `METADATA_KEY`.
    """
    graph = proto.graph
    opset = next(
        (o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 17
    )
    builder = _Builder(graph, opset, round_inputs)
    schemes: dict[str, LayerScheme] = {}
    _rewrite_graph(builder, [graph], _kernels_by_value(quantized), schemes, {})
    for q in quantized:
        if q.mode == "float8":
            schemes.setdefault(q.layer.name, LayerScheme(q.layer.name, FLOAT8, False))
        schemes.setdefault(q.layer.name, LayerScheme(q.layer.name, NOT_FOUND, False))
    og.prune_dead(graph)
    og.topological_sort(graph)
    # An int8 layer's MatMulIntegerToFloat may sit in an `If` branch.
    contrib = og.has_op(graph, "MatMulNBits") or any(
        s.scheme.startswith(EXACT_INT8) for s in schemes.values()
    )
    if contrib and not any(o.domain == CONTRIB_DOMAIN for o in proto.opset_import):
        proto.opset_import.append(helper.make_opsetid(CONTRIB_DOMAIN, 1))
    results = tuple(schemes[q.layer.name] for q in quantized)
    describe(proto, results)
    return proto, results


def _constant(scopes: Sequence[onnx.GraphProto], name: str):
    """The value of `name` (through `Identity` nodes) in the innermost scope
    that holds it, or None."""
    for graph in reversed(scopes):
        value = og.constant_value(graph, name)
        if value is not None:
            return value
        for node in graph.node:
            if node.op_type == "Identity" and name in node.output:
                return _constant(scopes, node.input[0])
    return None


def _producer(scopes: Sequence[onnx.GraphProto], name: str):
    """The node writing `name` (through `Identity` nodes) in the innermost
    scope that has one, or None."""
    for graph in reversed(scopes):
        for node in graph.node:
            if name in node.output:
                if node.op_type == "Identity":
                    return _producer(scopes, node.input[0])
                return node
    return None


def _stored_integers(scopes, name: str, by_value: dict):
    """The int8 layer whose kernel `name` is Keras's dequantization of its
    variable (`quantization.in_graph`): `Div(Cast(integers), scale)`, or
    `Mul(Cast(integers), 1 / scale)` where TensorFlow held the scales as a
    constant (under 128 of them) and grappler folded the division (its
    reciprocals measured an ulp off numpy's); None otherwise. The layer is
    the one whose integers these are; the scales only confirm it."""
    scaling = _producer(scopes, name)
    if scaling is None or scaling.op_type not in ("Div", "Mul"):
        return None
    casts = [_producer(scopes, operand) for operand in scaling.input]
    side = next(
        (i for i, cast in enumerate(casts) if cast and cast.op_type == "Cast"), None
    )
    if side is None or (scaling.op_type == "Div" and side != 0):
        return None
    integers = _constant(scopes, casts[side].input[0])
    factor = _constant(scopes, scaling.input[1 - side])
    if integers is None or integers.dtype != np.int8 or factor is None:
        return None
    match = by_value.get(value_key(integers))
    if match is None or np.size(factor) != match.scale.size:
        return None
    if scaling.op_type == "Div":
        return match if np.array_equal(np.ravel(factor), match.scale) else None
    # Grappler's reciprocal, within a few float32 ulps of numpy's.
    reciprocal = np.float32(1) / match.scale
    close = np.allclose(np.ravel(factor), reciprocal, rtol=1e-6, atol=0)
    return match if close else None


def _same_rows(scopes, producers, x: str, seen: dict) -> str:
    """`x`, or the equal tensor an earlier int8 layer read: tf2onnx writes a
    `Reshape` to rows in front of each layer's matmul (a `Loop` body's
    query, key and value each reshape the same input by equal constant
    shapes), so layers reading one input share its quantization."""
    node = producers.get(x)
    if node is None or node.op_type != "Reshape":
        return x
    shape = _constant(scopes, node.input[1])
    if shape is None:
        return x
    return seen.setdefault((node.input[0], np.asarray(shape).tobytes()), x)


def _rewrite_graph(builder, scopes, by_value, schemes, stored) -> None:
    """`rewrite`'s pass over the innermost of `scopes` and its subgraphs: its
    new nodes go into it (each graph with its own int8 input quantization
    and probe), its constants into the main graph (`builder.graph`)."""
    graph = scopes[-1]
    outer_nodes, builder.nodes = builder.nodes, []
    builder.take(graph)
    cache: dict = {}  # each input's codes, shared by its readers; the probe
    producers = {out: node for node in graph.node for out in node.output}
    reshaped: dict = {}  # `_same_rows`
    kept = []
    for node in graph.node:
        for attribute in node.attribute:
            for inner in [
                *attribute.graphs,
                *([attribute.g] * attribute.HasField("g")),
            ]:
                _rewrite_graph(builder, [*scopes, inner], by_value, schemes, stored)
        weight = _constant(scopes, node.input[1]) if node.op_type == "MatMul" else None
        match = None
        if weight is not None and weight.dtype == np.float32 and weight.ndim == 2:
            match = by_value.get(value_key(weight))
        elif node.op_type == "MatMul":
            match = _stored_integers(scopes, node.input[1], by_value)
        if match is None or match.mode == "float8":
            kept.append(node)
            continue
        name = match.layer.name
        x, output = node.input[0], node.output[0]
        if match.mode == "int8" and match.activations is not None:
            x = _same_rows(scopes, producers, x, reshaped)
            # In a subgraph (a generator's loop body) rows are few.
            int8_layers.exact_int8(
                builder, x, output, match, cache, stored, few_rows=len(scopes) > 1
            )
            schemes[name] = LayerScheme(name, EXACT_INT8 + INT8_KERNEL, True)
            continue
        try:
            scheme, rounds = _weight_only(builder, x, output, match, stored)
        except ValueError as reason:
            kept.append(node)
            schemes[name] = LayerScheme(name, str(reason), False)
            continue
        schemes.setdefault(name, LayerScheme(name, scheme, not rounds, rounds))
    del graph.node[:]
    graph.node.extend(kept + builder.nodes)
    builder.nodes = outer_nodes
    if len(scopes) > 1:
        og.prune_dead(graph)
        og.topological_sort(graph)


def describe(proto: onnx.ModelProto, schemes: Sequence[LayerScheme]) -> None:
    """Writes the layers' schemes into the model's metadata (`METADATA_KEY`)."""
    text = json.dumps(
        {
            "exact": all(s.exact for s in schemes),
            "rounds_inputs": any(s.rounds_inputs for s in schemes),
            "layers": {s.layer: s.scheme for s in schemes},
        }
    )
    for entry in proto.metadata_props:
        if entry.key == METADATA_KEY:
            entry.value = text
            return
    proto.metadata_props.append(
        onnx.StringStringEntryProto(key=METADATA_KEY, value=text)
    )
