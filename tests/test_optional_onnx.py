"""Without the `onnx` extra, SavedModel export works and ONNX export says why not."""

import subprocess
import sys
import textwrap

import keras
import pytest

from keras_selfattn import SelfAttention

pytestmark = pytest.mark.tensorflow_only("SavedModel export without the onnx packages")

# Makes `import onnx`, `tf2onnx` and `onnxruntime` fail, as if not installed.
_BLOCK_ONNX = """
import importlib.abc, sys
class _NoOnnx(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"onnx", "tf2onnx", "onnxruntime"}:
            raise ModuleNotFoundError(f"No module named {name!r}")
        return None
sys.meta_path.insert(0, _NoOnnx())
"""


@pytest.mark.slow  # a SavedModel export and check in a second interpreter
def test_saved_model_export_without_onnx_packages(tmp_path):
    model_path = tmp_path / "model.keras"
    keras.Sequential([keras.Input((None, 4), name="x"), SelfAttention()]).save(
        model_path
    )
    script = _BLOCK_ONNX + textwrap.dedent(
        f"""
        import keras, keras_selfattn.export as ex
        from keras_selfattn_cli import main
        model = keras.models.load_model({str(model_path)!r})
        print("saved", ex.export_saved_model(model, {str(tmp_path / "sm")!r}, "m"))
        try:
            ex.export_onnx(model, {str(tmp_path / "api.onnx")!r})
        except ImportError as error:
            print("api:", error)
        status = main(["export", {str(model_path)!r}, "--onnx",
                       {str(tmp_path / "m.onnx")!r}])
        print("cli status", status)
        assert "onnx" not in sys.modules and "tf2onnx" not in sys.modules
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        env={"TF_CPP_MIN_LOG_LEVEL": "3", "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert f"saved {tmp_path / 'sm' / 'm' / '1'}" in out
    assert "api: ONNX export needs onnx" in out
    assert "pip install 'keras_selfattn[onnx]'" in out
    assert "cli status 1" in out
    assert "keras_selfattn[onnx]" in result.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "m.onnx").exists()
    assert not (tmp_path / "api.onnx").exists()
