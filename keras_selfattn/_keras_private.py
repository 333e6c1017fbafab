"""Keras's private names the package uses, in this one module.

Each is used where Keras has no public route (CONTRIBUTING.md's "Keras's
private names" says what, where and why). They are looked up once, at
import; where a Keras release moved one, the name here raises at use a
`PrivateKerasError` of one line naming the installed Keras and what is
missing, never an error deep in a traceback.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator

import keras


class PrivateKerasError(RuntimeError):
    """A private name of Keras the package uses is not in the installed
    release."""


def missing(what: str) -> PrivateKerasError:
    """The one-line error for a private name `what` that is not there."""
    return PrivateKerasError(
        f"keras_selfattn uses {what}, which Keras {keras.__version__} does not "
        "have: install a Keras within keras_selfattn's declared bounds "
        "(pyproject.toml)"
    )


def _function(module: str, name: str) -> Callable:
    """`module.name`, or a function raising `missing` at use."""
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):

        def absent(*args, **kwargs):
            raise missing(f"{module}.{name}")

        return absent


def _module(name: str):
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


# The Keras mask a tensor carries (`keras.layers.Masking` sets it); Keras
# reads and writes it in `Layer.__call__` with no public accessor.
get_keras_mask = _function("keras.src.backend", "get_keras_mask")
set_keras_mask = _function("keras.src.backend", "set_keras_mask")
_FUNCTIONAL = getattr(_module("keras.src.models.functional"), "Functional", None)
_DTYPES = _module("keras.src.backend.common.dtypes")
_GPTQ = _module("keras.src.quantizers.gptq_core")
_SERIALIZATION = _module("keras.src.saving.serialization_lib")


def _attribute(owner, name: str, what: str):
    value = getattr(owner, name, None)
    if value is None:
        raise missing(what)
    return value


def is_functional(model) -> bool:
    """Whether `model` is a Functional model (keras-hub's models are)."""
    if _FUNCTIONAL is None:
        raise missing("keras.src.models.functional.Functional")
    return isinstance(model, _FUNCTIONAL)


def run_through_graph(model, inputs, call_fn: Callable):
    """Reruns a Functional `model`'s graph on `inputs`, each operation
    called through `call_fn(operation, *args, **kwargs)` (what
    `keras.models.clone_model`'s `call_function` does, on a model's nodes
    without copying its layers)."""
    run = _attribute(model, "_run_through_graph", "Functional._run_through_graph")
    return run(inputs, call_fn=call_fn)


def nodes(model) -> list:
    """The nodes of a Functional `model`'s graph (their operations and
    arguments)."""
    by_depth = _attribute(model, "_nodes_by_depth", "Functional._nodes_by_depth")
    return [node for depth in by_depth.values() for node in depth]


def sublayers(layer) -> list:
    """The layers `layer` tracks directly, in the order it created them
    (`Layer._layers`): a copy from its config repeats the order."""
    return _attribute(layer, "_layers", "Layer._layers")


@contextlib.contextmanager
def unlocked(layer) -> Iterator[None]:
    """Within the context, `layer` (a package-owned copy) takes new
    attributes after `build` (its tracker unlocked)."""
    tracker = _attribute(layer, "_tracker", "Layer._tracker")
    locked = tracker.locked
    tracker.unlock()
    try:
        yield
    finally:
        if locked:
            tracker.lock()


def attention_sublayer(layer, name: str):
    """A MultiHeadAttention's or GroupQueryAttention's `EinsumDense` `name`
    ("query", "gate", ...): its public property where Keras has one, else
    its private attribute; None where the layer has none (no gate)."""
    public = getattr(type(layer), f"{name}_dense", None)
    if isinstance(public, property):
        return getattr(layer, f"{name}_dense")
    return getattr(layer, f"_{name}_dense", None)


def flash_attention(layer) -> bool | None:
    """The `flash_attention` a Keras attention layer was built with (not in
    its config)."""
    return getattr(layer, "_flash_attention", None)


def input_layer_name(x) -> str:
    """The name of the input layer of a model input `x`."""
    history = _attribute(x, "_keras_history", "KerasTensor._keras_history")
    return history.operation.name


def dtypes_module():
    """Keras's dtype tables (`BIT64_TO_BIT32_DTYPE`, which narrows float64
    on JAX and PyTorch)."""
    if _DTYPES is None:
        raise missing("keras.src.backend.common.dtypes")
    return _DTYPES


def gptq_weight_bits(layer) -> int:
    """The bits of a GPTQ-quantized layer's kernel."""
    get = getattr(_GPTQ, "get_weight_bits_for_layer", None)
    if get is None:
        raise missing("keras.src.quantizers.gptq_core.get_weight_bits_for_layer")
    return get(layer, None)


def serialized_as_class(cls: type, config: dict) -> dict:
    """`config` serialized as the config of `cls` (a layer class), the way
    `keras.saving.serialize_keras_object` writes a layer of that class."""
    if _SERIALIZATION is None:
        raise missing("keras.src.saving.serialization_lib")
    inner = _SERIALIZATION.serialize_dict(config)
    return _SERIALIZATION.serialize_with_public_class(cls, inner) or {
        "module": cls.__module__,
        "class_name": cls.__name__,
        "config": inner,
        "registered_name": keras.saving.get_registered_name(cls),
    }


def hub_attribute(layer, name: str):
    """The attribute `name` of a keras-hub layer (its attention's
    `_query_dense`, ...: keras-hub exports no accessor), or a one-line
    `PrivateKerasError` naming the installed keras-hub."""
    value = getattr(layer, name, None)
    if value is None:
        import keras_hub  # `layer` is one of its layers: it is installed

        raise PrivateKerasError(
            f"keras_selfattn reads {type(layer).__name__}.{name}, which "
            f"keras-hub {keras_hub.__version__} does not have: install a "
            "keras-hub within keras_selfattn's declared bounds (pyproject.toml)"
        )
    return value
