"""Export a .keras model to ONNX through tf2onnx, then verify in onnxruntime.

    python export/export_onnx_model.py MODEL.keras OUT.onnx [--opset N]

The same as `keras-selfattn export MODEL.keras --onnx OUT.onnx ...` (see
keras_selfattn/cli.py). Named onnx_model, not onnx.py: a script's folder comes
first on sys.path and would shadow the `onnx` package.
"""

import argparse
import sys

from keras_selfattn.cli import main


def _argv(args: list[str]) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model", metavar="MODEL.keras")
    parser.add_argument("output", metavar="OUT.onnx")
    parser.add_argument("--opset")
    parsed = parser.parse_args(args)
    argv = ["export", parsed.model, "--onnx", parsed.output]
    return argv + (["--opset", parsed.opset] if parsed.opset is not None else [])


if __name__ == "__main__":
    sys.exit(main(_argv(sys.argv[1:])))
