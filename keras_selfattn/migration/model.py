"""`convert`: a Functional or Sequential model rebuilt with SelfAttention in
place of every self-attention call of Keras's attention layers, at the top
level (here) or inside other layers (`blocks`, behind an adapter).

The graph is rerun node by node (`_keras_private.run_through_graph`, what
`keras.models.clone_model` runs): each layer holding no attention is the
new model's too (or, not sharing weights, copied: its config, then its
weights), a layer holding attention is copied holding the original's other
sublayers (`blocks.share_sublayers`), nested models are converted in turn,
and each layer of
`_from_keras.CONVERTIBLE` whose every call in the model is a self-attention
call becomes the SelfAttention of `_from_keras.from_multi_head_attention`.
The attention inside other layers is then recorded on one run of that new
model and put behind adapters: the user's model is only read.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys

import keras

from keras_selfattn import _from_keras
from keras_selfattn._keras_private import (
    get_keras_mask,
    input_layer_name,
    is_functional,
    nodes,
    run_through_graph,
)
from keras_selfattn.migration import blocks, configs, hub_attention
from keras_selfattn.migration.adapter import MultiHeadAttentionAdapter
from keras_selfattn.migration.hub_adapter import KerasHubAttentionAdapter
from keras_selfattn.self_attention import SelfAttention

_CALL = inspect.signature(keras.layers.MultiHeadAttention.call)
# Call arguments a SelfAttention call has too.
_KEPT = ("attention_mask", "return_attention_scores", "training")


@dataclasses.dataclass
class ConversionReport:
    """What `convert` did: one line per attention layer.

    Attributes:
        converted: "name -> SelfAttention(...)" per converted layer.
        kept: "name: why" per attention layer left as it was.
        padded: Whether a converted layer is called on a Keras-masked input
            (then its padded positions output zeros).
    """

    converted: list[str] = dataclasses.field(default_factory=list)
    kept: list[str] = dataclasses.field(default_factory=list)
    padded: bool = False

    def __str__(self) -> str:
        lines = [f"converted {len(self.converted)} attention layer(s)"]
        lines += [f"  {line}" for line in self.converted]
        lines += [f"not converted: {line}" for line in self.kept]
        if self.padded:
            lines.append(
                "padded positions (the Keras mask's False) now output zeros, "
                "where Keras's attention layer output an average of the values; "
                "real positions are unchanged, unless a later layer reads the "
                "padded positions without the mask"
            )
        return "\n".join(lines)


def _bound(node) -> dict:
    """A Keras attention call's arguments by name."""
    bound = _CALL.bind(None, *node.arguments.args, **node.arguments.kwargs)
    return {k: v for k, v in bound.arguments.items() if k != "self"}


def _described(sa: SelfAttention) -> str:
    """How the report names a converted layer's SelfAttention."""
    extras = "".join(
        f", {name}={getattr(sa, name)}"
        for name in ("rope_max_wavelength", "sliding_window", "logit_soft_cap")
        if getattr(sa, name) is not None
    )
    return (
        f"SelfAttention(num_heads={sa.num_heads}, num_key_value_heads="
        f"{sa.num_key_value_heads}, output_dim={sa.output_dim}, "
        f"causal={sa.causal}{extras})"
    )


def _known(attention) -> bool:
    """keras-hub's CachedMultiHeadAttention: its own call adds only its
    cache, which the adapter passes on in the same layout."""
    keras_hub = sys.modules.get("keras_hub")  # imported where a layer is its
    return keras_hub is not None and type(attention) is getattr(
        getattr(keras_hub, "layers", None), "CachedMultiHeadAttention", None
    )


def _input_like(x) -> keras.KerasTensor:
    """A new `keras.Input` like the model input `x`, its layer's name kept
    (exports name their inputs after it)."""
    return keras.Input(batch_shape=x.shape, dtype=x.dtype, name=input_layer_name(x))


