"""Recognises one decoding step's attention core in a `Loop` body (`analyse`).

The single-query path (`attention.single_query`) computes one new
position's attention under the name scope `tracing.FUSABLE_STEP_SCOPE`:
a (B, 1, H, K) query, the keys and values as read from the cache
(time-major (Tk, B, H_kv, D), or (B, Tk, H_kv, D)) and a bool key mask
(Tk, B or 1, 1, 1) (resp. (B or 1, Tk, 1, 1)) or none in, (B, 1, H, V) out,
the query heads of a group sharing their key/value head as `heads.repeat`
lays them out. tf2onnx writes it as per-group products reduced over the
depth, a select (or its arithmetic form), a softmax of reductions over
time and a weighted sum over time: some thirty nodes a layer.

`analyse` accepts a group only where

1. its nodes are pure tensor ops (`_OPS`: no control flow, no random op),
   one tensor leaves it, read only by Reshapes (so the replacement may
   write it as Attention's (B, H, 1, V), the same elements in the same
   order), and every other tensor entering it is a constant;
2. exactly three float32 tensors and at most one bool tensor enter it: the
   value is the float one the softmax's `Exp` does not depend on, the mask
   the bool one;
3. run alone in ONNX Runtime on random inputs of the layer's head counts
   and sizes, it computes the layer's attention (numpy, `_reference`:
   scores times the layer's scale, its soft-cap, the mask, a softmax, the
   weighted values) for one of the two query/key assignments and one of
   the two layouts, within float32 rounding; so does its replacement.

Anything else (sinks, a position bias, a half-precision compute dtype, an
unknown layer) raises `fused_core.NotFusable` with the reason.
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from keras_selfattn.export.formats.onnx.fused_core import NotFusable

# The ops tf2onnx writes for the step's core; anything else (a random op, a
# control-flow op) is not the computation Attention performs.
_OPS = frozenset(
    {
        "Add", "Cast", "Concat", "Div", "Exp", "Gather", "MatMul", "Max",
        "Mul", "Not", "ReduceMax", "ReduceSum", "Reshape", "Shape", "Slice",
        "Split", "Squeeze", "Sub", "Tanh", "Transpose", "Unsqueeze", "Where",
        "Constant", "ConstantOfShape", "Expand", "Identity",
    }
)  # fmt: skip
# The probe's batch and key lengths: distinct, so a wrong layout (batch and
# time swapped) fails.
_PROBE_BATCH, _PROBE_KEYS = 3, 7


@dataclasses.dataclass(frozen=True)
class StepCore:
    """One recognised step core, ready to replace.

    Attributes:
        nodes: The nodes the Attention node replaces.
        query: The float32 query, (B, 1, H, K)'s elements in their order
            (a layer may pass it as (B, H, K): the replacement reshapes it).
        key, value: The cache's keys and values as read.
        mask: None, or the bool key mask.
        output: The tensor leaving the group, (B, 1, H, V)'s elements in
            their order (the replacement writes it as (B, 1, H * V) or
            (B, H, 1, V)).
        time_major: Whether key, value and mask lead with the time axis.
        scale: The multiplier of the raw scores.
        soft_cap: None, or the cap of `cap * tanh(scores / cap)`.
        query_shape: The query's (H, K).
        key_value_shape: The keys' and values' (H_kv, K, V).
    """

    nodes: tuple[onnx.NodeProto, ...]
    query: str
    key: str
    value: str
    mask: str | None
    output: str
    time_major: bool
    scale: float
    soft_cap: float | None
    query_shape: tuple[int, int]
    key_value_shape: tuple[int, int, int]


def replacement(core: StepCore, name: str) -> list[onnx.NodeProto]:
    """ONNX's Attention of the core's inputs, writing `core.output` as
    (B, 1, H * V) (batch-major caches) or (B, H, 1, V) (time-major ones):
    (B, 1, H, V)'s elements in their order, which is all its readers
    (Reshapes, `analyse` checks) read.

    Batch-major keys and values (B, Tk, H_kv, D) go in as (B, Tk, H_kv * D)
    and the query as (B, 1, H * K), reshapes of the tensors as they are: the
    (B, heads, time, D) layout would copy the cache's keys and values once
    per layer and step (Attention's 3-D inputs took 0.55x to 0.74x the time
    of the transposes and the 4-D Attention at batch 1 and 8, 80 and 640
    keys, with the same numbers). Time-major ones are transposed to it."""
    heads, depth = core.query_shape
    kv_heads, key_depth, value_depth = core.key_value_shape
    attributes = {"scale": core.scale}
    if core.soft_cap is not None:
        attributes["softcap"] = core.soft_cap
    if core.time_major:
        nodes, inputs = _transposed(core, name, [-1, 1, heads, depth])
    else:
        nodes, inputs = _reshaped(
            core,
            name,
            {
                "query": [-1, 1, heads * depth],
                "key": [0, -1, kv_heads * key_depth],
                "value": [0, -1, kv_heads * value_depth],
            },
        )
        attributes.update(q_num_heads=heads, kv_num_heads=kv_heads)
    nodes.append(
        helper.make_node("Attention", inputs, [core.output], name, **attributes)
    )
    return nodes


def _roles(core: StepCore) -> list[tuple[str, str]]:
    roles = [("query", core.query), ("key", core.key), ("value", core.value)]
    return roles + ([("mask", core.mask)] if core.mask is not None else [])


def _reshape(tensor: str, shape: list[int], name: str) -> list[onnx.NodeProto]:
    """`tensor` reshaped to the constant `shape`, written to `name`."""
    value = numpy_helper.from_array(np.asarray(shape, np.int64))
    return [
        helper.make_node(
            "Constant", [], [f"{name}_shape"], f"{name}_shape", value=value
        ),
        helper.make_node("Reshape", [tensor, f"{name}_shape"], [name], name),
    ]


def _reshaped(core: StepCore, name: str, shapes: dict) -> tuple[list, list[str]]:
    """Attention's 3-D inputs: query, keys and values reshaped to `shapes`,
    the (B, Tk, 1, 1) mask transposed to (B, 1, 1, Tk)."""
    nodes, inputs = [], []
    for role, tensor in _roles(core):
        inputs.append(f"{name}/{role}")
        if role == "mask":
            nodes.append(
                helper.make_node(
                    "Transpose", [tensor], [inputs[-1]], inputs[-1], perm=[0, 2, 3, 1]
                )
            )
        else:
            nodes += _reshape(tensor, shapes[role], inputs[-1])
    return nodes, inputs


def _transposed(core: StepCore, name: str, query_shape) -> tuple[list, list[str]]:
    """Attention's 4-D inputs from a time-major core: the query as (B, 1,
    H, K), everything transposed to (B, heads, time, D) and the mask to
    (B, 1, 1, Tk)."""
    nodes = _reshape(core.query, query_shape, f"{name}/query_4d")
    perms = {
        "query": [0, 2, 1, 3],
        "key": [1, 2, 0, 3],
        "value": [1, 2, 0, 3],
        "mask": [1, 2, 3, 0],
    }
    inputs = []
    for role, tensor in _roles(core):
        inputs.append(f"{name}/{role}")
        source = f"{name}/query_4d" if role == "query" else tensor
        nodes.append(
            helper.make_node(
                "Transpose", [source], [inputs[-1]], inputs[-1], perm=perms[role]
            )
        )
    return nodes, inputs


def _entering(nodes) -> list[str]:
    produced = {name for node in nodes for name in node.output if name}
    names = [name for node in nodes for name in node.input if name]
    return sorted({name for name in names if name not in produced})


def _upstream_in(nodes, tensor: str) -> set[str]:
    """The tensors `tensor` is computed from within `nodes` (itself too)."""
    producer = {name: node for node in nodes for name in node.output}
    found, stack = set(), [tensor]
    while stack:
        name = stack.pop()
        if name not in found:
            found.add(name)
            if name in producer:
                stack.extend(i for i in producer[name].input if i)
    return found


def _reference(query, key, value, mask, time_major, layer):
    """The layer's attention of one query per row, in float64 numpy."""
    if time_major:
        key, value = key.transpose(1, 0, 2, 3), value.transpose(1, 0, 2, 3)
        mask = None if mask is None else mask.transpose(1, 0, 2, 3)
    groups = query.shape[2] // key.shape[2]
    key = np.repeat(key.astype(np.float64), groups, axis=2)  # (B, Tk, H, K)
    value = np.repeat(value.astype(np.float64), groups, axis=2)
    scores = np.einsum("bhk,bthk->bht", query[:, 0].astype(np.float64), key)
    scores = scores * layer.effective_scale
    if layer.logit_soft_cap is not None:
        scores = layer.logit_soft_cap * np.tanh(scores / layer.logit_soft_cap)
    if mask is not None:
        allowed = np.broadcast_to(mask[:, :, 0, 0], scores[:, 0].shape)[:, None]
        scores = np.where(allowed, scores, -np.inf)
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    weights /= weights.sum(axis=-1, keepdims=True)
    return np.einsum("bht,bthv->bhv", weights, value)[:, None]


