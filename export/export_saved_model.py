"""Export a .keras model for TF Serving: BASE_DIR/NAME/VERSION/, then verify.

    python export/export_saved_model.py MODEL.keras BASE_DIR \
        [--name NAME] [--version N] [--warmup]

The same as `keras-selfattn export MODEL.keras --saved-model BASE_DIR ...`
(see keras_selfattn/cli.py): prints each step and a parity table, exits
non-zero with a one-line error.
"""

import argparse
import sys

from keras_selfattn.cli import main


def _argv(args: list[str]) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model", metavar="MODEL.keras")
    parser.add_argument("base_dir", metavar="BASE_DIR")
    parser.add_argument("--name")
    parser.add_argument("--version")
    parser.add_argument("--warmup", action="store_true")
    parsed = parser.parse_args(args)
    argv = ["export", parsed.model, "--saved-model", parsed.base_dir]
    if parsed.name is not None:
        argv += ["--name", parsed.name]
    if parsed.version is not None:
        argv += ["--version", parsed.version]
    return argv + (["--warmup"] if parsed.warmup else [])


if __name__ == "__main__":
    sys.exit(main(_argv(sys.argv[1:])))