def _keras_adapter(attention, calls):
    """The MultiHeadAttentionAdapter of a Keras attention layer inside a
    block, or None and why not."""
    why = blocks.why_not(calls)
    if why is not None:
        return None, why
    try:
        adapter = MultiHeadAttentionAdapter.from_multi_head_attention(
            attention,
            causal=blocks.causal_of(calls),
            causal_attention_mask=blocks.causal_mask_given(calls),
        )
    except ValueError as error:
        return None, str(error).split(". Received")[0]
    return adapter, None


def _hub_adapter(attention, parent, calls):
    """The KerasHubAttentionAdapter of a keras-hub attention layer (Llama's,
    ...) held by `parent`, or None and why not."""
    if not calls:
        return None, "not called when the model ran on example inputs"
    try:
        sa = hub_attention.from_keras_hub(SelfAttention, attention, parent)
    except ValueError as error:
        return None, str(error).split(". Received")[0]
    spec = hub_attention.row(attention)
    window = sa.sliding_window if spec.band_in_mask else None
    if not blocks.causal_mask_given(calls, window):
        return None, (
            "its attention_mask on the example run was not its decoder's causal mask"
        )
    adapter = (spec.adapter or KerasHubAttentionAdapter)(
        sa, name=attention.name, dtype=attention.dtype_policy
    )
    adapter.built = True
    return adapter, None


