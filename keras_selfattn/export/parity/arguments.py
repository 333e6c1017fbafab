"""The argument checks of the parity checks (`verify`, `verify_decode_step`,
the generator's check): ValueErrors naming the argument and the value."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence

from keras_selfattn_runtimes import table

# The argument of `verify` (and `verify_decode_step`) naming each format's artifact.
PATH_ARGUMENT = {row.name: row.path_argument for row in table.ROWS}


def is_shape(shape: object) -> bool:
    """Whether `shape` is a (batch, time) pair of positive ints."""
    return (
        isinstance(shape, Sequence)
        and len(shape) == 2
        and all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape)
    )


def check_shapes(shapes) -> tuple[tuple[int, int], ...]:
    if not all(is_shape(shape) for shape in shapes):
        raise ValueError(
            "`shapes` must be a sequence of (batch, time) pairs of positive "
            f"ints. Received: shapes={shapes!r}"
        )
    if not shapes:
        raise ValueError(f"`shapes` must not be empty. Received: shapes={shapes!r}")
    return tuple((shape[0], shape[1]) for shape in shapes)


def artifact_paths(
    keywords: Mapping[str, object],
    paths: Mapping[str, str | os.PathLike | None] | None = None,
    formats: Sequence[str] = table.NAMES,
) -> dict[str, str | os.PathLike | None]:
    """{format: path or None} of a check's artifacts, every format a key.

    Args:
        keywords: The check's path keywords, {argument: path or None}, by
            the names in `PATH_ARGUMENT` (`onnx_path`, ...), passed
            explicitly; a format needs no keyword of its own.
        paths: The check's `paths` argument, {format: artifact}: any format
            of `formats`, with or without a keyword of its own.
        formats: The formats the check runs (`paths` may name only these).

    Raises:
        ValueError: if `paths` is not a mapping of formats the check runs,
            or names a format whose keyword was given too.
    """
    merged = {name: keywords.get(arg) for name, arg in PATH_ARGUMENT.items()}
    if paths is None:
        return merged
    if not isinstance(paths, Mapping):
        raise ValueError(
            f"`paths` must be a mapping {{format: path}}. Received: paths={paths!r}"
        )
    for name, path in paths.items():
        if name not in formats:
            raise ValueError(
                f"`paths` must name formats among {tuple(formats)}; "
                f"{name!r} is not one. Received: paths={dict(paths)!r}"
            )
        if path is None:
            continue
        if merged[name] is not None:
            raise ValueError(
                f"The {name!r} artifact is given twice: by `{PATH_ARGUMENT[name]}` "
                f"and by `paths`. Received: {PATH_ARGUMENT[name]}="
                f"{merged[name]!r}, paths={dict(paths)!r}"
            )
        merged[name] = path
    return merged


def check_paths(paths: Mapping[str, str | os.PathLike | None]) -> None:
    """Raises ValueError if every path of {format: path or None} is None."""
    if all(path is None for path in paths.values()):
        given = ", ".join(f"{PATH_ARGUMENT[name]}=None" for name in paths)
        raise ValueError(
            "Pass at least one of "
            + ", ".join(f"`{PATH_ARGUMENT[name]}`" for name in paths)
            + f". Received: {given}"
        )


def check_tolerance(name: str, value: object) -> float:
    """Returns `value` as a float if it is a finite non-negative number.

    Raises:
        ValueError: naming the argument and the value otherwise.
    """
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value < 0
    ):
        raise ValueError(
            f"`{name}` must be a finite non-negative number. Received: {name}={value!r}"
        )
    return float(value)
