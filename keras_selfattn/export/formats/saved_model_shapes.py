"""A SavedModel's functions without the output shapes TensorFlow infers again.

TensorFlow's save writes every op's traced output shapes into the
SavedModel's functions (the `_output_shapes` attribute) for its Python
loader. A session (TF Serving's, the export's check) infers them again
from the ops, and holds more memory with them than without: 0.13-0.15
GiB of a 28-layer Llama generator's 3.45 GiB peak in the check's process
(docs/export.md, "Large models"). `drop_inferred_shapes` keeps them where
nothing else says them: a call's or a control flow op's outputs, which
TensorFlow cannot infer from the op's inputs (so a loaded signature's
outputs keep their traced shapes), and the graph's own nodes.
"""

from __future__ import annotations

import os

SHAPES_ATTRIBUTE = "_output_shapes"
# Ops whose output shapes TensorFlow cannot infer from their inputs: their
# traced shapes are kept.
OPAQUE_OPS = frozenset(
    {
        "PartitionedCall",
        "StatefulPartitionedCall",
        "While",
        "StatelessWhile",
        "If",
        "StatelessIf",
        "Case",
        "StatelessCase",
    }
)
_GRAPH_FILE = "saved_model.pb"


def drop_inferred_shapes(directory: str) -> None:
    """Drops from the functions of the SavedModel in `directory` the output
    shapes of every op but `OPAQUE_OPS`, then writes its fingerprint anew,
    as TensorFlow's save does (`tf.saved_model.experimental.read_fingerprint`
    then describes the new file).

    A TensorFlow without the fingerprint writer imported here (a private
    module of TensorFlow's) keeps the file as its save wrote it: a
    fingerprint must describe its file.
    """
    from tensorflow.core.protobuf import saved_model_pb2

    try:
        from tensorflow.python.saved_model import fingerprinting_utils
    except ImportError:  # pragma: no cover - TensorFlow's internals moved
        return
    path = os.path.join(directory, _GRAPH_FILE)
    saved = saved_model_pb2.SavedModel()
    with open(path, "rb") as file:
        saved.ParseFromString(file.read())
    for graph in saved.meta_graphs:
        for function in graph.graph_def.library.function:
            for node in function.node_def:
                if node.op not in OPAQUE_OPS and SHAPES_ATTRIBUTE in node.attr:
                    del node.attr[SHAPES_ATTRIBUTE]
    written = path + ".tmp"
    with open(written, "wb") as file:
        file.write(saved.SerializeToString())
    os.replace(written, path)
    fingerprinting_utils.write_fingerprint(directory)
