"""Past 2 GiB: the weights written to the external data file as they are
converted.

Protobuf serializes at most 2 GiB, so a model whose weights come near it is
written as `model.onnx` beside `model.onnx.data` (`format.save`). Its
weights go to that file as the conversion stores them (`WeightFile`): each
is written from the memory it shares with its variable, and the converted
proto refers to it by offset, so exporting holds the weights once (the
model's) where the proto's initializers held them a second time until the
file was written. Passes that read a stored weight's value read it from
the file (`graph.constant_value` under `graph.external_data_in`);
`format.save` appends the other tensors of 1 KiB or more (smaller weights,
and what the passes added).

A quantized model's weights go to the file too, whatever their size: the
converted graph holds its int4, grouped and float8 kernels dequantized, in
float32, until the integer pass stores Keras's integers again (int8 ones
are traced as their integers: `quantization.in_graph`), and in the proto
those floats were a copy of every kernel at the export's peak. Afterwards
the file keeps only what the model still refers to (`compact`), or, where
the model is small enough for one file, its weights go back into the proto
(`load`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from types import TracebackType
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # onnx is an extra, imported when a file is written
    import onnx

# Weights of more elements than this are written to the file as the
# conversion stores them; fewer stay in the proto until `save` (the
# generator's passes read the values of small initializers: axes, shapes,
# scalars).
STORED_ELEMENTS = 1024
# Each stored weight starts at a multiple of this (a page: ONNX Runtime
# can map it).
ALIGNMENT = 4096


class WeightFile:
    """An ONNX file's external data file, written as weights are stored
    (`initializer`); a context manager that creates and closes it.

    Args:
        path: The data file, beside the .onnx file, which refers to it by
            its base name.
    """

    def __init__(self, path: str):
        self.path = path
        self._file = None

    def __enter__(self) -> WeightFile:
        self._file = open(self.path, "xb")
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._file.close()

    def initializer(self, name: str, value: np.ndarray) -> onnx.TensorProto:
        """`value` as the initializer `name`: written to the file (more than
        `STORED_ELEMENTS` elements) or held in the proto."""
        from onnx import TensorProto, helper, numpy_helper

        if value.size <= STORED_ELEMENTS:
            return numpy_helper.from_array(value, name)
        value = np.ascontiguousarray(value, value.dtype.newbyteorder("<"))
        file = self._file
        offset = -file.tell() % ALIGNMENT + file.tell()
        file.seek(offset)
        file.write(memoryview(value).cast("B"))  # no copy of the weight
        tensor = TensorProto(
            name=name,
            dims=value.shape,
            data_type=helper.np_dtype_to_tensor_dtype(value.dtype),
            data_location=TensorProto.EXTERNAL,
        )
        for key, entry in (
            ("location", os.path.basename(self.path)),
            ("offset", offset),
            ("length", value.nbytes),
        ):
            tensor.external_data.add(key=key, value=str(entry))
        return tensor


def _tensors(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
    """The tensors of `graph` and of its subgraphs: initializers and node
    attributes."""
    yield from graph.initializer
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.HasField("t"):
                yield attribute.t
            yield from attribute.tensors
            if attribute.HasField("g"):
                yield from _tensors(attribute.g)
            for inner in attribute.graphs:
                yield from _tensors(inner)


def _stored(proto: onnx.ModelProto) -> list[onnx.TensorProto]:
    from onnx import TensorProto

    return [
        tensor
        for tensor in _tensors(proto.graph)
        if tensor.data_location == TensorProto.EXTERNAL
    ]


def compact(proto: onnx.ModelProto, path: str) -> None:
    """Rewrites the data file at `path` with only the tensors `proto` refers
    to (the kernels the integer pass replaced are dropped), each aligned,
    and points `proto` at their new offsets; the old file is replaced."""
    moved: dict[tuple[str, str], int] = {}
    with open(path, "rb") as old, open(path + ".compact", "xb") as new:
        for tensor in _stored(proto):
            entries = {entry.key: entry for entry in tensor.external_data}
            span = (entries["offset"].value, entries["length"].value)
            if span not in moved:
                moved[span] = -new.tell() % ALIGNMENT + new.tell()
                new.seek(moved[span])
                old.seek(int(span[0]))
                _copy(old, new, int(span[1]))
            entries["offset"].value = str(moved[span])
    os.replace(path + ".compact", path)


def _copy(source, destination, length: int, chunk: int = 2**26) -> None:
    while length > 0:
        data = source.read(min(chunk, length))
        if not data:
            raise ValueError(f"The external data file ends {length} bytes early")
        destination.write(data)
        length -= len(data)


def load(proto: onnx.ModelProto, path: str) -> None:
    """Moves the tensors `proto` stores in the data file at `path` into the
    proto (onnx's own loader), and removes the file."""
    from onnx.external_data_helper import load_external_data_for_model

    load_external_data_for_model(proto, os.path.dirname(path))
    os.remove(path)
