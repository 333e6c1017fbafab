"""The name scope that marks the attention core for the fused ONNX export.

`FUSABLE_CORE_SCOPE` is the contract between the explicit attention path
(`attention.explicit`, which computes its core under this scope) and
`export.formats.onnx.fused` (which replaces the ops under it by ONNX's Attention
operator). It lives in a module of its own because both sides import it:
the export package imports the layer, so the layer cannot import the export
package without an import cycle.
"""

# Under it: (B, H, T, K) query and key, (B, H, T, V) value and the bool mask
# in, (B, H, T, V) heads out. A name scope adds no computation.
FUSABLE_CORE_SCOPE = "fusable_attention_core"
