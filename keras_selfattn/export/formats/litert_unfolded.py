"""Markers the converter left as FILL operations, made the matrices' buffers.

A large model's conversion (weights after the flatbuffer) runs with
TensorFlow's `_experimental_unfold_large_splat_constant`: the converter
then writes each large marker (`litert_weights`) as a FILL operation of its
value instead of the value repeated, so it never expands the markers and
its flatbuffer holds no weights. `place` turns each such FILL into the
matrix it marks: the FILL's output tensor gets a buffer of the matrix's
values after the flatbuffer (laid out as the operations reading it want,
`litert_weights.layout`), the FILL is dropped, and the file is written anew
beside the old one, then put in its place. One buffer serves every tensor
of a matrix in the same layout, in every signature.
"""

from __future__ import annotations

import os
import shutil
import struct
import tempfile
from collections.abc import Sequence

import numpy as np

from keras_selfattn.export.formats import litert_weights

# Where each buffer after the flatbuffer starts: a multiple of this.
_ALIGN = 64
# Each offset while the flatbuffer is packed (a default 0 would leave the
# field out), then written over in place (`_set_offsets`).
_PLACEHOLDER = 2**40


def _builtin(model, operator) -> int:
    code = model.operatorCodes[operator.opcodeIndex]
    return max(code.builtinCode, code.deprecatedBuiltinCode)


def _data(buffer, original: bytes) -> bytes:
    if buffer.offset > 1:
        return original[buffer.offset : buffer.offset + buffer.size]
    return b"" if buffer.data is None else np.asarray(buffer.data).tobytes()


def _read_transposed(model, operator, slot: int) -> bool | None:
    """Whether `operator` reads the matrix in its input `slot` transposed,
    as `litert_weights` tells it for a marker's buffer (a fully connected
    layer's weights; a batch matmul's right side under `adj_y`), or None
    for any other reading; on the flatbuffer's object form."""
    from tensorflow.lite.python import schema_py_generated as schema

    builtin = _builtin(model, operator)
    if builtin == schema.BuiltinOperator.FULLY_CONNECTED and slot == 1:
        return True
    if builtin == schema.BuiltinOperator.BATCH_MATMUL and slot == 1:
        return bool(operator.builtinOptions.adjY)
    return None


def _marker_fill(model, subgraph, operator, original, by_value):
    """(matrix, output tensor index) if `operator` fills a marker, else None."""
    from tensorflow.lite.python import schema_py_generated as schema

    if _builtin(model, operator) != schema.BuiltinOperator.FILL:
        return None
    value = subgraph.tensors[operator.inputs[1]]
    data = _data(model.buffers[value.buffer], original)
    if value.type != schema.TensorType.FLOAT32 or len(data) != 4:
        return None
    each = by_value.get(float(np.frombuffer(data, np.float32)[0]))
    return None if each is None else (each, int(operator.outputs[0]))


def _readers(model) -> list[dict[int, list]]:
    """For each subgraph of `model`: {tensor: [(operator, input slot)]}."""
    found = []
    for subgraph in model.subgraphs:
        readers: dict[int, list] = {}
        for operator in subgraph.operators:
            for slot, tensor in enumerate(operator.inputs):
                readers.setdefault(int(tensor), []).append((operator, slot))
        found.append(readers)
    return found


def _readings(model, readers, index: int, tensor: int, carried=None) -> set:
    """How the operations of subgraph `index` read `tensor`
    (`_read_transposed`), following it into the loops it is passed to (a
    loop's body carries it through as its output `carried`); any other
    output of the subgraph: None."""
    from tensorflow.lite.python import schema_py_generated as schema

    outputs = [int(t) for t in model.subgraphs[index].outputs]
    readings = (
        {None} if tensor in outputs and outputs.index(tensor) != carried else set()
    )
    for operator, slot in readers[index].get(tensor, ()):
        if _builtin(model, operator) != schema.BuiltinOperator.WHILE:
            readings.add(_read_transposed(model, operator, slot))
            continue
        options = operator.builtinOptions
        for loop, kept in (
            (options.bodySubgraphIndex, slot),
            (options.condSubgraphIndex, None),
        ):
            inside = int(model.subgraphs[loop].inputs[slot])
            readings |= _readings(model, readers, loop, inside, kept)
        readings |= _readings(model, readers, index, int(operator.outputs[slot]))
    return readings


