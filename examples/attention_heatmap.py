"""Heatmaps of the attention weights of the notebooks' three inputs.

The inputs [1,0,1,0], [0,2,0,2], [1,1,1,1] and the weight matrices of
notebooks 000, 001 and 004 are loaded into `SelfAttention`; the PNG shows the
weights with the scale of notebook 000 (1/sqrt(3), the layer's default for
key_dim=3) next to the unscaled weights of notebooks 001 and 004 (scale=1.0),
with each weight written in its cell. Scaling flattens the distribution.

Run: `.venv/bin/python examples/attention_heatmap.py [--out DIR]` (it takes a
few seconds, so it has no separate fast mode).
"""

from __future__ import annotations

import _common
import numpy as np
from seeds_walkthrough import KERNELS_ABC, X_ABC, loaded_layer, run


def main() -> None:
    args = _common.parse_args(__doc__.splitlines()[0])
    panels = {
        "notebook 000: scale = 1/sqrt(3) (default)": {"key_dim": 3},
        "notebooks 001, 004: scale = 1.0": {"key_dim": 3, "scale": 1.0},
    }
    matrices = []
    np.set_printoptions(precision=6, suppress=True)
    for title, arguments in panels.items():
        _, weights = run(loaded_layer(X_ABC, KERNELS_ABC, **arguments), X_ABC)
        print(f"{title}  SelfAttention({arguments}) weights:")
        print(weights)
        matrices.append(weights)
    path = _common.save_heatmaps(
        matrices,
        list(panels),
        args.out / "attention_heatmap.png",
        tick_labels=["input 1", "input 2", "input 3"],
        xlabel="key",
        ylabel="query",
        annotate=True,
    )
    print(f"heatmap: {path}")


if __name__ == "__main__":
    main()