class _Converter:
    def __init__(self, report: ConversionReport, share_weights: bool):
        self.report = report
        self.share_weights = share_weights
        self.calls = {}  # id(attention inside an original layer) -> its calls
        self.copies = {}  # id(original) -> (original, new layer)
        self.adapters = {}  # id(attention inside a layer) -> its adapter
        self.blocks = []  # (original, its copy, name): attention inside

    def model(self, model: keras.Model, path: str) -> keras.Model:
        if isinstance(model, keras.Sequential):
            return self._sequential(model, path)
        if not is_functional(model):
            raise ValueError(
                f"convert rebuilds Functional and Sequential models; "
                f"'{model.name}' is a subclassed {type(model).__name__}: convert "
                "its layers with SelfAttention.from_multi_head_attention(layer). "
                f"Received: model={model.name!r}"
            )
        return self._functional(model, path)

    def _layer(self, layer, path: str, calls: list[dict] | None = None):
        """The new layer of `layer` (one per original: shared layers stay
        shared)."""
        if id(layer) in self.copies:
            return self.copies[id(layer)][1]
        if not isinstance(layer, keras.layers.Layer):
            return layer  # an op of `keras.ops` (the mask's): no state
        name = f"{path}{layer.name}"
        if isinstance(layer, keras.Model):
            new = self.model(layer, f"{name}/")
        elif type(layer) in _from_keras.CONVERTIBLE and calls is not None:
            new = self._attention(layer, name, calls)
        elif isinstance(layer, _from_keras.CONVERTIBLE):
            self.report.kept.append(
                f"{name}: a subclass, {type(layer).__name__}, whose call may "
                "differ (SelfAttention.from_multi_head_attention converts it "
                "where it computes what its base class does)"
            )
            new = self._kept(layer)
        elif self.share_weights and not blocks.holds_attention(layer):
            new = layer
            self.blocks.append((layer, new, name))  # other attention: named
        else:
            new = configs.copy(layer)
            self._build_like(layer, new)
            if self.share_weights:
                blocks.share_sublayers(layer, new)
            self.blocks.append((layer, new, name))
        self.copies[id(layer)] = (layer, new)
        return new

    def _kept(self, layer):
        """A layer the new model holds as it is: `layer` itself, or with
        `share_weights=False` its copy (`copy_weights` fills it)."""
        return layer if self.share_weights else configs.copy(layer)

    def _attention(self, layer, name: str, calls: list[dict]):
        why = blocks.why_not(calls, in_block=False)
        if why is not None:
            self.report.kept.append(f"{name}: {why}")
            return self._kept(layer)
        causal = bool(calls[0].get("use_causal_mask"))
        sa = SelfAttention.from_multi_head_attention(layer, causal=causal)
        self.report.converted.append(
            f"{name} ({type(layer).__name__}) -> {_described(sa)}"
        )
        return sa

    @staticmethod
    def _build_like(layer, new) -> None:
        """Builds the copy `new` of a layer holding attention as `layer` is
        built: keras-hub's layers create their sublayers in `build`."""
        if not blocks.holds_attention(layer):
            return
        own_build = not getattr(type(layer).build, "_is_default", False)
        if own_build and layer.built and not new.built and layer.get_build_config():
            new.build_from_config(layer.get_build_config())

    def record(self, new_model: keras.Model) -> None:
        """Records how each attention layer inside a block is called, on one
        run of `new_model` (the package's own copy, its weights copied) on
        example inputs: the calls of each copy's attention are its
        original's."""
        pairs = [
            (attention, blocks.at(new, place))
            for layer, new, _ in self.blocks
            for place, attention in blocks.attention_places(layer)
        ]
        if not pairs:
            return
        copies = {id(copy): copy for _, copy in pairs}
        with blocks.record_calls(list(copies.values())) as calls:
            new_model(blocks.example_inputs(new_model), training=False)
        for attention, copy in pairs:
            self.calls.setdefault(id(attention), []).extend(calls.get(id(copy), ()))

    def adapt_blocks(self) -> None:
        """Puts the adapters in the copies of the layers holding attention,
        and names in the report the attention classes that do not convert."""
        for layer, new, name in self.blocks:
            if blocks.holds_attention(layer):
                self._block(layer, new, name)
            for inner in blocks.other_attention(layer):
                self.report.kept.append(
                    f"{name}/{inner.name}: {type(inner).__name__} is its own "
                    "attention class, not a MultiHeadAttention: it does not "
                    "convert yet"
                )

    def _block(self, layer, new, name: str) -> None:
        """Puts an adapter in `new` (the copy of `layer`) for each attention
        layer inside that the model calls as self-attention."""
        adapters = {}
        for place, attention in blocks.attention_places(layer):
            label = f"{name}/{attention.name}"
            adapter, why = self._adapter(attention, blocks.at(layer, place[:-1]))
            if why is None and type(blocks.at(new, place)) is not type(attention):
                why = f"the copy of {type(layer).__name__} holds another layer there"
            if why is not None:
                self.report.kept.append(f"{label}: {why}")
                continue
            adapters[place] = adapter
            self.report.converted.append(
                f"{label} ({type(attention).__name__}, inside "
                f"{type(layer).__name__}) -> {_described(adapter.attention)} "
                f"behind {type(adapter).__name__}"
            )
        if adapters:
            blocks.install(new, adapters)

    def _adapter(self, attention, parent):
        """The adapter of an attention layer inside a block (`parent` holds
        it; one adapter per layer: a shared layer stays shared), or None and
        why not."""
        if id(attention) in self.adapters:
            return self.adapters[id(attention)], None
        calls = self.calls.get(id(attention))
        if hub_attention.row(attention) is not None:
            adapter, why = _hub_adapter(attention, parent, calls)
        elif type(attention) not in _from_keras.CONVERTIBLE and not _known(attention):
            return None, (
                f"a subclass, {type(attention).__name__}, whose call may differ "
                "(SelfAttention.from_multi_head_attention converts it where it "
                "computes what its base class does)"
            )
        else:
            adapter, why = _keras_adapter(attention, calls)
        if why is not None:
            return None, why
        self.adapters[id(attention)] = adapter
        if any(call[blocks.KERAS_MASK] is not None for call in calls):
            self.report.padded = True
        return adapter, None

    def _sequential(self, model: keras.Sequential, path: str) -> keras.Sequential:
        if not model.built:
            raise ValueError(
                f"Model '{model.name}' is not built: give it a keras.Input or "
                f"call it once before convert. Received: model={model.name!r}"
            )
        layers = [self._layer(layer, path) for layer in model.layers]
        inputs = _input_like(model.inputs[0])
        return keras.Sequential([inputs, *layers], name=model.name)

    def _functional(self, model, path: str) -> keras.Model:
        calls = {}
        for node in nodes(model):
            if type(node.operation) in _from_keras.CONVERTIBLE:
                calls.setdefault(id(node.operation), []).append(_bound(node))
        inputs = keras.tree.map_structure(_input_like, model.input)

        def call(layer, *args, **kwargs):
            new = self._layer(layer, path, calls.get(id(layer)))
            if not isinstance(new, SelfAttention):
                return new(*args, **kwargs)
            call = _CALL.bind(None, *args, **kwargs).arguments
            query = call["query"]
            kept = {k: call[k] for k in _KEPT if k in call}
            mask = get_keras_mask(query)
            if mask is not None:
                self.report.padded = True
                if "attention_mask" in kept:
                    # Keras fills `mask` only for a call of one tensor.
                    kept["mask"] = mask
            return new(query, **kept)

        outputs = run_through_graph(model, inputs, call)
        return keras.Model(inputs, outputs, name=model.name)

    def copy_weights(self) -> None:
        for original, new in self.copies.values():
            if new is original or isinstance(new, (keras.Model, SelfAttention)):
                continue
            if blocks.holds_attention(original):
                blocks.copy_weights(original, new)
            else:
                new.set_weights(original.get_weights())