def place(path: str, marked: Sequence[litert_weights.Marked]) -> set[int] | None:
    """Makes each marker FILL of the LiteRT file at `path` a buffer of its
    matrix's values (module docstring).

    Returns:
        The ids of the matrices placed (empty, and the file untouched, if it
        has no marker FILL), or None (the file untouched) if a marker
        FILL's shape or the operations reading it do not tell its layout.
    """
    from tensorflow.lite.python import schema_py_generated as schema

    with open(path, "rb") as file:
        original = file.read()
    model = schema.ModelT.InitFromPackedBuf(original, 0)
    by_value = {float(each.value): each for each in marked}
    readers = _readers(model)
    buffers: dict[tuple[int, bool], int] = {}
    placed: dict[int, tuple[litert_weights.Marked, bool]] = {}
    for number, subgraph in enumerate(model.subgraphs):
        kept = []
        for operator in subgraph.operators:
            found = _marker_fill(model, subgraph, operator, original, by_value)
            if found is None:
                kept.append(operator)
                continue
            each, output = found
            tensor = subgraph.tensors[output]
            shape = tuple(int(d) for d in tensor.shape)
            readings = _readings(model, readers, number, output)
            transposed = litert_weights.layout(each, shape, readings)
            if transposed is None:
                return None
            key = (id(each), transposed)
            if key not in buffers:
                buffers[key] = len(model.buffers)
                model.buffers.append(schema.BufferT())
                placed[buffers[key]] = (each, transposed)
            tensor.buffer = buffers[key]
        subgraph.operators = kept
    if not placed:
        return set()
    _write(model, original, placed, path)
    return {id(each) for each, _ in placed.values()}


def _write(model, original: bytes, placed: dict, path: str) -> None:
    """Writes `model`, its buffers with offsets after it (the converter's,
    read from `original`, and the `placed` matrices'), beside `path`, then
    moves it there."""
    sources: dict[int, bytes] = {}
    sizes: dict[int, int] = {}
    for index, buffer in enumerate(model.buffers):
        if index in placed:
            sizes[index] = 4 * int(np.prod(placed[index][0].shape))
        elif buffer.offset > 1:
            sources[index] = _data(buffer, original)
            sizes[index] = buffer.size
        else:
            continue
        buffer.offset, buffer.size = _PLACEHOLDER, sizes[index]
    flatbuffer = _packed(model)
    offsets, end = {}, len(flatbuffer)
    for index, size in sizes.items():
        offsets[index] = end = -(-end // _ALIGN) * _ALIGN
        end += size
    _set_offsets(flatbuffer, offsets)
    folder = os.path.dirname(os.path.abspath(path))
    with tempfile.NamedTemporaryFile(dir=folder, delete=False) as file:
        try:
            file.write(flatbuffer)
            for index in sizes:
                file.write(b"\0" * (offsets[index] - file.tell()))
                if index in sources:
                    file.write(sources[index])
                    continue
                each, transposed = placed[index]
                values = litert_weights.laid_out(each, transposed)
                file.write(values)
                del values
        except BaseException:
            file.close()
            os.unlink(file.name)
            raise
    shutil.copymode(path, file.name)
    os.replace(file.name, path)


def _packed(model) -> bytearray:
    import flatbuffers

    builder = flatbuffers.Builder(1024)
    builder.Finish(model.Pack(builder), file_identifier=b"TFL3")
    return builder.Output()


def _set_offsets(flatbuffer: bytearray, offsets: dict[int, int]) -> None:
    """Writes each buffer's offset over its placeholder, in place: a
    flatbuffer's scalar field is its little-endian value at a position its
    table's vtable gives."""
    from tensorflow.lite.python import schema_py_generated as schema

    model = schema.Model.GetRootAs(flatbuffer, 0)
    for index, offset in offsets.items():
        table = model.Buffers(index)._tab  # the generated class's table
        field = table.Offset(6)  # Buffer's second field, `offset`
        at = table.Pos + field
        if not field or struct.unpack_from("<Q", flatbuffer, at)[0] != _PLACEHOLDER:
            raise RuntimeError(f"LiteRT buffer {index} has no offset to set")
        struct.pack_into("<Q", flatbuffer, at, offset)
