"""A SavedModel's signature in TensorFlow, run as TF Serving would run it."""

from __future__ import annotations

import ctypes
import json
import os

from ._common import Loaded, natural

# Where the exporter says what the SavedModel computes and needs
# (formats.saved_model.DESCRIPTION_PATH; not imported: no Keras here).
DESCRIPTION_PATH = os.path.join("assets.extra", "keras_selfattn.json")
# What a SavedModel that needs XLA says (saved_model.XLA_FLAG), and
# TensorFlow's C++ switch that TF Serving flips without it.
_XLA_FLAG = "--xla_cpu_compilation_enabled=true"
_TF_LIBRARY = "libtensorflow_cc.so.2"
_DISABLE_XLA = "_ZN10tensorflow21DisableXlaCompilationEv"


def _as_tf_serving_would(tf, flags: list) -> None:
    """Disables XLA as TF Serving does on a CPU unless it is started with
    `--xla_cpu_compilation_enabled=true` (its main calls TensorFlow's
    `DisableXlaCompilation()`): an op that only XLA runs then fails."""
    if _XLA_FLAG in flags:
        return
    library = ctypes.CDLL(os.path.join(os.path.dirname(tf.__file__), _TF_LIBRARY))
    getattr(library, _DISABLE_XLA)()


class SavedModel(Loaded):
    """One signature of a SavedModel (module docstring)."""

    def __init__(self, path: str, signature: str, tf_serving: bool):
        import tensorflow as tf

        described = os.path.join(path, DESCRIPTION_PATH)
        self.description = {}
        if os.path.isfile(described):
            with open(described) as file:
                self.description = json.load(file)
        if tf_serving:
            _as_tf_serving_would(tf, self.description.get("tf_serving_flags", []))
        # TF Serving's SavedModelBundle: the meta graph imported into a
        # session, its variables restored, the signature run by its tensors'
        # names (not TensorFlow 2's restored Python functions).
        self._session = tf.compat.v1.Session(graph=tf.Graph())
        meta_graph = tf.compat.v1.saved_model.loader.load(
            self._session, [tf.saved_model.SERVING], path
        )
        if signature not in meta_graph.signature_def:
            served = [k for k in meta_graph.signature_def if not k.startswith("__")]
            raise ValueError(f"no {signature!r} signature; it has {sorted(served)}")
        found = meta_graph.signature_def[signature]
        self.input_names = sorted(found.inputs, key=natural)
        self.output_names = sorted(found.outputs, key=natural)
        self._feeds = {name: found.inputs[name].name for name in self.input_names}
        self._fetches = {name: found.outputs[name].name for name in self.output_names}

    def __call__(self, arrays):
        feeds = {self._feeds[name]: value for name, value in arrays.items()}
        return self._session.run(self._fetches, feeds)


def load(path: str, signature: str, tf_serving: bool = True) -> SavedModel:
    """The SavedModel folder `path`'s `signature`.

    Args:
        path: The SavedModel's (version) folder.
        signature: The signature to call.
        tf_serving: Whether XLA is disabled in this process, as TF Serving
            does on a CPU, unless the SavedModel says it needs it (its
            description's `tf_serving_flags`); False leaves TensorFlow as
            it is (a benchmark timing TensorFlow's own XLA).
    """
    return SavedModel(path, signature, tf_serving)
