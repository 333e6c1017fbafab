"""The SelfAttention / MultiHeadAttention pair every benchmark compares.

One pair builder (`build_layer`), one FLOP count (`forward_flops`), one
memory estimate (`estimated_bytes`), the rows of `python -m
benchmarks.backends` and their inputs. Backend-agnostic: numpy
and Keras only, never TensorFlow, so the backends benchmark runs on a machine
with only keras + jax or keras + torch.

Both layers get the same weights: MultiHeadAttention's are drawn at random
(normal, std 1/sqrt(fan_in), biases included) and copied into SelfAttention by
reshape, so both compute the same function and only speed and memory differ.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

import keras
import numpy as np

from keras_selfattn import SelfAttention

MASKS = ("none", "causal", "padding")
DTYPES = ("mixed_bfloat16", "float32")
FLASH = {"auto": None, "on": True, "off": False}
SA, MHA = "self_attention", "mha"


@dataclass(frozen=True)
class Row:
    """One benchmark row: a shape, a mask and the layers' configuration.

    Both layers have `num_heads` heads of size `key_dim`, biases, and an
    output projection to `output_dim` (default: back to `features`, D).

    Attributes:
        name: CLI name (`--shapes NAME`).
        batch, time, features: the input (B, T, D).
        num_heads, key_dim: H and K.
        output_dim: the output projection's size (None: `features`).
        mask: "none", "causal" or "padding" (right-padded Keras mask).
        train: whether the training step is timed too.
        dtypes: the policies this row runs in (None: any).
        rss: peak RSS per layer, each in fresh child processes.
    """

    name: str
    batch: int
    time: int
    features: int = 256
    num_heads: int = 4
    key_dim: int = 64
    output_dim: int | None = None
    mask: str = "none"
    train: bool = True
    dtypes: tuple[str, ...] | None = None
    rss: bool = False

    @property
    def label(self) -> str:
        """Like B8·T512, with the mask if any and D when it is not 256."""
        text = f"B{self.batch}·T{self.time}"
        if self.features != 256:
            text += f"·D{self.features}"
        return text if self.mask == "none" else f"{text} {self.mask}"

    @property
    def output_size(self) -> int:
        """The output projection's size."""
        return self.features if self.output_dim is None else self.output_dim

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Row:
        fields = dict(data)
        if fields.get("dtypes") is not None:
            fields["dtypes"] = tuple(fields["dtypes"])
        return cls(**fields)


# The GPU table: D = 256, 4 heads x key_dim 64.
GPU_ROWS = (
    Row("b8-t512", 8, 512),
    Row("b4-t2048", 4, 2048),
    Row("b1-t8192", 1, 8192),
    Row("b1-t16384-causal", 1, 16384, mask="causal"),
    Row("b4-t2048-padding", 4, 2048, mask="padding"),
)
# The CPU figures: torch, B1 T8192, D = 64, 4 heads (key_dim 16 =
# D / H), float32 forward, peak RSS of each layer in its own processes.
CPU_ROWS = (
    Row(
        "cpu-t8192",
        1,
        8192,
        features=64,
        key_dim=16,
        train=False,
        dtypes=("float32",),
        rss=True,
    ),
)
# Smoke rows (seconds on a CPU): every mask, both policies, the training
# step and the peak-RSS children run at least once.
_TINY = {"batch": 2, "time": 16, "features": 32, "num_heads": 2, "key_dim": 16}
TINY_ROWS = (
    Row("tiny-none", **_TINY),
    Row("tiny-causal", **_TINY, mask="causal", dtypes=("float32",)),
    Row("tiny-padding", **_TINY, mask="padding", dtypes=("mixed_bfloat16",)),
    Row(
        "tiny-rss",
        **{**_TINY, "batch": 1, "time": 64},
        train=False,
        dtypes=("float32",),
        rss=True,
    ),
)
PRESETS = {row.name: row for row in GPU_ROWS + CPU_ROWS + TINY_ROWS}
GROUPS = {
    "gpu": [row.name for row in GPU_ROWS],
    "tiny": [row.name for row in TINY_ROWS],
}


def select_rows(names: list[str]) -> list[Row]:
    """Rows for `--shapes` names (row names or the groups "gpu", "tiny")."""
    rows: list[Row] = []
    for name in names:
        for row_name in GROUPS.get(name, [name]):
            if row_name not in PRESETS:
                choices = sorted(PRESETS) + sorted(GROUPS)
                raise ValueError(f"Unknown shape {row_name!r}; choose from {choices}")
            if PRESETS[row_name] not in rows:
                rows.append(PRESETS[row_name])
    return rows


