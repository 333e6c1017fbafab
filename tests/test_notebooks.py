"""The five reference notebooks' printed numbers, reproduced through the layer.

Every expected array below is copied from a notebook's printed output in
../shared/seeds/, not computed with the package.
"""

import numpy as np
import pytest

from keras_selfattn import SelfAttention
from tests.backend import to_numpy

# The whole module runs once per attention path (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("every_path")

# Notebooks 000, 001 and 004 share these inputs and weights.
X = np.array([[1, 0, 1, 0], [0, 2, 0, 2], [1, 1, 1, 1]], dtype="float32")
W_KEY = np.array([[0, 0, 1], [1, 1, 0], [0, 1, 0], [1, 1, 0]], dtype="float32")
W_QUERY = np.array([[1, 0, 1], [1, 0, 0], [0, 0, 1], [0, 1, 1]], dtype="float32")
W_VALUE = np.array([[0, 2, 0], [0, 3, 0], [1, 0, 3], [1, 1, 0]], dtype="float32")
# Printed by 000 (value_representations), 001 (V) and 004 (Values).
PRINTED_VALUES = np.array([[1, 2, 3], [2, 8, 0], [2, 6, 3]], dtype="float64")


def _layer(x, weights, **kwargs):
    layer = SelfAttention(**kwargs)
    layer.build(x.shape)
    layer.set_weights(weights)
    output, attention = layer(x, return_attention_scores=True)
    return to_numpy(output), to_numpy(attention)


def test_notebook_000_scaled_output():
    # In [9]: softmax(Q K^T / sqrt(3)) V (the notebook divides by sqrt(#tokens),
    # which equals d_k = 3 here, so the layer's default scale reproduces it).
    printed = np.array(
        [
            [1.8638741, 6.3193707, 1.7041886],
            [1.9991105, 7.8141265, 0.27347228],
            [1.9925548, 7.479635, 0.73587704],
        ]
    )
    output, _ = _layer(X[None], [W_QUERY, W_KEY, W_VALUE], key_dim=3)
    np.testing.assert_allclose(output[0], printed, rtol=2e-6, atol=2e-6)


# Printed by 001 (In [40]) and, to fewer digits, by 004 (PyTorch, TensorFlow).
UNSCALED_WEIGHTS_001 = np.array(
    [
        [6.33789383e-02, 4.68310531e-01, 4.68310531e-01],
        [6.03366485e-06, 9.82007865e-01, 1.79861014e-02],
        [2.95387223e-04, 8.80536902e-01, 1.19167711e-01],
    ]
)
UNSCALED_WEIGHTS_004_TF = np.array(
    [
        [6.3378938e-02, 4.6831051e-01, 4.6831051e-01],
        [6.0336647e-06, 9.8200780e-01, 1.7986100e-02],
        [2.9538720e-04, 8.8053685e-01, 1.1916770e-01],
    ]
)


@pytest.mark.parametrize(
    "printed_weights",
    [UNSCALED_WEIGHTS_001, UNSCALED_WEIGHTS_004_TF],
    ids=["001", "004"],
)
def test_notebooks_001_004_unscaled_weights_and_output(printed_weights):
    output, attention = _layer(X[None], [W_QUERY, W_KEY, W_VALUE], key_dim=3, scale=1.0)
    np.testing.assert_allclose(attention[0, 0], printed_weights, rtol=2e-6, atol=1e-9)
    # The exact math: output = weights @ V, from the notebooks' printed numbers.
    # (001's last cell sums within rows and 004 hand-rounds the weights to
    # [[0, .5, .5], ...] "for readability": both are the notebooks' shortcuts,
    # so the exact equation is what is tested here.)
    np.testing.assert_allclose(
        output[0], printed_weights @ PRINTED_VALUES, rtol=2e-6, atol=1e-6
    )


def test_notebook_001_weighted_values_of_first_query():
    # In [46] prints weight(query 1, key i) * V[i] for each key i; the first
    # output row is their sum over keys.
    printed = np.array(
        [
            [0.06337894, 0.12675788, 0.19013681],
            [0.93662106, 3.74648425, 0.0],
            [0.93662106, 2.80986319, 1.40493159],
        ]
    )
    output, _ = _layer(X[None], [W_QUERY, W_KEY, W_VALUE], key_dim=3, scale=1.0)
    np.testing.assert_allclose(output[0, 0], printed.sum(axis=0), rtol=2e-6)


