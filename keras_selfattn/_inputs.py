"""The ValueErrors of a SelfAttention call's bad inputs, masks or requests.

The same built or not, symbolic or eager.
"""

from __future__ import annotations

import keras


def check_shape(layer_name: str, input_shape, input_dim: int | None) -> int:
    """Returns the features of `input_shape`, a rank-3 shape whose last size
    is known (and `input_dim` when the layer is built)."""
    input_shape = tuple(input_shape)
    if len(input_shape) != 3:
        raise ValueError(
            f"SelfAttention '{layer_name}' expects `inputs` of rank 3 "
            f"(batch, time, features). Received: inputs.shape={input_shape}"
        )
    if input_shape[-1] is None:
        raise ValueError(
            f"SelfAttention '{layer_name}' needs a known last dimension "
            f"(features). Received: inputs.shape={input_shape}"
        )
    if input_dim is not None and input_shape[-1] != input_dim:
        raise ValueError(
            f"SelfAttention '{layer_name}' was built for features="
            f"{input_dim}. Received: inputs.shape={input_shape}"
        )
    return int(input_shape[-1])


def check(layer_name: str, inputs, input_dim: int | None) -> None:
    """Raises ValueError unless `inputs` is one float tensor of rank 3."""
    if isinstance(inputs, (list, tuple, dict)) or not hasattr(inputs, "shape"):
        received = (
            f"a {type(inputs).__name__} of {len(inputs)} items"
            if isinstance(inputs, (list, tuple, dict))
            else repr(inputs)
        )
        raise ValueError(
            f"SelfAttention '{layer_name}' expects `inputs` to be one float "
            f"tensor of rank 3 (batch, time, features). Received: "
            f"inputs={received}"
        )
    check_shape(layer_name, inputs.shape, input_dim)
    dtype = keras.backend.standardize_dtype(inputs.dtype)
    if not keras.backend.is_float_dtype(dtype):
        raise ValueError(
            f"SelfAttention '{layer_name}' expects float `inputs` (embed "
            f"token ids first, e.g. with keras.layers.Embedding). Received: "
            f"inputs.dtype={dtype}"
        )


def check_masks(
    layer_name: str,
    inputs_shape,
    mask,
    attention_mask,
    *,
    against: str = "inputs.shape",
    time_name: str = "time",
) -> None:
    """Raises ValueError unless `mask` is (batch, time) and `attention_mask`
    (batch, time, time) for the leading sizes of `inputs_shape`, which the
    message calls `against` (and its second size `time_name`)."""
    batch, time = tuple(inputs_shape)[:2]
    for name, value, rank in (
        ("mask", mask, 2),
        ("attention_mask", attention_mask, 3),
    ):
        if value is None:
            continue
        shape = tuple(value.shape)
        expected = (batch,) + (time,) * (rank - 1)
        # Only known sizes are compared: a dynamic size may be None or a
        # symbol of its own (jax2tf gives the mask's time axis one).
        compatible = len(shape) == rank and all(
            not (isinstance(a, int) and isinstance(b, int)) or a == b
            for a, b in zip(shape, expected, strict=False)
        )
        if not compatible:
            wanted = ", ".join(["batch"] + [time_name] * (rank - 1))
            raise ValueError(
                f"SelfAttention '{layer_name}': `{name}` must have shape "
                f"({wanted}) = {expected} to match {against}="
                f"{tuple(inputs_shape)}. Received: {name}.shape={shape}"
            )


def check_decoding_mask(layer_name: str, inputs, max_length, mask) -> None:
    """Raises ValueError unless a decoding call's `mask` (over the whole
    cache) is (batch, max_length), `max_length` the cache's (or None)."""
    if mask is not None:
        check_masks(
            layer_name,
            (tuple(inputs.shape)[0], max_length),
            mask,
            None,
            against="(inputs.shape[0], cache.shape[2])",
            time_name="max_length",
        )


def check_scores_request(layer_name: str, chunk_size, return_scores: bool) -> None:
    """Raises ValueError if a chunked layer is asked for its weights."""
    if return_scores and chunk_size is not None:
        raise ValueError(
            f"SelfAttention '{layer_name}' has chunk_size={chunk_size}, "
            "so it never builds the (batch, heads, time, time) attention "
            "weights and cannot return them. Use a layer with "
            "chunk_size=None (same weights, same outputs) to inspect them. "
            "Received: return_attention_scores=True"
        )
