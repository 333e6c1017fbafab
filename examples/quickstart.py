"""Quick start: train, compare, save, export, verify and plot a SelfAttention model.

The data are scikit-learn's bundled handwritten digits (1797 images, no
download): each 8x8 image is read as a sequence of 8 rows of 8 pixels. The
model embeds each row with one shared projection, adds a learned per-row
position vector (attention alone is blind to order), lets the rows attend to
each other (residual + LayerNorm), averages the rows and classifies them with
a small MLP. The baseline is the same model with the SelfAttention layer
replaced by a Dense layer of the same width: same seed, split, epochs and
optimizer, so the gap in held-out accuracy is the attention layer's
contribution. Without attention the rows never see each other before being
averaged, so the average keeps little of which pixel was in which row;
attention mixes the rows with weights that depend on their content and
position before the average.

It then saves the .keras file, exports a SavedModel in TF Serving's layout
(a new version folder on every run) and an ONNX file, checks both against
Keras with `keras_selfattn.export.verify`, draws the attention weights of a
few test digits, writes a ready-to-send REST request, and prints the commands
to serve and query the export.

Run: `.venv/bin/python examples/quickstart.py [--fast] [--out DIR]`
(`make demo` runs it with the defaults; files go to artifacts/).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import _common
import keras
import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

from keras_selfattn import SelfAttention
from keras_selfattn.export import export_onnx, export_saved_model, verify
from keras_selfattn.serving.model_config import (
    LOCAL_CONFIG_FILE_NAME,
    write_models_config,
)
from keras_selfattn.serving.rest_client import build_rest_request

SEED = 0
ROWS = 8  # an 8x8 digit is a sequence of 8 rows ...
PIXELS = 8  # ... of 8 pixels each
WIDTH = 64
HEADS = 4
MODEL_NAME = "digits"
REPO = Path(__file__).resolve().parent.parent


def load_data(fast: bool) -> tuple[np.ndarray, ...]:
    """Digits scaled to [0, 1]: x (n, 8, 8) float32, y (n,) int32, fixed split.

    In fast mode the training set is cut to 300 images (the test set stays).
    """
    digits = load_digits()
    x = (digits.images / 16.0).astype("float32")
    y = digits.target.astype("int32")
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=0.25, random_state=SEED, stratify=y
    )
    if fast:
        x_train, y_train = x_train[:300], y_train[:300]
    return x_train, x_test, y_train, y_test


def build_model(attention: bool) -> tuple[keras.Model, keras.Model | None]:
    """The classifier and, with attention, a probe returning its weights.

    Args:
        attention: True for SelfAttention, False for the baseline, where a
            Dense layer of the same width takes its place.

    Returns:
        (classifier, probe): the probe maps the same input to the attention
        weights `(batch, heads, 8, 8)`; None for the baseline.
    """
    keras.utils.set_random_seed(SEED)
    rows = keras.Input((ROWS, PIXELS), name="rows")
    # Row embedding shared by all rows, plus a learned bias per (row, unit):
    # a learned position embedding, so the model knows which row is which.
    h = keras.layers.EinsumDense(
        "btf,fd->btd", output_shape=(ROWS, WIDTH), bias_axes="td", name="embed"
    )(rows)
    weights = None
    if attention:
        mixed, weights = SelfAttention(
            num_heads=HEADS, output_dim=WIDTH, name="attention"
        )(h, return_attention_scores=True)
    else:
        mixed = keras.layers.Dense(WIDTH, name="attention_replaced_by_dense")(h)
    h = keras.layers.LayerNormalization(name="norm")(keras.layers.Add()([h, mixed]))
    h = keras.layers.GlobalAveragePooling1D(name="mean_over_rows")(h)
    h = keras.layers.Dense(2 * WIDTH, activation="relu", name="hidden")(h)
    digit = keras.layers.Dense(10, activation="softmax", name="digit")(h)
    name = "digits_attention" if attention else "digits_baseline"
    classifier = keras.Model(rows, digit, name=name)
    classifier.compile(
        keras.optimizers.Adam(2e-3),
        "sparse_categorical_crossentropy",
        metrics=["accuracy"],
        # XLA compilation costs more than it saves for a model this small.
        jit_compile=False,
    )
    probe = None if weights is None else keras.Model(rows, weights, name="probe")
    return classifier, probe


def train(
    attention: bool, data, epochs: int
) -> tuple[keras.Model, keras.Model | None, float]:
    """Builds and fits one model; returns (model, probe, held-out accuracy)."""
    x_train, x_test, y_train, y_test = data
    model, probe = build_model(attention)
    model.fit(x_train, y_train, epochs=epochs, batch_size=32, verbose=1)
    _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    return model, probe, float(accuracy)


def plot_attention(probe, model, x, y, path: Path, count: int = 4) -> Path:
    """Each of the first `count` test digits above its attention weights.

    The weights are averaged over the heads; row i of a heatmap is how much
    image row i attends to each row of the same image.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    weights = np.asarray(probe.predict(x[:count], verbose=0)).mean(axis=1)
    predicted = np.argmax(model.predict(x[:count], verbose=0), axis=-1)
    fig, axes = plt.subplots(
        2, count, figsize=(3.0 * count + 1.0, 6.4), layout="constrained"
    )
    rows = np.arange(ROWS)
    for i in range(count):
        axes[0, i].imshow(x[i], cmap="gray_r", vmin=0.0, vmax=1.0)
        axes[0, i].set_title(f"true {y[i]}, predicted {predicted[i]}")
        axes[0, i].set_yticks(rows)
        axes[0, i].set_ylabel("image row")
        axes[0, i].set_xticks([])
        image = axes[1, i].imshow(
            weights[i], cmap="viridis", vmin=0.0, vmax=float(weights.max())
        )
        axes[1, i].set_xticks(rows)
        axes[1, i].set_yticks(rows)
        axes[1, i].set_xlabel("key row")
        axes[1, i].set_ylabel("query row")
    fig.colorbar(image, ax=axes[1].tolist(), shrink=0.9, label="attention weight")
    fig.suptitle(f"SelfAttention weights (mean of {HEADS} heads) on test digits")
    _common.write_replacing(path, lambda tmp: fig.savefig(tmp, dpi=100))
    plt.close(fig)
    return path


