"""A LiteRT file converted without its matrices, which are written in after.

TensorFlow's converter holds every weight several times over (the
SavedModel's variables, MLIR's constants, the flatbuffer, Python's bytes of
it: 7.3 times a 0.59 B model's weights). So the conversion reads each
float32 matrix of the model as a marker instead: `tf.fill` of a value of
its own (`marks`), which the converter folds into one constant held as a
single value and the SavedModel never stores. The flatbuffer it writes
holds each marked matrix as its marker value repeated, laid out as its
operation wants it (a fully connected layer's weights transposed); `fill`
finds each such buffer by its value and shape and writes the matrix's own
values over it, in the file, one matrix at a time. A square matrix's
shape cannot tell its layout: the operations reading its buffer do (a
fully connected layer's weights, a batch matmul's right side and its
`adj_y`).

A buffer this cannot tell apart (a marker folded into another constant,
its shape neither the matrix's nor the matrix's transposed, a square one
read otherwise) leaves the file unfilled: the conversion is then done
again with the weights, and the export's fresh-process check compares the
file's tokens with Keras's in either case.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator, Sequence, Set

import keras
import numpy as np

# Markers are integers from here, exact in float32 and far from weights.
_FIRST = 2.0**20
_READ_BYTES = 2**26


class Marked:
    """A matrix read as its marker value while the conversion traces it.

    Attributes:
        variable: The matrix.
        value: Its marker, a float32.
        read: Whether a traced function read it (so its buffer is expected).
    """

    def __init__(self, variable: keras.Variable, value: float):
        self.variable = variable
        self.value = np.float32(value)
        self.read = False

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.variable.shape)


def marks(model: keras.Model) -> list[Marked]:
    """The float32 matrices of `model`, which the conversion reads as
    markers."""
    matrices = [
        weight
        for weight in model.weights
        if len(weight.shape) == 2
        and keras.backend.standardize_dtype(weight.dtype) == "float32"
    ]
    unique = list({id(weight): weight for weight in matrices}.values())
    return [Marked(weight, _FIRST + index) for index, weight in enumerate(unique)]


class Assigned(RuntimeError):
    """A traced function assigns a variable, which markers would drop."""


class _MarkerScope(keras.StatelessScope):
    """Reads `marked` matrices as their markers and records which are read;
    refuses assignments (a stateless scope would keep them from the graph)."""

    def __init__(self, marked: Sequence[Marked]):
        import tensorflow as tf

        super().__init__(
            [(each.variable, tf.fill(each.shape, each.value)) for each in marked]
        )
        self._marked = {id(each.variable): each for each in marked}

    def get_current_value(self, variable):
        value = super().get_current_value(variable)
        if value is not None:
            self._marked[id(variable)].read = True
        return value

    def add_update(self, update):
        raise Assigned(f"the model assigns {update[0].path!r} when it is called")


@contextlib.contextmanager
def read_as_markers(marked: Sequence[Marked]) -> Iterator[None]:
    """While the block traces a function, `marked` matrices read as their
    markers (graph constants the converter folds, not variables).

    Raises:
        Assigned: if the function assigns a variable.
    """
    with _MarkerScope(marked):
        yield


def _model(mapped):
    from tensorflow.lite.python import schema_py_generated as schema

    return schema.Model.GetRootAs(mapped, 0)


def _data_span(buffer) -> tuple[int, int]:
    """(file offset, bytes) of a buffer's data, after the flatbuffer or in it."""
    if buffer.Offset() > 1:
        return buffer.Offset(), buffer.Size()
    if buffer.DataLength() == 0:
        return 0, 0
    table = buffer._tab  # the generated class's table: where `data` starts
    return table.Vector(table.Offset(4)), buffer.DataLength()


def _is_splat(file, start: int, size: int, value: np.float32) -> bool:
    """Whether `size` bytes at `start` are float32 `value` repeated."""
    done = 0
    while done < size:
        chunk = np.frombuffer(
            os.pread(file.fileno(), min(_READ_BYTES, size - done), start + done),
            dtype=np.float32,
        )
        if not (chunk == value).all():
            return False
        done += chunk.nbytes
    return True