def convert(model: keras.Model, share_weights: bool = True) -> keras.Model:
    """A new model with SelfAttention in place of Keras's attention calls.

    The new model holds every layer of a Functional or Sequential model
    (nested models included) that holds no attention, the layer itself, so
    the two models hold their weights once (`share_weights=False`: copies,
    with their weights); each `keras.layers.MultiHeadAttention` or
    `GroupedQueryAttention` whose calls in the model are all self-attention
    calls (query, value and key the same tensor) becomes the SelfAttention of
    `SelfAttention.from_multi_head_attention`: `use_causal_mask=True`
    becomes `causal=True`, `attention_mask` and `return_attention_scores`
    are passed on. `convert` only reads the original model.

    Attention layers inside other layers (a user's subclassed block,
    keras-hub's `TransformerEncoder`) convert too: the layer is copied from
    its config, holding the original's other sublayers, and a
    `MultiHeadAttentionAdapter` (a SelfAttention behind
    MultiHeadAttention's call signature) in the attention's place, so its own
    code runs unchanged; how each is called is read from one run of the
    original model on example inputs (`migration.blocks`). A cross-attention
    call keeps its layer: the report names it. On Keras-masked inputs the
    real positions' outputs are unchanged and the padded positions output
    zeros.

    Args:
        model: A built Functional or Sequential `keras.Model`.
        share_weights: Whether the new model holds the layers of `model`
            that it does not convert (default), rather than their copies.
            Shared, the weights take their memory once, and training,
            quantizing or `enable_lora` on either model changes both; pass
            False for a model of its own (twice the memory while both are
            held).

    Returns:
        The new, uncompiled model; its `conversion_report` (a
        `ConversionReport`) says what was converted and what was not, and
        `str()` of it is a summary to print.

    Raises:
        ValueError: for a subclassed model (one line naming
            `SelfAttention.from_multi_head_attention`), an unbuilt model, or
            an attention layer that does not convert (its one-line reason).

    Example:

    >>> import keras
    >>> import keras_selfattn
    >>> x = keras.Input((None, 8))
    >>> y = keras.layers.MultiHeadAttention(2, 4)(x, x, use_causal_mask=True)
    >>> new = keras_selfattn.convert(keras.Model(x, y))
    >>> new.layers[1].causal
    True
    """
    if not isinstance(model, keras.Model):
        raise ValueError(
            f"convert takes a keras.Model. Received: model={type(model).__name__}"
        )
    if not isinstance(share_weights, bool):
        raise ValueError(
            f"share_weights is True or False. Received: share_weights={share_weights!r}"
        )
    report = ConversionReport()
    converter = _Converter(report, share_weights)
    new = converter.model(model, "")
    converter.copy_weights()
    converter.record(new)
    converter.adapt_blocks()
    new.conversion_report = report
    return new
