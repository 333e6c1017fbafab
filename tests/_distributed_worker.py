"""Training under tf.distribute for tests/test_distributed.py.

Imported by the test (model, data, initial weights, single-device training)
and run as a script in subprocesses, because the device layout and the
multi-worker cluster must be set before TensorFlow initializes:

    python tests/_distributed_worker.py mirrored OUT.npz
    python tests/_distributed_worker.py multiworker OUT_DIR   # TF_CONFIG set

Both write the trained weights as OUT.npz (`w0`, `w1`, ...); the multi-worker
chief also saves the model as OUT_DIR/model.keras.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import numpy as np  # noqa: E402

GLOBAL_BATCH = 8
STEPS = 4
VOCAB = 20
TIME = 6
LEARNING_RATE = 0.1


def data() -> tuple[np.ndarray, np.ndarray]:
    """Token ids (0 = padding, ragged lengths) and regression targets."""
    rng = np.random.default_rng(7)
    tokens = rng.integers(1, VOCAB, size=(GLOBAL_BATCH * STEPS, TIME))
    lengths = rng.integers(1, TIME + 1, size=len(tokens))
    tokens[np.arange(TIME)[None, :] >= lengths[:, None]] = 0
    targets = rng.normal(size=(len(tokens), 1))
    return tokens.astype("int32"), targets.astype("float32")


def build_model():
    """Embedding (masking) -> SelfAttention -> pooling -> Dense, fixed weights."""
    import keras

    from keras_selfattn import SelfAttention

    inputs = keras.Input((None,), dtype="int32", name="tokens")
    x = keras.layers.Embedding(VOCAB, 8, mask_zero=True)(inputs)
    x = SelfAttention(num_heads=2, output_dim=8, use_bias=True, name="attention")(x)
    x = keras.layers.GlobalAveragePooling1D()(x)
    model = keras.Model(inputs, keras.layers.Dense(1, name="score")(x))
    rng = np.random.default_rng(0)
    model.set_weights(
        [rng.normal(scale=0.3, size=w.shape).astype("float32") for w in model.weights]
    )
    model.compile(optimizer=keras.optimizers.SGD(LEARNING_RATE), loss="mse")
    return model


def dataset():
    """The data in global batches, in order, sharded by element across workers."""
    import tensorflow as tf

    tokens, targets = data()
    ds = tf.data.Dataset.from_tensor_slices((tokens, targets)).batch(GLOBAL_BATCH)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = (
        tf.data.experimental.AutoShardPolicy.DATA
    )
    return ds.with_options(options)


def train(model) -> list[np.ndarray]:
    """STEPS SGD steps over the fixed data, no shuffling; returns the weights."""
    model.fit(dataset(), epochs=1, shuffle=False, verbose=0)
    return [np.asarray(w) for w in model.get_weights()]


def _save_weights(path: str, weights: list[np.ndarray]) -> None:
    np.savez(path, **{f"w{i}": w for i, w in enumerate(weights)})


def _mirrored(out: str) -> None:
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * 2
    )
    devices = [d.name for d in tf.config.list_logical_devices("CPU")]
    strategy = tf.distribute.MirroredStrategy(devices)
    assert strategy.num_replicas_in_sync == 2, devices
    with strategy.scope():
        model = build_model()
    _save_weights(out, train(model))


def train_custom_loop(model, strategy) -> list[np.ndarray]:
    """The same SGD steps as `train`, as a custom loop under `strategy`.

    Keras 3's `fit` fails under MultiWorkerMirroredStrategy (it all-reduces
    a data batch while building; keras-team/keras#20585), so multi-worker
    training uses `strategy.run` with the model's own optimizer, which sums
    the replicas' gradients; each replica's loss is divided by the global
    batch, so the step equals one step of `fit` on the whole batch.
    """
    import tensorflow as tf

    with strategy.scope():
        model.optimizer.build(model.trainable_variables)

    def step(tokens, targets):
        with tf.GradientTape() as tape:
            predictions = model(tokens, training=True)
            per_example = tf.reduce_mean(tf.square(predictions - targets), axis=-1)
            loss = tf.nn.compute_average_loss(
                per_example, global_batch_size=GLOBAL_BATCH
            )
        grads = tape.gradient(loss, model.trainable_variables)
        model.optimizer.apply_gradients(
            zip(grads, model.trainable_variables, strict=True)
        )

    @tf.function
    def distributed_step(tokens, targets):
        strategy.run(step, args=(tokens, targets))

    for tokens, targets in strategy.experimental_distribute_dataset(dataset()):
        distributed_step(tokens, targets)
    return [np.asarray(w) for w in model.get_weights()]


def _multiworker(out_dir: str) -> None:
    import json

    import tensorflow as tf

    task = json.loads(os.environ["TF_CONFIG"])["task"]
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    assert strategy.num_replicas_in_sync == 2
    with strategy.scope():
        model = build_model()
    weights = train_custom_loop(model, strategy)
    _save_weights(os.path.join(out_dir, f"weights_{task['index']}.npz"), weights)
    if task["index"] == 0:  # the chief saves the model
        model.save(os.path.join(out_dir, "model.keras"))


if __name__ == "__main__":
    mode, target = sys.argv[1], sys.argv[2]
    {"mirrored": _mirrored, "multiworker": _multiworker}[mode](target)
