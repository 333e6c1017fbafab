"""The attention paths, forced through the layer's own arguments, for the
tests that run once per path (`flash_attention`, `chunk_size`)."""

import pytest

from tests.backend import BACKEND

PATHS = {
    "explicit": {"flash_attention": False},
    "chunked": {"flash_attention": False, "chunk_size": 3},
    "fused": {"flash_attention": True},
}
needs_fused = pytest.mark.skipif(
    BACKEND == "tensorflow", reason="TensorFlow has no fused attention kernel"
)
PATH_PARAMS = [
    pytest.param("explicit"),
    pytest.param("chunked"),
    pytest.param("fused", marks=needs_fused),
]
