"""The five reference notebooks (../shared/seeds) reproduced with SelfAttention.

Each section loads the notebook's own inputs and weight matrices into a
`SelfAttention` layer built with the arguments that reproduce that notebook,
then prints the matrices the notebook prints, computed by the layer. It also
writes every printed matrix to `seeds_walkthrough.json` in the output folder.

Run: `.venv/bin/python examples/seeds_walkthrough.py [--out DIR]` (it takes a
few seconds, so it has no separate fast mode).
"""

from __future__ import annotations

import json

import _common
import numpy as np
from keras import ops

from keras_selfattn import SelfAttention

# The inputs and weights shared by notebooks 000, 001 and 004 (row-vector
# convention: Q = X Wq, so the notebooks' matrices are the layer's kernels).
X_ABC = np.array([[1, 0, 1, 0], [0, 2, 0, 2], [1, 1, 1, 1]], dtype="float32")
WQ_ABC = np.array([[1, 0, 1], [1, 0, 0], [0, 0, 1], [0, 1, 1]], dtype="float32")
WK_ABC = np.array([[0, 0, 1], [1, 1, 0], [0, 1, 0], [1, 1, 0]], dtype="float32")
WV_ABC = np.array([[0, 2, 0], [0, 3, 0], [1, 0, 3], [1, 1, 0]], dtype="float32")
KERNELS_ABC = {"query_kernel": WQ_ABC, "key_kernel": WK_ABC, "value_kernel": WV_ABC}

RESULTS: dict[str, list] = {}


def show(key: str, label: str, value) -> None:
    """Prints `value` under a `[key] label:` line and records it for the JSON."""
    array = np.asarray(value)
    print(f"[{key}] {label}:")
    print(array)
    RESULTS[key] = array.tolist()


def header(title: str, arguments: str, note: str = "") -> None:
    print()
    print("=" * 78)
    print(title)
    print(f"layer: SelfAttention({arguments})" + (f"  # {note}" if note else ""))
    print("=" * 78)


def loaded_layer(x: np.ndarray, kernels: dict[str, np.ndarray], **kwargs):
    """A SelfAttention built for `x` with the given kernels/biases assigned."""
    layer = SelfAttention(**kwargs)
    layer.build((None,) + x.shape)
    for name, value in kernels.items():
        getattr(layer, name).assign(value)
    return layer


