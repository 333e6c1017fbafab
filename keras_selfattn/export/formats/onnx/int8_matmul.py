"""The `int8_matmul` option's values, read by the ONNX format and its
integer rewrite alike.

How an int8 layer with quantized activations runs on ONNX Runtime's uint8 x
int8 kernel (`integer`): its activations split into 7-bit positive and
negative parts, exact on every CPU (`ANY_CPU`), or shifted to uint8, half
the work with VNNI or AMX and wrong on x86 without them (`VNNI`).
"""

ANY_CPU, VNNI = "any_cpu", "vnni"
