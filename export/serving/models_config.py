"""Write the models.config TF Serving reads, for every model in an export base dir.

    python export/serving/models_config.py BASE_DIR            # Docker
    python export/serving/models_config.py BASE_DIR --local    # local server

Without --local it writes BASE_DIR/models.config with base paths
/models/NAME: the paths `tensorflow/serving` sees when BASE_DIR is mounted at
/models (`keras-selfattn export --saved-model BASE_DIR` writes the same file).
With --local it writes BASE_DIR/models.local.config with absolute paths, for a
`tensorflow_model_server` running on this machine.
"""

from __future__ import annotations

import argparse
import sys

from keras_selfattn.serving.layout import served_model_names
from keras_selfattn.serving.model_config import (
    CONFIG_FILE_NAME,
    DOCKER_MODELS_DIR,
    LOCAL_CONFIG_FILE_NAME,
    write_models_config,
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("base_dir", metavar="BASE_DIR")
    parser.add_argument(
        "--local",
        action="store_true",
        help="absolute local paths, written to models.local.config",
    )
    args = parser.parse_args(argv)
    try:
        names = served_model_names(args.base_dir)
        if not names:
            raise ValueError(
                f"No model folder with a version holding saved_model.pb in "
                f"{args.base_dir!r}"
            )
        path = write_models_config(
            args.base_dir,
            names,
            container_base=None if args.local else DOCKER_MODELS_DIR,
            file_name=LOCAL_CONFIG_FILE_NAME if args.local else CONFIG_FILE_NAME,
        )
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {path} serving {', '.join(names)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
