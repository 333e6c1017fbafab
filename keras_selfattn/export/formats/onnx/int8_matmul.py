"""The `int8_matmul` option's values, read by the ONNX format and its
integer rewrite alike.

How an int8 layer with quantized activations runs on ONNX Runtime's integer
kernels (`int8_layers`): on the uint8 x int8 kernel where a probe run when
the session loads finds it exact (VNNI, AMX), else on uint8 x uint8, exact
on every CPU (`ANY_CPU`); or on uint8 x int8 alone, no probe, wrong on x86
CPUs without VNNI or AMX (`VNNI`).
"""

ANY_CPU, VNNI = "any_cpu", "vnni"