def test_notebook_002_biases_column_vectors():
    # Rebuild the notebook's inputs and parameters with its own seeding.
    n, d = 3, 4
    np.random.seed(3)
    all_x = [np.random.normal(size=(d, 1)) for _ in range(n)]
    np.random.seed(0)
    omega_q, omega_k, omega_v = (np.random.normal(size=(d, d)) for _ in range(3))
    beta_q, beta_k, beta_v = (np.random.normal(size=(d, 1)) for _ in range(3))
    # Printed inputs (In [5]) confirm the seeding.
    np.testing.assert_allclose(
        all_x[0].ravel(), [1.78862847, 0.43650985, 0.09649747, -1.8634927]
    )

    # Column-vector convention: query = beta_q + omega_q @ x, so the layer's
    # row-vector kernel is omega_q transposed.
    x = np.stack([v.ravel() for v in all_x])[None].astype("float32")
    weights = [
        omega_q.T,
        beta_q.ravel(),
        omega_k.T,
        beta_k.ravel(),
        omega_v.T,
        beta_v.ravel(),
    ]
    output, attention = _layer(
        x, [w.astype("float32") for w in weights], use_bias=True, scale=1.0
    )
    printed_attention = np.array(
        [
            [1.24326146e-13, 9.98281489e-01, 1.71851130e-03],
            [2.79525306e-12, 5.85506360e-03, 9.94144936e-01],
            [0.00505708, 0.00654776, 0.98839516],
        ]
    )
    printed_true = np.array(
        [
            [0.94744244, -0.24348429, -0.91310441, -0.44522983],
            [1.64201168, -0.08470004, 4.02764044, 2.18690791],
            [1.61949281, -0.06641533, 3.96863308, 2.15858316],
        ]
    )
    np.testing.assert_allclose(attention[0, 0], printed_attention, atol=2e-6)
    np.testing.assert_allclose(output[0], printed_true, atol=2e-5)


def test_notebook_003_queries_keys_scores_and_scaled_output():
    tokens = np.array(
        [[0.3, 0.8, -0.3], [-0.9, -0.1, 0.0], [1.0, -0.2, 0.3]], dtype="float32"
    )
    wq = np.array([[0.27, 0.14], [0.24, 0.09], [0.56, 0.84]], dtype="float32")
    wk = np.array([[0.1, 0.69], [0.38, 0.63], [0.91, 0.01]], dtype="float32")
    wv = np.array([[0.81, 0.8], [0.67, 0.98], [0.04, 0.3]], dtype="float32")
    printed_queries = np.array([[0.105, -0.138], [-0.267, -0.135], [0.39, 0.374]])
    printed_keys = np.array([[0.061, 0.708], [-0.128, -0.684], [0.297, 0.567]])
    printed_scores = np.array(
        [
            [-0.091299, 0.080952, -0.047061],
            [-0.111867, 0.126516, -0.155844],
            [0.288582, -0.305736, 0.327888],
        ]
    )

    # Queries and keys: with the value kernel set to Wq (or Wk) and every
    # weight 1 on a single token (time 1), the output is that token's query.
    for kernel, printed in ((wq, printed_queries), (wk, printed_keys)):
        for i in range(3):
            out, _ = _layer(tokens[None, i : i + 1], [wq, wk, kernel], key_dim=2)
            np.testing.assert_allclose(out[0, 0], printed[i], atol=1e-6)

    # Raw scores: unscaled weights are softmax of the printed Q K^T.
    _, attention = _layer(tokens[None], [wq, wk, wv], key_dim=2, scale=1.0)
    expected = np.exp(printed_scores)
    expected /= expected.sum(axis=1, keepdims=True)
    np.testing.assert_allclose(attention[0, 0], expected, atol=1e-6)

    # The notebook leaves the output as a TODO: the scaled output, computed
    # independently in numpy from the printed scores.
    weights = np.exp(printed_scores / np.sqrt(2))
    weights /= weights.sum(axis=1, keepdims=True)
    output, _ = _layer(tokens[None], [wq, wk, wv], key_dim=2)
    np.testing.assert_allclose(
        output[0], weights @ (tokens.astype("float64") @ wv), atol=1e-6
    )
