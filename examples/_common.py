"""Helpers shared by the examples: command line, safe file writes, heatmaps.

Importing this module sets `TF_CPP_MIN_LOG_LEVEL=2` (unless already set) so
TensorFlow's start-up chatter does not bury the examples' output; import it
before keras.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# The repository's git-ignored artifacts folder, whatever the working directory.
DEFAULT_OUT = Path(__file__).resolve().parent.parent / "artifacts"


def parse_args(
    description: str, fast_help: str | None = None, argv: Sequence[str] | None = None
) -> argparse.Namespace:
    """Parses `--out DIR` (created if missing) and, if `fast_help`, `--fast`.

    Args:
        description: The example's one-line description for `--help`.
        fast_help: Help text of `--fast`; None means the example has no
            separate fast mode (it is fast already).
        argv: Arguments to parse; None means `sys.argv[1:]`.

    Returns:
        The namespace, with `out` an absolute `Path` that exists.
    """
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_OUT,
        help=f"folder for the files this example writes (default: {DEFAULT_OUT})",
    )
    if fast_help is not None:
        parser.add_argument("--fast", action="store_true", help=fast_help)
    args = parser.parse_args(argv)
    if args.out.exists() and not args.out.is_dir():
        parser.error(f"--out must be a folder. Received: --out={args.out}")
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    return args


def write_replacing(path: Path, write: Callable[[Path], object]) -> Path:
    """Calls `write(tmp)` on a temporary path beside `path`, then renames it.

    An older file at `path` is replaced only once the new one is complete,
    so an interrupted run never leaves a half-written file.

    Args:
        path: The file to create or replace; its folder must exist.
        write: Writes the complete file at the path it is given.

    Returns:
        `path`.
    """
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".tmp-") as tmp:
        fresh = Path(tmp) / path.name
        write(fresh)
        os.replace(fresh, path)
    return path


def save_heatmaps(
    weights: Sequence[np.ndarray],
    titles: Sequence[str],
    path: Path,
    tick_labels: Sequence[str] | None = None,
    xlabel: str = "key position",
    ylabel: str = "query position",
    annotate: bool = False,
) -> Path:
    """Draws one attention-weight heatmap per matrix side by side as a PNG.

    Args:
        weights: Square (time, time) matrices of attention weights; row i is
            how query i spreads its attention over the keys.
        titles: One title per matrix.
        path: The PNG file to write (its folder must exist).
        tick_labels: Optional names of the positions, for both axes.
        xlabel, ylabel: Axis labels.
        annotate: Whether to write each weight in its cell.

    Returns:
        `path`.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    count = len(weights)
    fig, axes = plt.subplots(
        1, count, figsize=(3.3 * count + 0.8, 3.6), squeeze=False, layout="constrained"
    )
    image = None
    for ax, matrix, title in zip(axes[0], weights, titles, strict=True):
        matrix = np.asarray(matrix, dtype="float64")
        image = ax.imshow(matrix, vmin=0.0, vmax=1.0, cmap="viridis")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        if annotate:
            for (row, col), value in np.ndenumerate(matrix):
                color = "black" if value > 0.6 else "white"
                ax.text(col, row, f"{value:.3f}", ha="center", va="center", color=color)
        positions = np.arange(matrix.shape[0])
        ax.set_xticks(positions)
        ax.set_yticks(positions)
        if tick_labels is not None:
            ax.set_xticklabels(tick_labels, rotation=45, ha="right")
            ax.set_yticklabels(tick_labels)
    fig.colorbar(image, ax=axes[0].tolist(), shrink=0.8, label="attention weight")
    write_replacing(path, lambda tmp: fig.savefig(tmp, dpi=110))
    plt.close(fig)
    return path
