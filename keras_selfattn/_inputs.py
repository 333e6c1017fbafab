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


def _fits(size, wanted) -> bool:
    """Whether a size fits `wanted` (1 broadcasts; unknown sizes fit)."""
    return not (isinstance(size, int) and isinstance(wanted, int)) or size in (
        1,
        wanted,
    )


def check_score_inputs(
    layer_name: str,
    inputs_shape,
    num_heads: int,
    attention_bias,
    segment_ids,
    key_time=None,
) -> None:
    """Raises ValueError unless `attention_bias` is float and broadcastable
    to (batch, num_heads, time, key_time) and `segment_ids` is int
    (batch, time); `key_time` is `time` unless decoding (the cache's)."""
    batch, time = tuple(inputs_shape)[:2]
    key_time = time if key_time is None else key_time
    if attention_bias is not None:
        shape = tuple(attention_bias.shape)
        dtype = keras.backend.standardize_dtype(attention_bias.dtype)
        wanted = (batch, num_heads, time, key_time)
        if not keras.backend.is_float_dtype(dtype):
            raise ValueError(
                f"SelfAttention '{layer_name}': `attention_bias` must be a "
                f"float tensor. Received: attention_bias.dtype={dtype}"
            )
        if len(shape) != 4 or not all(map(_fits, shape, wanted)):
            raise ValueError(
                f"SelfAttention '{layer_name}': `attention_bias` must be "
                "broadcastable to (batch, num_heads, time, time) = "
                f"{wanted} (each size equal or 1). Received: "
                f"attention_bias.shape={shape}"
            )
    if segment_ids is not None:
        shape = tuple(segment_ids.shape)
        dtype = keras.backend.standardize_dtype(segment_ids.dtype)
        if "int" not in dtype:
            raise ValueError(
                f"SelfAttention '{layer_name}': `segment_ids` must be an "
                "integer tensor (the id of each position's packed sequence). "
                f"Received: segment_ids.dtype={dtype}"
            )
        if len(shape) != 2 or not all(
            not (isinstance(a, int) and isinstance(b, int)) or a == b
            for a, b in zip(shape, (batch, time), strict=True)
        ):
            raise ValueError(
                f"SelfAttention '{layer_name}': `segment_ids` must have shape "
                f"(batch, time) = {(batch, time)}. Received: "
                f"segment_ids.shape={shape}"
            )


def check_decoding_scores(
    layer_name: str, inputs_shape, num_heads: int, cache, attention_bias, segment_ids
) -> None:
    """Raises ValueError for a decoding call's `segment_ids` (a cache holds
    one sequence per row) or an `attention_bias` that is not broadcastable
    to (batch, num_heads, time, max_length)."""
    if segment_ids is not None:
        raise ValueError(
            f"SelfAttention '{layer_name}': a key/value cache holds one "
            "sequence per row, so a decoding call takes no `segment_ids` "
            "(decode packed sequences as rows of their own). Received: "
            f"segment_ids.shape={tuple(segment_ids.shape)}"
        )
    check_score_inputs(
        layer_name, inputs_shape, num_heads, attention_bias, None, cache.shape[2]
    )