def _probe_inputs(layer, time_major: bool, has_mask: bool) -> list[np.ndarray]:
    """Random (query, key, value[, mask]) of the layer's sizes; every row
    keeps its newest key (the step attends itself)."""
    rng = np.random.default_rng(0)
    batch, keys = _PROBE_BATCH, _PROBE_KEYS
    heads, kv_heads, dims = layer.num_heads, layer._kv_heads, layer._dims
    lead = (keys, batch) if time_major else (batch, keys)
    arrays = [
        rng.standard_normal((batch, 1, heads, dims.key_dim)),
        rng.standard_normal((*lead, kv_heads, dims.key_dim)),
        rng.standard_normal((*lead, kv_heads, dims.value_dim)),
    ]
    arrays = [array.astype(np.float32) for array in arrays]
    if has_mask:
        allowed = rng.random((batch, keys)) < 0.6
        allowed[:, -1] = True
        if time_major:
            allowed = allowed.T
        arrays.append(allowed[:, :, None, None])
    return arrays


def _probe_model(core: StepCore, constants, opset) -> onnx.ModelProto:
    """The group's nodes and its replacement side by side, one output each
    (the elements of (B, 1, H, V) in their order)."""
    roles = [core.query, core.key, core.value, core.mask]
    inputs = [
        helper.make_tensor_value_info(
            name, TensorProto.BOOL if name == core.mask else TensorProto.FLOAT, None
        )
        for name in roles
        if name is not None
    ]
    fused_output = f"{core.output}/fused_probe"
    swapped = dataclasses.replace(core, output=fused_output)
    graph = helper.make_graph(
        [*core.nodes, *replacement(swapped, "probe")],
        "step_core_probe",
        inputs,
        [
            helper.make_tensor_value_info(core.output, TensorProto.FLOAT, None),
            helper.make_tensor_value_info(fused_output, TensorProto.FLOAT, None),
        ],
        [numpy_helper.from_array(value, name) for name, value in constants.items()],
    )
    model = helper.make_model(graph, opset_imports=list(opset))
    model.ir_version = helper.find_min_ir_version_for(list(opset), True)
    return model


