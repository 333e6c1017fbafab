"""Query a running TF Serving with inputs from a JSON file; print the outputs.

    python export/serving/query.py INPUTS.json --model NAME \
        [--rest http://localhost:8501 | --grpc localhost:8500] \
        [--format instances|inputs] [--version N] [--dtype NAME=DTYPE ...] \
        [--output-name NAME]

INPUTS.json maps each input name to a batched nested list, e.g.
{"tokens": [[5, 3, 9, 0]]}. Values are sent as int32 (JSON integers),
float32 (numbers with a fraction) or bool; --dtype overrides one input
(gRPC sends tensors as they are, so they must match the signature's dtypes;
REST lets the server convert). Prints one JSON object {output: nested list}.
Exits 1 with a one-line error if the server cannot be reached or refuses.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from keras_selfattn.serving import GrpcClient, RestClient, ServingError

_DEFAULT_DTYPES = {"i": "int32", "u": "int32", "f": "float32", "b": "bool"}


def load_inputs(path: str, dtypes: dict[str, str]) -> dict[str, np.ndarray]:
    """Reads INPUTS.json into arrays: int32, float32 or bool unless overridden.

    Args:
        path: JSON file mapping input names to batched nested lists.
        dtypes: Input name to numpy dtype name, overriding the default.

    Returns:
        Input name to array.
    """
    with open(path, encoding="utf-8") as f:
        try:
            raw = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(raw, dict) or not raw:
        raise ValueError(
            f"{path} must hold a JSON object mapping input names to nested lists"
        )
    unknown = sorted(set(dtypes) - set(raw))
    if unknown:
        raise ValueError(f"--dtype names inputs not in {path}: {unknown}")
    arrays = {}
    for name, value in raw.items():
        try:
            array = np.asarray(value)
        except ValueError:
            array = np.asarray(None)  # ragged: refused below
        if array.dtype.kind not in _DEFAULT_DTYPES:
            raise ValueError(
                f"Input {name!r} in {path} is not a rectangular list of numbers "
                "or booleans"
            )
        arrays[name] = array.astype(dtypes.get(name, _DEFAULT_DTYPES[array.dtype.kind]))
    return arrays


def _dtype_option(text: str) -> tuple[str, str]:
    name, sep, dtype = text.partition("=")
    try:
        np.dtype(dtype)
    except TypeError:
        sep = ""
    if not sep or not name:
        raise argparse.ArgumentTypeError(
            f"expected NAME=DTYPE with a numpy dtype, got {text!r}"
        )
    return name, dtype


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("inputs", metavar="INPUTS.json")
    parser.add_argument("--model", required=True, help="model name in models.config")
    server = parser.add_mutually_exclusive_group()
    server.add_argument("--rest", metavar="URL", help="default http://localhost:8501")
    server.add_argument("--grpc", metavar="HOST:PORT", help="e.g. localhost:8500")
    parser.add_argument(
        "--format", choices=["instances", "inputs"], default="instances"
    )
    parser.add_argument("--version", type=int, help="default: the served latest")
    parser.add_argument("--signature", default="serving_default")
    parser.add_argument(
        "--output-name",
        default="output",
        help="key for a single output (REST answers leave its name out)",
    )
    parser.add_argument("--timeout", type=float, default=30.0)
    parser.add_argument(
        "--dtype", type=_dtype_option, action="append", default=[], metavar="NAME=DTYPE"
    )
    args = parser.parse_args(argv)
    try:
        inputs = load_inputs(args.inputs, dict(args.dtype))
        if args.grpc:
            with GrpcClient(
                args.grpc, args.model, args.version, args.signature, args.timeout
            ) as client:
                outputs = client.predict(inputs)
        else:
            client = RestClient(
                args.rest or "http://localhost:8501",
                args.model,
                args.version,
                args.signature,
                args.timeout,
            )
            outputs = client.predict(inputs, args.format, args.output_name)
    except (OSError, ValueError, ServingError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(json.dumps({name: value.tolist() for name, value in outputs.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
