"""SavedModels as TF Serving runs them on a CPU: with XLA disabled.

`tensorflow_model_server` calls TensorFlow's `DisableXlaCompilation()`
unless it is started with `--xla_cpu_compilation_enabled=true`; an op that
only XLA runs (Keras's `slice_update` on TensorFlow is XlaDynamicUpdateSlice;
jax2tf writes XlaCallModule) then fails every request. The server cannot run
here, so a fresh process makes the same call (through ctypes, into the
TensorFlow library TF Serving links) before it loads the SavedModel,
without keras_selfattn.

The default decoding step and generator serve that way and return what
Keras computes; the `jit_compile=True` generator does not, and says in its
assets.extra that it needs the flag.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest

from keras_selfattn.export import export_decode_step
from keras_selfattn.export.generator import export_generator
from tests import generation_reference as reference
from tests.test_generation import PROMPTS, VOCABULARY, token_model

pytestmark = pytest.mark.tensorflow_only(
    "the decoding step's and generator's SavedModels traced by TensorFlow"
)

MAX_LENGTH = 16
STEPS = 5
FLAG = "--xla_cpu_compilation_enabled=true"

_AS_TF_SERVING = textwrap.dedent(
    """
    import ctypes, json, os, sys
    import numpy as np
    import tensorflow as tf

    library = os.path.join(os.path.dirname(tf.__file__), "libtensorflow_cc.so.2")
    ctypes.CDLL(library)._ZN10tensorflow21DisableXlaCompilationEv()
    replies = []
    for job in json.loads(sys.argv[1]):
        function = tf.saved_model.load(job["dir"]).signatures[job["signature"]]
        with np.load(job["inputs"]) as feeds:
            try:
                out = function(**{k: tf.constant(feeds[k]) for k in feeds.files})
            except tf.errors.OpError as error:
                replies.append(" ".join(error.message.split()))
                continue
        np.savez(job["outputs"], **{k: v.numpy() for k, v in out.items()})
        replies.append("ok")
    print(json.dumps([replies, sorted({m.split(".")[0] for m in sys.modules})]))
    """
)


def _serve(tmp_path, jobs: list[dict]) -> list[str]:
    """Runs each job's signature on its inputs in one fresh process with XLA
    disabled; each job's outputs go to its "outputs" file."""
    for number, job in enumerate(jobs):
        job["inputs_path"] = str(tmp_path / f"in{number}.npz")
        np.savez(job["inputs_path"], **job.pop("arrays"))
        job["inputs"], job["outputs"] = (
            job["inputs_path"],
            str(tmp_path / f"out{number}.npz"),
        )
    script = tmp_path / "as_tf_serving.py"
    script.write_text(_AS_TF_SERVING)
    done = subprocess.run(
        [sys.executable, "-I", str(script), json.dumps(jobs)],
        capture_output=True,
        text=True,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
        timeout=300,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    replies, modules = json.loads(done.stdout.strip().splitlines()[-1])
    assert "keras_selfattn" not in modules
    return replies


def _flags(version_dir) -> list[str]:
    path = os.path.join(version_dir, "assets.extra", "keras_selfattn.json")
    if not os.path.isfile(path):
        return []
    with open(path) as file:
        return json.load(file).get("tf_serving_flags", [])


COMMON = {"max_length": MAX_LENGTH, "name": "lm", "check": False}


@pytest.mark.slow  # a step and a generator exported and served: 15 s
def test_default_step_and_generator_serve_without_xla(tmp_path):
    """Unchecked exports: this test runs them."""
    model = token_model()
    paths = {
        "step": export_decode_step(model, tmp_path / "step", "saved_model", **COMMON),
        "generator": export_generator(model, tmp_path / "gen", "saved_model", **COMMON),
    }
    prompt = np.array([PROMPTS[0]], np.int32)
    layers = [layer for layer in model.layers if hasattr(layer, "empty_cache")]
    caches = {
        f"cache_{layer.name}": keras.ops.convert_to_numpy(
            layer.empty_cache(1, MAX_LENGTH)
        )
        for layer in layers
    }
    step_inputs = {
        "tokens": prompt,
        "cache_update_index": np.int32(0),
        **caches,
    }
    request = reference.generator_request(PROMPTS, STEPS, VOCABULARY)
    jobs = [
        {"dir": paths["step"], "signature": "decode_step", "arrays": step_inputs},
        {"dir": paths["generator"], "signature": "generate", "arrays": request},
    ]
    assert _serve(tmp_path, jobs) == ["ok", "ok"]
    assert _flags(paths["step"]) == [] and _flags(paths["generator"]) == []
    with np.load(jobs[0]["outputs"]) as step:
        np.testing.assert_allclose(
            step["logits"],
            keras.ops.convert_to_numpy(model(prompt)),
            atol=1e-5,
            rtol=1e-5,
        )
    want, lengths = reference.uncached(model, PROMPTS, STEPS)
    with np.load(jobs[1]["outputs"]) as generated:
        np.testing.assert_array_equal(generated["tokens"], want)
        np.testing.assert_array_equal(generated["lengths"], lengths)


@pytest.mark.slow  # XLA's compile of the loop: the slow suite
def test_xla_compiled_generator_says_it_needs_the_flag(tmp_path):
    path = export_generator(
        token_model(), tmp_path / "xla", "saved_model", jit_compile=True, **COMMON
    )
    assert _flags(path) == [FLAG]
    request = reference.generator_request(PROMPTS, STEPS, VOCABULARY)
    jobs = [{"dir": path, "signature": "generate", "arrays": request}]
    (reply,) = _serve(tmp_path, jobs)
    assert "XLA compilation disabled" in reply