def forward_flops(row: Row) -> int:
    """FLOPs (2 per multiply-add) of one forward pass, every benchmark's count.

    Projections: Q, K, V (2·B·T·D·H·K each) and output (2·B·T·H·K·O).
    Attention: Q K^T and weights x V, 4·B·H·T²·K. Causal and padding masks
    are counted in full: the dense work a kernel that skips no masked block
    does, so GFLOP/s of different masks, rows and benchmarks compare (a
    kernel that skips the masked half of causal attention shows up as a
    higher rate). Softmax, masks and biases are not counted.
    """
    b, t, d = row.batch, row.time, row.features
    h, k = row.num_heads, row.key_dim
    projections = 2 * b * t * h * k * (3 * d + row.output_size)
    attention = 4 * b * h * t * t * k
    return projections + attention


def train_flops(row: Row) -> int:
    """Forward + backward, taken as 3x the forward (backward = 2x)."""
    return 3 * forward_flops(row)


# The benchmarks' one memory estimate (`estimated_bytes`), in float32 tensors
# of the attention scores' shape (B, H, queries at once, T) held at the peak
# of one call: the largest count measured on CPU (growth of VmHWM over one
# call in a fresh process, `pairs` layers, float32, every mask, each backend,
# with and without `chunk_size`), forward and training step (forward +
# gradients) apart, with at least 5 % to spare. Fused kernels (PyTorch's
# scaled_dot_product_attention, which both layers take by default there) hold
# no such tensor: the estimate ignores them, so it bounds the layer on
# whichever path it takes.
PEAK_SCORE_COPIES = {"forward": 3.25, "train": 8.5}
FLOAT32_BYTES = 4


def estimated_bytes(
    batch: int,
    time: int,
    num_heads: int,
    *,
    train: bool = False,
    chunk_size: int | None = None,
) -> int:
    """Estimated peak bytes of one attention call's score-shaped tensors.

    The one memory estimate of the benchmarks: `subprocesses` (peak-RSS and
    speed children of `benchmarks.cpu`) and `backends` (rows on a CPU) ask it
    whether a case fits in the available memory (`subprocesses.refusal`)
    before starting it, rather than let the kernel's OOM killer pick a
    process. It counts only what grows with T²: PEAK_SCORE_COPIES float32
    tensors of shape (B, H, Q, T) (scores, masked scores, weights, and in
    training their gradients), Q = T, or the query block (`chunk_size`) when
    the layer computes attention a block at a time. The process itself, the
    weights and the activations are left to the caller's margin.

    Args:
        batch, time, num_heads: B, T and H of the call.
        train: a training step (forward + gradients) instead of a forward.
        chunk_size: SelfAttention's `chunk_size` (queries per block), if set.

    Returns:
        Bytes, rounded down.
    """
    queries = time if chunk_size is None else min(chunk_size, time)
    copies = PEAK_SCORE_COPIES["train" if train else "forward"]
    return int(copies * batch * num_heads * queries * time * FLOAT32_BYTES)


def mha_weights(row: Row, seed: int = 0) -> list[np.ndarray]:
    """MultiHeadAttention's weights, in its get_weights() order, at random.

    query/key/value kernel (D, H, K) and bias (H, K), output kernel (H, K, D)
    and bias (D,); normal with std 1/sqrt(fan_in), biases included, so the
    projections differ and the biases matter.
    """
    d, h, k, o = row.features, row.num_heads, row.key_dim, row.output_size
    rng = np.random.default_rng(seed)
    weights = []
    for _ in ("query", "key", "value"):
        weights.append(rng.normal(0.0, d**-0.5, (d, h, k)))
        weights.append(rng.normal(0.0, d**-0.5, (h, k)))
    weights.append(rng.normal(0.0, (h * k) ** -0.5, (h, k, o)))
    weights.append(rng.normal(0.0, (h * k) ** -0.5, (o,)))
    return [w.astype("float32") for w in weights]