def _computes_attention(core: StepCore, constants, opset, layer) -> bool:
    """Whether the group and its replacement compute the layer's attention
    on random inputs (module docstring, 3)."""
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.log_severity_level = 4
    arrays = _probe_inputs(layer, core.time_major, core.mask is not None)
    mask = arrays[3] if core.mask else None
    expected = _reference(*arrays[:3], mask, core.time_major, layer)
    names = [name for name in (core.query, core.key, core.value, core.mask) if name]
    try:
        session = onnxruntime.InferenceSession(
            _probe_model(core, constants, opset).SerializeToString(),
            options,
            providers=["CPUExecutionProvider"],
        )
        outputs = session.run(None, dict(zip(names, arrays, strict=True)))
    except Exception:  # noqa: BLE001 - shapes that do not fit: not this layout
        return False
    return all(
        output.size == expected.size
        and np.allclose(output.reshape(expected.shape), expected, rtol=1e-4, atol=1e-5)
        for output in outputs
    )


def _read_as_reshaped(graph, name: str, readers, constants) -> bool:
    """Whether every reader of `name` is a Reshape to a constant shape
    without a 0 (which would copy a dimension of `name`), so only the order
    of its elements counts; not a graph output."""
    if name in {info.name for info in graph.output}:
        return False
    return all(
        node.op_type == "Reshape"
        and node.input[0] == name
        and node.input[1] in constants
        and 0 not in np.asarray(constants[node.input[1]]).tolist()
        for node in readers.get(name, ())
    )


