"""Checks of what a request carries (tensors, signature), and the client error."""

from __future__ import annotations

import numpy as np


class ServingError(RuntimeError):
    """TF Serving could not be reached, or answered with an error."""


def check_inputs(inputs) -> dict[str, np.ndarray]:
    """Returns `inputs` as a dict of numpy arrays of numeric or bool dtype.

    Args:
        inputs: Mapping of input name to array-like.

    Returns:
        A new dict mapping each name to a numpy array.
    """
    if not isinstance(inputs, dict) or not inputs:
        raise ValueError(
            "`inputs` must be a non-empty dict mapping input names to arrays. "
            f"Received: inputs={inputs!r}"
        )
    arrays = {}
    for name, value in inputs.items():
        if not isinstance(name, str) or not name:
            raise ValueError(
                "Every key of `inputs` must be a non-empty string. "
                f"Received: key={name!r}"
            )
        array = np.asarray(value)
        if array.dtype.kind not in "biuf":
            raise ValueError(
                f"`inputs[{name!r}]` must hold bool, integer or float values. "
                f"Received: dtype={array.dtype}"
            )
        arrays[name] = array
    return arrays


def check_signature_name(signature_name) -> str:
    """Returns `signature_name` if it is a non-empty string; else ValueError."""
    if not isinstance(signature_name, str) or not signature_name:
        raise ValueError(
            "`signature_name` must be a non-empty string. "
            f"Received: signature_name={signature_name!r}"
        )
    return signature_name
