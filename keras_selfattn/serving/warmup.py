"""TF Serving warmup files (`layout.WARMUP_PATH` in a version folder).

TF Serving started with `--enable_model_warmup=true` reads this TFRecord file
of `PredictionLog` records when it loads a version and runs every request
before it marks the version available, so the first real request does not
pay for lazy initialisation.
"""

from __future__ import annotations

import os

import numpy as np
import tensorflow as tf
from google.protobuf.message import DecodeError
from tensorflow_serving.apis import predict_pb2, prediction_log_pb2

from keras_selfattn.serving.atomic_files import atomic_write
from keras_selfattn.serving.predict import build_predict_request

# TF Serving refuses a warmup file with more records (WarmupConsts).
MAX_WARMUP_RECORDS = 1000


def _check_examples(examples) -> list[dict[str, np.ndarray]]:
    if not isinstance(examples, (list, tuple)) or not examples:
        raise ValueError(
            "`examples` must be a non-empty list of dicts mapping input names "
            f"to arrays. Received: examples={examples!r}"
        )
    if len(examples) > MAX_WARMUP_RECORDS:
        raise ValueError(
            f"`examples` has {len(examples)} requests; TF Serving reads at most "
            f"{MAX_WARMUP_RECORDS} warmup records."
        )
    for i, example in enumerate(examples):
        if not isinstance(example, dict) or not example:
            raise ValueError(
                f"`examples[{i}]` must be a non-empty dict mapping input names to "
                f"arrays. Received: examples[{i}]={example!r}"
            )
    return list(examples)


def build_warmup_log(
    model_name: str,
    inputs: dict[str, np.ndarray],
    signature_name: str = "serving_default",
) -> prediction_log_pb2.PredictionLog:
    """Wraps one batch of inputs in a `PredictionLog` holding a PredictRequest.

    Args:
        model_name: The model's name in TF Serving (`model_spec.name`).
        inputs: Input name to array, each array including the batch axis.
        signature_name: The SignatureDef the request runs.

    Returns:
        A `PredictionLog` whose `predict_log.request` carries the inputs.
    """
    request = build_predict_request(model_name, inputs, signature_name)
    return prediction_log_pb2.PredictionLog(
        predict_log=prediction_log_pb2.PredictLog(request=request)
    )


def write_warmup_file(
    path: str,
    model_name: str,
    examples: list[dict[str, np.ndarray]],
    signature_name: str = "serving_default",
) -> str:
    """Writes a TF Serving warmup file of PredictRequests, atomically.

    Put it at `os.path.join(VERSION_DIR, layout.WARMUP_PATH)`, i.e.
    `VERSION_DIR/assets.extra/tf_serving_warmup_requests`; the folder is
    created when missing. The file appears whole or not at all.

    Args:
        path: Destination file.
        model_name: The model's name in TF Serving.
        examples: One dict per request, mapping input names to arrays that
            include the batch axis (dtypes must match the signature: e.g.
            int32 tokens, bool masks, float32 features). At most 1000.
        signature_name: The SignatureDef the requests run.

    Returns:
        `path`.

    Example:

    >>> import numpy as np, tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "assets.extra",
    ...                     "tf_serving_warmup_requests")
    >>> _ = write_warmup_file(path, "clf",
    ...                       [{"tokens": np.ones((1, 4), "int32")}])
    >>> len(read_warmup_file(path))
    1
    """
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise ValueError(f"`path` must be a non-empty path. Received: path={path!r}")
    path = os.fspath(path)
    examples = _check_examples(examples)
    logs = [build_warmup_log(model_name, ex, signature_name) for ex in examples]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

    def write(tmp: str) -> None:
        with tf.io.TFRecordWriter(tmp) as writer:
            for log in logs:
                writer.write(log.SerializeToString())

    return atomic_write(path, write)


def read_warmup_file(path: str) -> list[predict_pb2.PredictRequest]:
    """Reads the PredictRequests of a TF Serving warmup file.

    Args:
        path: A file written by `write_warmup_file` (or any TFRecord file of
            `PredictionLog` records with `predict_log` set).

    Returns:
        The requests in file order.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"No warmup file at `path`. Received: path={path!r}")
    requests = []
    try:
        records = [r.numpy() for r in tf.data.TFRecordDataset(path)]
    except tf.errors.DataLossError as e:
        raise ValueError(
            f"`path` is not a TFRecord file. Received: path={path!r} ({e.message})"
        ) from None
    for i, record in enumerate(records):
        log = prediction_log_pb2.PredictionLog()
        try:
            log.ParseFromString(record)
        except DecodeError:
            raise ValueError(
                f"Record {i} of {path!r} is not a PredictionLog proto."
            ) from None
        if log.WhichOneof("log_type") != "predict_log":
            raise ValueError(
                f"Record {i} of {path!r} is not a predict_log PredictionLog "
                f"(found {log.WhichOneof('log_type')!r})."
            )
        requests.append(log.predict_log.request)
    return requests
