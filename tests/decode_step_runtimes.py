"""The start of a fresh-interpreter script that runs an exported decode step
in TensorFlow's SavedModel loader and in onnxruntime, without keras_selfattn.

Arguments of the script: the .npz of arrays (loaded as `arrays`), the
SavedModel folder, the ONNX file, and a JSON list (`names`). It defines
`saved_model(feed)` and `onnx(feed)`, each returning outputs by name; a test
appends what it checks.
"""

PRELUDE = r"""
import json, sys
import numpy as np
import onnxruntime
import tensorflow as tf

arrays = np.load(sys.argv[1])
names = json.loads(sys.argv[4])
signature = tf.saved_model.load(sys.argv[2]).signatures["decode_step"]
session = onnxruntime.InferenceSession(sys.argv[3], providers=["CPUExecutionProvider"])

def saved_model(feed):
    out = signature(**{k: tf.constant(v) for k, v in feed.items()})
    return {k: v.numpy() for k, v in out.items()}

def onnx(feed):
    out = session.run(None, feed)
    return dict(zip([o.name for o in session.get_outputs()], out))
"""