def analyse(graph, nodes, constants, elem_types, readers, opset, layer) -> StepCore:
    """Checks one step core group (module docstring); raises NotFusable.

    Args:
        graph: The `Loop` body holding the group.
        nodes: The nodes under one call's `FUSABLE_STEP_SCOPE`.
        constants: Tensor name -> numpy value, the constants the body sees.
        elem_types: Tensor name -> ONNX element type, where known.
        readers: Tensor name -> the body's nodes reading it (`graph.consumers`).
        opset: The model's opset imports.
        layer: The SelfAttention layer of the core, or None if unknown.

    Returns:
        The recognised `StepCore`.
    """
    if layer is None:
        raise NotFusable("its SelfAttention layer was not found in the model")
    if layer.use_sinks:
        raise NotFusable("use_sinks=True: ONNX's Attention op has no sink logits")
    if layer.position_bias is not None:
        raise NotFusable(
            f"its position bias ({layer.position_bias!r}) is computed in the step"
        )
    odd = sorted({node.op_type for node in nodes} - _OPS)
    if odd:
        raise NotFusable(f"unexpected ops {odd} in the step core")
    inside = {id(node) for node in nodes}
    outputs = {info.name for info in graph.output}
    leaving = sorted(
        name
        for node in nodes
        for name in node.output
        if name in outputs
        or any(id(reader) not in inside for reader in readers.get(name, ()))
    )
    if len(leaving) != 1:
        raise NotFusable("the step core has an unrecognised structure")
    if not _read_as_reshaped(graph, leaving[0], readers, constants):
        raise NotFusable("its output is read other than by a Reshape")
    computed = [name for name in _entering(nodes) if name not in constants]
    floats = [n for n in computed if elem_types.get(n) == TensorProto.FLOAT]
    bools = [n for n in computed if elem_types.get(n) == TensorProto.BOOL]
    if len(floats) != 3 or len(bools) > 1 or len(floats) + len(bools) != len(computed):
        raise NotFusable(
            "unexpected inputs enter the step core (only float32 query, keys "
            "and values and a bool mask are fused)"
        )
    exps = [node for node in nodes if node.op_type == "Exp"]
    scored = set().union(*(_upstream_in(nodes, node.output[0]) for node in exps))
    values = [name for name in floats if name not in scored]
    if len(exps) != 1 or len(values) != 1:
        raise NotFusable("the step core's softmax was not recognised")
    used = {name for name in _entering(nodes) if name in constants}
    pair = [name for name in floats if name != values[0]]
    cap = None if layer.logit_soft_cap is None else float(layer.logit_soft_cap)
    for (query, key), time_major in itertools.product(
        (pair, pair[::-1]), (True, False)
    ):
        core = StepCore(
            nodes=tuple(nodes),
            query=query,
            key=key,
            value=values[0],
            mask=bools[0] if bools else None,
            output=leaving[0],
            time_major=time_major,
            scale=float(layer.effective_scale),
            soft_cap=cap,
            query_shape=(layer.num_heads, layer._dims.key_dim),
            key_value_shape=(
                layer._kv_heads,
                layer._dims.key_dim,
                layer._dims.value_dim,
            ),
        )
        if _computes_attention(core, {n: constants[n] for n in used}, opset, layer):
            return core
    raise NotFusable("the step core does not compute the layer's attention")