def _read_transposed(model, operator, slot: int) -> bool | None:
    """Whether `operator` reads the matrix in its input `slot` transposed
    ((out, in): a fully connected layer's weights; a batch matmul's right
    side under `adj_y`), or None for any other reading."""
    from tensorflow.lite.python import schema_py_generated as schema

    code = model.OperatorCodes(operator.OpcodeIndex())
    builtin = max(code.BuiltinCode(), code.DeprecatedBuiltinCode())
    if builtin == schema.BuiltinOperator.FULLY_CONNECTED and slot == 1:
        return True
    if builtin == schema.BuiltinOperator.BATCH_MATMUL and slot == 1:
        table = operator.BuiltinOptions()
        options = schema.BatchMatMulOptions()
        options.Init(table.Bytes, table.Pos)
        return bool(options.AdjY())
    return None


def _readings(model) -> tuple[dict, dict]:
    """{buffer: its tensors' shapes} and {buffer: how operations read it
    (`_read_transposed`)} over every subgraph of `model`."""
    shapes: dict[int, set[tuple[int, ...]]] = {}
    readings: dict[int, set[bool | None]] = {}
    for s in range(model.SubgraphsLength()):
        subgraph = model.Subgraphs(s)
        buffers = []
        for t in range(subgraph.TensorsLength()):
            tensor = subgraph.Tensors(t)
            buffers.append(tensor.Buffer())
            shapes.setdefault(tensor.Buffer(), set()).add(
                tuple(int(d) for d in tensor.ShapeAsNumpy())
                if tensor.ShapeLength()
                else ()
            )
        for o in range(subgraph.OperatorsLength()):
            operator = subgraph.Operators(o)
            for slot in range(operator.InputsLength()):
                tensor = operator.Inputs(slot)
                if tensor >= 0:
                    readings.setdefault(buffers[tensor], set()).add(
                        _read_transposed(model, operator, slot)
                    )
    return shapes, readings


def laid_out(each: Marked, transposed: bool) -> np.ndarray:
    """`each`'s values as its buffer holds them: float32, contiguous, and
    `transposed` by the backend's transpose (TensorFlow's ran at 2.0 GB/s
    on a 0.59 B Llama's matrix shapes where numpy's strided copy ran at
    0.76, AMD EPYC, 2026-12-02)."""
    values = keras.ops.transpose(each.variable) if transposed else each.variable
    return np.ascontiguousarray(keras.ops.convert_to_numpy(values), dtype=np.float32)


def layout(each: Marked, shape: tuple, readings: set) -> bool | None:
    """Whether the buffer of `shape` holds `each` transposed, or None if
    that cannot be told: a square matrix by the operations reading it."""
    if shape != each.shape and shape != each.shape[::-1]:
        return None
    if shape[0] != shape[1]:
        return shape != each.shape
    if len(readings) != 1:
        return None
    (transposed,) = readings
    return transposed


def _fills(
    path: str, marked: Sequence[Marked], placed: Set[int]
) -> list[tuple[int, Marked, bool]] | None:
    """(offset, matrix, transposed) for each marked buffer of the file at
    `path`, or None if a buffer holding a marker is not one of them or a
    matrix the conversion read has none and is not `placed` (its marker
    folded with other values, or cast)."""
    import mmap

    by_value = {float(each.value): each for each in marked}
    fills = []
    with (
        open(path, "rb") as file,
        mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as mapped,
    ):
        model = _model(mapped)
        shapes, readings = _readings(model)
        for index in range(model.BuffersLength()):
            start, size = _data_span(model.Buffers(index))
            if size < 4 or size % 4:
                continue
            first = np.frombuffer(os.pread(file.fileno(), 4, start), np.float32)[0]
            each = by_value.get(float(first))
            if each is None or id(each) in placed:  # a placed FILL's value
                continue
            found = shapes.get(index, set())
            count = math.prod(each.shape)
            if (
                size != 4 * count
                or len(found) != 1
                or not _is_splat(file, start, size, each.value)
            ):
                return None
            (shape,) = found
            transposed = layout(each, shape, readings.get(index, set()))
            if transposed is None:
                return None
            fills.append((start, each, transposed))
    found = {id(each) for _, each, _ in fills} | set(placed)
    if any(each.read and id(each) not in found for each in marked):
        return None
    return fills


def fill(path: str, marked: Sequence[Marked], placed: Set[int] = frozenset()) -> bool:
    """Writes the marked matrices' values over their markers in the LiteRT
    file at `path`; False (the file untouched) if a marker's buffer cannot
    be told apart. `placed`: the ids of matrices already written in
    (`litert_unfolded.place`), which have no marker buffer."""
    fills = _fills(path, marked, placed)
    if fills is None:
        return False
    with open(path, "r+b") as file:
        for start, each, transposed in fills:
            values = laid_out(each, transposed)
            file.seek(start)
            file.write(values)
            del values
    return True
