"""A SelfAttention call traced with unknown batch and time computes the right
numbers at every length: nothing about the traced length is baked in.

Each backend's tracer of unknown shapes: `jax.export` with symbolic
dimensions (what jax2onnx and jax2tf trace with), `tf.function` with `None`
dimensions, and on PyTorch `torch.jit.trace` at batch 1 and time 1 (what
Keras's dynamic ONNX and its OpenVINO export trace with) and `torch.export`
with dynamic dimensions (its `.pt2`, LiteRT and static ONNX exports). The
traced function runs at other shapes and is compared with tests/reference.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from keras_selfattn import SelfAttention
from keras_selfattn.attention import dispatch, masks
from tests import reference
from tests.backend import BACKEND

pytestmark = pytest.mark.usefixtures("every_path")

FEATURES = 8
# (batch, time) the traced call runs at.
SHAPES = [(2, 5), (1, 9)]


def _layer(**config) -> SelfAttention:
    config = {"causal": True, **config}
    layer = SelfAttention(
        num_heads=2,
        num_key_value_heads=1,
        rope_max_wavelength=10000,
        output_dim=6,
        use_bias=True,
        **config,
    )
    layer.build((None, None, FEATURES))
    return layer


def _inputs(batch: int, time: int):
    rng = np.random.default_rng(time)
    x = rng.standard_normal((batch, time, FEATURES)).astype("float32")
    mask = np.ones((batch, time), bool)
    mask[0, time - 2 :] = False  # padded at the end
    if batch > 1:
        mask[1, :1] = False  # and at the start
    return x, mask


def _traced(fn, tracer: str, layer=None):
    """fn(x, mask), traced with unknown batch and time, as a numpy function;
    `layer` is the layer fn calls, if any."""
    if BACKEND == "jax":
        import jax

        batch, time = jax.export.symbolic_shape("b, t")
        specs = (
            jax.ShapeDtypeStruct((batch, time, FEATURES), "float32"),
            jax.ShapeDtypeStruct((batch, time), "bool"),
        )
        exported = jax.export.export(jax.jit(fn))(*specs)
        return lambda x, mask: np.asarray(exported.call(x, mask))
    if BACKEND == "tensorflow":
        import tensorflow as tf

        traced = tf.function(
            fn,
            input_signature=[
                tf.TensorSpec([None, None, FEATURES], "float32"),
                tf.TensorSpec([None, None], "bool"),
            ],
        )
        return lambda x, mask: traced(x, mask).numpy()
    import torch

    class Call(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = layer  # its weights are parameters, not constants

        def forward(self, x, mask):
            return fn(x, mask)

    x, mask = (torch.from_numpy(a) for a in _inputs(2, 3))
    if tracer == "jit":
        traced = torch.jit.trace(Call(), (x[:1, :1], mask[:1, :1]), check_trace=False)
    else:
        batch, time = torch.export.Dim("batch"), torch.export.Dim("time")
        traced = torch.export.export(
            Call(),
            (x, mask),
            dynamic_shapes=({0: batch, 1: time}, {0: batch, 1: time}),
            strict=False,
        ).module()
    return lambda x, mask: (
        traced(torch.from_numpy(x), torch.from_numpy(mask)).detach().cpu().numpy()
    )


@pytest.mark.parametrize("masked", [True, False], ids=["masked", "unmasked"])
@pytest.mark.parametrize("tracer", ["jit", "export"])
def test_traced_call_has_no_baked_length(tracer, masked):
    """Masked: causal with padding; unmasked: no mask of any kind (the
    fused path then has no mask to hand the kernel)."""
    if BACKEND != "torch" and tracer == "export":
        pytest.skip("torch.export is PyTorch's")
    layer = _layer() if masked else _layer(causal=False)
    if masked:
        run = _traced(lambda x, mask: layer(x, mask=mask), tracer, layer)
    else:
        run = _traced(lambda x, mask: layer(x), tracer, layer)
    for batch, time in SHAPES:
        x, mask = _inputs(batch, time)
        mask = mask if masked else None
        expected = reference.for_layer(layer, x, padding_mask=mask)[0]
        np.testing.assert_allclose(
            run(x, _inputs(batch, time)[1]), expected, atol=1e-5, rtol=1e-5
        )


def test_positions_of_a_traced_length():
    """`masks.positions` of a length known only at run time."""

    def fn(x, mask):
        from keras import ops

        return ops.add(
            ops.zeros_like(x[0, :, 0]), masks.positions(ops.shape(x)[1], "float32")
        )

    run = _traced(fn, "jit")
    for batch, time in SHAPES:
        x, mask = _inputs(batch, time)
        np.testing.assert_array_equal(run(x, mask), np.arange(time, dtype="float32"))


def test_exporting_only_while_pytorch_exports():
    """`dispatch.exporting()` holds only inside PyTorch's export tracers."""
    assert dispatch.exporting() is False
    if BACKEND != "torch":
        return
    import torch

    seen = []

    def fn(x):
        seen.append(dispatch.exporting())
        return x * 2

    torch.jit.trace(fn, (torch.ones(2),), check_trace=False)

    class Double(torch.nn.Module):
        def forward(self, x):
            return fn(x)

    torch.export.export(Double(), (torch.ones(2),), strict=False)
    assert seen == [True, True]
    assert dispatch.exporting() is False