def run(layer: SelfAttention, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(output (T, W), weights (T, T)) of the layer on the single sequence x."""
    output, weights = layer(x[None], return_attention_scores=True)
    return ops.convert_to_numpy(output)[0], ops.convert_to_numpy(weights)[0, 0]


def projections(layer: SelfAttention, x: np.ndarray) -> dict[str, np.ndarray]:
    """The layer's Q, K, V and unscaled scores Q K^T for the sequence x."""
    out = {}
    for name in ("query", "key", "value"):
        y = ops.matmul(x, getattr(layer, f"{name}_kernel"))
        bias = getattr(layer, f"{name}_bias")
        out[name] = ops.convert_to_numpy(y if bias is None else y + bias)
    out["scores"] = out["query"] @ out["key"].T
    return out


def notebook_000() -> None:
    header(
        "000: numpy, softmax(Q K^T / sqrt(3)) V",
        "key_dim=3",
        "default scale = 1/sqrt(key_dim) = 1/sqrt(3)",
    )
    layer = loaded_layer(X_ABC, KERNELS_ABC, key_dim=3)
    proj = projections(layer, X_ABC)
    show("000.query", "query representations (X Wq)", proj["query"])
    show("000.key", "key representations (X Wk)", proj["key"])
    show("000.value", "value representations (X Wv)", proj["value"])
    divisor = np.sqrt(np.float32(layer.key_dim))
    show("000.sqrt_dk", "sqrt(key_dim), the layer's default divisor", divisor)
    output, _ = run(layer, X_ABC)
    show("000.output", "softmax(Q K^T / sqrt(3)) V (notebook cell 9)", output)


def notebook_001() -> None:
    header("001: numpy, unscaled softmax(Q K^T) V", "key_dim=3, scale=1.0")
    layer = loaded_layer(X_ABC, KERNELS_ABC, key_dim=3, scale=1.0)
    proj = projections(layer, X_ABC)
    show("001.query", "Query(Q)", proj["query"])
    show("001.key", "Key(K)", proj["key"])
    show("001.value", "Value(V)", proj["value"])
    show("001.scores", "attention_scores (Q K^T, root_dk = 1)", proj["scores"])
    output, weights = run(layer, X_ABC)
    show("001.weights", "attention_scores after softmax (layer weights)", weights)
    contributions = weights[0][:, None] * proj["value"]
    show(
        "001.contributions",
        "'Attention is' rows: weight of query 1 on key i times V[i]",
        contributions,
    )
    print(
        "The notebook's 'Sum of Attentions' adds each row above (a shortcut). "
        "The equation adds the rows together, which is the layer's output for "
        "input 1:"
    )
    show("001.output", "softmax(Q K^T) V, all three inputs", output)


def notebook_002() -> None:
    header(
        "002: numpy loop with biases, column vectors (omega @ x), unscaled",
        "key_dim=4, use_bias=True, scale=1.0",
        "kernels = omega.T, biases = beta",
    )
    np.random.seed(3)
    n, d = 3, 4
    all_x = [np.random.normal(size=(d, 1)) for _ in range(n)]
    np.random.seed(0)
    omega = {k: np.random.normal(size=(d, d)) for k in ("query", "key", "value")}
    beta = {k: np.random.normal(size=(d, 1)) for k in ("query", "key", "value")}
    x = np.concatenate(all_x, axis=1).T.astype("float32")  # rows are the x_n
    kernels = {}
    for name in ("query", "key", "value"):
        kernels[f"{name}_kernel"] = omega[name].T
        kernels[f"{name}_bias"] = beta[name][:, 0]
    layer = loaded_layer(x, kernels, key_dim=4, use_bias=True, scale=1.0)
    show("002.inputs", "all_x (np.random.seed(3)), one row per input", x)
    output, weights = run(layer, x)
    for i in range(n):
        show(f"002.attention_{i}", f"Attentions for output {i}", weights[i])
    for i in range(n):
        show(f"002.x_prime_{i}", f"x_prime_{i}_calculated", output[i])


def notebook_003() -> None:
    header(
        "003: numpy, three words with 2-d projections; the output step was a TODO",
        "key_dim=2",
        "default scale = 1/sqrt(2)",
    )
    combined = np.array(
        [[0.3, 0.8, -0.3], [-0.9, -0.1, 0.0], [1.0, -0.2, 0.3]], dtype="float32"
    )
    kernels = {
        "query_kernel": np.array([[0.27, 0.14], [0.24, 0.09], [0.56, 0.84]]),
        "key_kernel": np.array([[0.1, 0.69], [0.38, 0.63], [0.91, 0.01]]),
        "value_kernel": np.array([[0.81, 0.8], [0.67, 0.98], [0.04, 0.3]]),
    }
    layer = loaded_layer(combined, kernels, key_dim=2)
    proj = projections(layer, combined)
    show("003.queries", "queries", proj["query"])
    show("003.keys", "keys", proj["key"])
    show("003.scores", "np.matmul(queries, keys.T)", proj["scores"])
    output, weights = run(layer, combined)
    show("003.weights", "the TODO, step 1: softmax(Q K^T / sqrt(2))", weights)
    show("003.output", "the TODO, step 2: the scaled output (weights @ V)", output)


def notebook_004() -> None:
    header("004: PyTorch and TensorFlow, unscaled", "key_dim=3, scale=1.0")
    layer = loaded_layer(X_ABC, KERNELS_ABC, key_dim=3, scale=1.0)
    proj = projections(layer, X_ABC)
    show("004.keys", "Keys", proj["key"])
    show("004.querys", "Querys", proj["query"])
    show("004.values", "Values", proj["value"])
    show("004.scores", "attn_scores", proj["scores"])
    output, weights = run(layer, X_ABC)
    show("004.weights", "attn_scores_softmax", weights)
    rounded = np.array([[0.0, 0.5, 0.5], [0.0, 1.0, 0.0], [0.0, 0.9, 0.1]])
    show(
        "004.rounded_outputs",
        "outputs with the notebook's hand-rounded weights (rounded @ layer V)",
        (rounded @ proj["value"]).astype("float32"),
    )
    show("004.outputs", "outputs with the exact weights (the layer's output)", output)


def main() -> None:
    args = _common.parse_args(__doc__.splitlines()[0])
    np.set_printoptions(precision=8, linewidth=120)
    for notebook in (
        notebook_000,
        notebook_001,
        notebook_002,
        notebook_003,
        notebook_004,
    ):
        notebook()
    path = args.out / "seeds_walkthrough.json"
    text = json.dumps(RESULTS, indent=1)
    _common.write_replacing(path, lambda tmp: tmp.write_text(text))
    print(f"\nAll printed matrices: {path}")


if __name__ == "__main__":
    main()
