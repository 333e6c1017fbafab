"""The 2 GiB that one protobuf (ONNX, a frozen GraphDef) or one flatbuffer
(LiteRT) holds, and the size of the weights a target exports."""

from __future__ import annotations

import numpy as np

from keras_selfattn.export.signature import Signature

# Protobuf's and FlatBuffers' limit on one serialized message.
MESSAGE_LIMIT = 2**31
# Weights from which a file keeps them apart (ONNX external data, LiteRT
# buffers after the flatbuffer): the rest of the limit is the graph's.
APART_BYTES = MESSAGE_LIMIT - 2**27


def weight_bytes(target: Signature) -> int:
    """The bytes of the weights of the target's model."""
    return sum(
        int(np.prod(weight.shape)) * np.dtype(weight.dtype).itemsize
        for weight in target.model.weights
    )
