"""A torch.export program (.pt2) run by torch."""

from __future__ import annotations

import numpy as np

from ._common import Loaded


class TorchProgram(Loaded):
    """A loaded torch.export program, called on its inputs in order."""

    positional_inputs = True  # torch.export keeps argument positions only

    def __init__(self, path: str):
        import torch
        from torch.utils import _pytree

        self._torch = torch
        self._pytree = _pytree
        program = torch.export.load(path)
        self._spec = program.call_spec.in_spec
        self._module = program.module()
        self.input_names = [
            spec.arg.name
            for spec in program.graph_signature.input_specs
            if spec.kind == torch.export.graph_signature.InputKind.USER_INPUT
        ]
        count = program.call_spec.out_spec.num_leaves
        self.output_names = [f"output_{index}" for index in range(count)]
        self.description = {}

    def __call__(self, arrays):
        torch = self._torch
        # A copy in C order that keeps 0-d inputs (cache_update_index) 0-d:
        # np.ascontiguousarray makes them 1-d.
        flat = [
            torch.from_numpy(np.array(arrays[n], order="C")) for n in self.input_names
        ]
        args, kwargs = self._pytree.tree_unflatten(flat, self._spec)
        with torch.no_grad():
            outputs = self._pytree.tree_leaves(self._module(*args, **kwargs))
        values = [  # numpy has no bfloat16: widened, exactly
            (o.float() if o.dtype == torch.bfloat16 else o).detach().numpy()
            for o in outputs
        ]
        return dict(zip(self.output_names, values, strict=True))


def load(path: str, signature: str) -> TorchProgram:
    """The .pt2 file `path` (`signature`: a program has one)."""
    return TorchProgram(path)