def to_self_attention(weights: list[np.ndarray], row: Row) -> list[np.ndarray]:
    """MultiHeadAttention's weights reshaped to SelfAttention's.

    SelfAttention's get_weights() order is query_kernel (D, H*K), query_bias
    (H*K,), key..., value..., output_kernel (H*K, D), output_bias (D,); head
    h uses columns [h*K:(h+1)*K], which is MultiHeadAttention's (D, H, K)
    kernel flattened row-major.
    """
    d, hk, o = row.features, row.num_heads * row.key_dim, row.output_size
    shapes = [(d, hk), (hk,)] * 3 + [(hk, o), (o,)]
    return [w.reshape(shape) for w, shape in zip(weights, shapes, strict=True)]


def flash_kwargs(flash: str) -> dict:
    """`flash_attention=` for both layers: nothing for "auto"."""
    if flash not in FLASH:
        raise ValueError(f"flash must be one of {sorted(FLASH)}: {flash!r}")
    return {} if flash == "auto" else {"flash_attention": FLASH[flash]}


def build_layer(
    kind: str,
    row: Row,
    dtype: str = "float32",
    flash: str = "auto",
    seed: int = 0,
    **options,
) -> keras.layers.Layer:
    """SelfAttention (`kind` SA) or MultiHeadAttention (MHA), built, same weights.

    `flash` ("auto", "on", "off") is passed as `flash_attention` to both;
    "auto" passes nothing. Note: Keras 3.15's MultiHeadAttention stores
    `flash_attention or is_flash_attention_enabled()`, so its False means auto.
    `options` go to SelfAttention only (e.g. `chunk_size`); `causal` is the
    row's mask.
    """
    weights = mha_weights(row, seed)
    full = (None, None, row.features)
    if kind == MHA:
        layer = keras.layers.MultiHeadAttention(
            num_heads=row.num_heads,
            key_dim=row.key_dim,
            output_shape=row.output_size,
            use_bias=True,
            dtype=dtype,
            **flash_kwargs(flash),
        )
        layer.build(full, full)
        layer.set_weights(weights)
        return layer
    if kind != SA:
        raise ValueError(f"kind must be {SA!r} or {MHA!r}: {kind!r}")
    layer = SelfAttention(
        num_heads=row.num_heads,
        key_dim=row.key_dim,
        output_dim=row.output_size,
        use_bias=True,
        causal=row.mask == "causal",
        dtype=dtype,
        **flash_kwargs(flash),
        **options,
    )
    layer.build(full)
    layer.set_weights(to_self_attention(weights, row))
    return layer


def apply_fn(kind: str, row: Row) -> Callable:
    """`apply(layer, x, mask)`: the layer's __call__ with the row's mask.

    Causal: SelfAttention(causal=True) vs mha(x, x, use_causal_mask=True).
    Padding: the (B, T) bool Keras mask as SelfAttention's `mask` and as
    MultiHeadAttention's query_mask and value_mask (what Keras' mask
    propagation gives it; Keras 3.15 reads the query mask from the tensor, so
    the effective mask is on the keys). Padded keys get no weight in both;
    only real query positions are compared (SelfAttention zeroes padded
    positions, MultiHeadAttention does not).
    """
    causal = row.mask == "causal"
    if kind == SA:
        return lambda layer, x, mask: layer(x, mask=mask)

    def apply(layer, x, mask):
        return layer(x, x, query_mask=mask, value_mask=mask, use_causal_mask=causal)

    return apply


def inputs(row: Row, time: int | None = None, seed: int = 1):
    """(x float32 (B, T, D), mask (B, T) bool or None) as numpy arrays.

    `time` replaces the row's T (a short warm-up call). The padding mask is
    right-padded: lengths from T/2 to T, the first sequence full.
    """
    b = row.batch
    t = row.time if time is None else time
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(b, t, row.features)).astype("float32")
    if row.mask != "padding":
        return x, None
    return x, padding_mask(b, t, rng)


def padding_mask(batch: int, time: int, rng: np.random.Generator) -> np.ndarray:
    """(batch, time) bool, True for real tokens: right-padded, lengths from
    time/2 to time, the first sequence full."""
    lengths = rng.integers(max(1, time // 2), time + 1, batch)
    lengths[0] = time
    return np.arange(time)[None, :] < lengths[:, None]


def max_difference(ours: np.ndarray, theirs: np.ndarray, mask) -> float:
    """Largest |ours - theirs| over real (unpadded) positions."""
    difference = np.abs(ours.astype("float64") - theirs.astype("float64"))
    if mask is not None:
        difference = np.where(np.asarray(mask)[..., None], difference, 0.0)
    return float(np.max(difference))
