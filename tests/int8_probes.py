"""The int8 ONNX files' probe of the machine's kernel, as the tests read it
(`keras_selfattn.export.formats.onnx.int8_layers`): its names, and a copy
of a file whose probes fail."""

from __future__ import annotations

# The names of an int8 file's probe (one per graph: a generator's prompt
# pass and its loop body each have one).
PROBE = "int8_probe_"


def with_inexact_probes(proto, probes: int):
    """A copy of an int8 file whose `probes` probes find the kernel inexact,
    so its sessions take the uint8 x uint8 branches (what x86 CPUs without
    VNNI or AMX run)."""
    from onnx import numpy_helper

    copy = type(proto)()
    copy.CopyFrom(proto)
    changed = 0
    for index, tensor in enumerate(copy.graph.initializer):
        if tensor.name.startswith(f"{PROBE}exact"):
            wrong = numpy_helper.to_array(tensor) + 1
            copy.graph.initializer[index].CopyFrom(
                numpy_helper.from_array(wrong, tensor.name)
            )
            changed += 1
    assert changed == probes, (changed, probes)
    return copy