def section(title: str) -> None:
    print(f"\n=== {title}", flush=True)


def main() -> None:
    args = _common.parse_args(
        __doc__.splitlines()[0],
        fast_help="train on 300 images for 2 epochs (for tests; accuracy is low)",
    )
    start = time.perf_counter()
    out: Path = args.out
    epochs = 2 if args.fast else 40
    data = load_data(args.fast)
    x_test, y_test = data[1], data[3]
    print(
        f"digits: {len(data[0])} training and {len(x_test)} test images, "
        f"each {ROWS} rows x {PIXELS} pixels; {epochs} epochs per model"
    )

    section("training the SelfAttention model")
    model, probe, accuracy = train(True, data, epochs)
    section("training the baseline (SelfAttention replaced by Dense)")
    _, _, baseline_accuracy = train(False, data, epochs)
    section("held-out accuracy")
    print(f"  with SelfAttention     : {accuracy:.4f}")
    print(f"  baseline, no attention : {baseline_accuracy:.4f}")
    print(
        f"  difference             : {accuracy - baseline_accuracy:+.4f} "
        f"({len(x_test)} test images, seed {SEED})"
    )

    section("saving and exporting")
    keras_path = out / "digits.keras"
    _common.write_replacing(keras_path, model.save)
    print(f"Keras model  : {keras_path}")
    serving_dir = out / "serving"
    version_dir = Path(
        export_saved_model(model, serving_dir, MODEL_NAME, version=None, warmup=True)
    )
    write_models_config(serving_dir, [MODEL_NAME], None, LOCAL_CONFIG_FILE_NAME)
    print(f"SavedModel   : {version_dir}  (TF Serving layout, with warmup requests)")
    # export_onnx never overwrites: the new file (exported and checked in
    # onnxruntime) replaces the previous run's once complete.
    onnx_path = _common.write_replacing(
        out / "digits.onnx", lambda tmp: export_onnx(model, tmp)
    )
    print(f"ONNX         : {onnx_path}")

    section("verify: each runtime against Keras")
    # The input is fixed at 8 rows, so only the batch size varies.
    report = verify(
        model,
        saved_model_dir=version_dir,
        onnx_path=onnx_path,
        shapes=[(1, ROWS), (33, ROWS), (512, ROWS)],
    )
    print(report.table())

    section("attention weights")
    png = plot_attention(probe, model, x_test, y_test, out / "attention_digits.png")
    print(f"4 test digits above their attention weights: {png}")
    samples = x_test[:2]
    request = out / "request.json"
    body = json.dumps(build_rest_request({"rows": samples}))
    _common.write_replacing(request, lambda tmp: tmp.write_text(body))
    query_inputs = out / "query_inputs.json"
    rows = json.dumps({"rows": samples.tolist()})
    _common.write_replacing(query_inputs, lambda tmp: tmp.write_text(rows))
    expected = np.argmax(model.predict(samples, verbose=0), axis=-1)
    print(
        f"2 test digits for the server (Keras predicts {expected.tolist()}, "
        f"true {y_test[:2].tolist()}): {request} (REST body), "
        f"{query_inputs} (query.py)"
    )
    print_next_steps(out, serving_dir, request, query_inputs)
    print(f"\nquickstart finished in {time.perf_counter() - start:.0f} s")


def print_next_steps(
    out: Path, serving_dir: Path, request: Path, query_inputs: Path
) -> None:
    """Prints the commands that serve the export and query it."""
    query = f"{sys.executable} {REPO / 'export' / 'serving' / 'query.py'}"
    section("next: serve the SavedModel with TF Serving (not installable by pip)")
    print(
        "Docker (serves the highest version; REST on 8501, gRPC on 8500):\n"
        f"  docker run --rm -p 8501:8501 -p 8500:8500 -v {serving_dir}:/models \\\n"
        "    tensorflow/serving --model_config_file=/models/models.config \\\n"
        "    --enable_model_warmup=true\n"
        "or a local tensorflow_model_server binary:\n"
        "  tensorflow_model_server --port=8500 --rest_api_port=8501 \\\n"
        f"    --model_config_file={serving_dir / LOCAL_CONFIG_FILE_NAME} \\\n"
        "    --enable_model_warmup=true"
    )
    section("next: query it")
    url = f"http://localhost:8501/v1/models/{MODEL_NAME}"
    print(
        f"  curl {url}/metadata\n"
        f"  curl -X POST {url}:predict -d @{request}\n"
        f"  {query} {query_inputs} --model {MODEL_NAME}\n"
        f"  {query} {query_inputs} --model {MODEL_NAME} --grpc localhost:8500"
    )
    section(f"files in {out}")
    for path in sorted(out.iterdir()):
        if not path.name.startswith("."):
            print(f"  {path.name}{'/' if path.is_dir() else ''}")


if __name__ == "__main__":
    main()
