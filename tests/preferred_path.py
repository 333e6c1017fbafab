"""`preferred`: calls take one attention path wherever it can serve them.

The tests run the numerics suites once per path with it (the `every_path`
fixture in conftest.py), whatever the layers' `flash_attention` and
`chunk_size` say. It wraps `dispatch.choose` wherever the library bound it,
and reads the library's own declarations (`dispatch.IMPLEMENTATIONS`) to know
whether the path can serve a call; a call it cannot serve (say, returned
scores on the fused path) is chosen as usual.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Iterator

from keras_selfattn.attention import dispatch

# The block size of the chunked path when `preferred("chunked")` picks it for
# a layer without chunk_size: small, so short test sequences span blocks.
PREFERRED_CHUNK_SIZE = 2


@contextlib.contextmanager
def preferred(name: str) -> Iterator[None]:
    """Within this context, calls take the `name` path where it can serve them.

    Args:
        name: A path of `dispatch.IMPLEMENTATIONS`: "fused", "single_query",
            "packed", "chunked" or "explicit".
    """
    if name not in dispatch.IMPLEMENTATIONS:
        raise ValueError(
            f"`name` must be one of {sorted(dispatch.IMPLEMENTATIONS)}. "
            f"Received: name={name!r}"
        )
    implementation = dispatch.IMPLEMENTATIONS[name]
    original = dispatch.choose

    def choose(masks, *, layer_name, **arguments):
        facts = dispatch.CallFacts.of(masks, **arguments)
        # The layer's own flash_attention and chunk_size do not decide here.
        facts = dataclasses.replace(
            facts,
            flash_attention=None,
            chunk_size=(facts.chunk_size or PREFERRED_CHUNK_SIZE)
            if name == "chunked"
            else None,
        )
        if not implementation.reasons(facts):
            return implementation.choice(facts)
        return original(masks, layer_name=layer_name, **arguments)

    bound = [
        module
        for module_name, module in list(sys.modules.items())
        if module_name.startswith("keras_selfattn")
        and getattr(module, "choose", None) is original
    ]
    for module in bound:
        module.choose = choose
    try:
        yield
    finally:
        for module in bound:
            module.choose = original
