"""Regional compilation: each repeated block class (`REPEATED_BLOCKS`: the 50 DiT blocks and the refiner's) compiled
once, full graph, and the compiled code shared by every instance, as diffusers' `compile_repeated_blocks` does.

Shapes are symbolic from the first call (`dynamic=True`; parameters stay static, torch's default), and every shape a
block sees is either fixed (the modulation table is padded to `TABLE_ROWS`) or the request's row count. So the
first forward compiles two graphs (block, refiner block) and nothing recompiles afterwards: not across the steps of
a request (1, 2 or 3 distinct timesteps), nor across requests with other prompt lengths, tasks, canvases or frame
counts. `GraphCounter` counts the graphs Dynamo hands to the backend, so that claim is checked, not assumed.
"""

from __future__ import annotations

import torch
from torch import nn

from h3serve.model.dit import REPEATED_BLOCKS


class GraphCounter:
    """A torch.compile backend that records which code it compiled and hands each graph to the real backend.

    Dynamo numbers compilations per frame: (frame, 0) is a frame's first compile, (frame, n > 0) its n-th
    recompile (a guard failed). An analysis restart within one compile is the same compilation, not counted twice.
    """

    def __init__(self, backend: str = "inductor"):
        self.backend = backend
        self.compiles: set[tuple[int, int]] = set()

    @property
    def graphs(self) -> int:
        return len(self.compiles)

    @property
    def recompiles(self) -> int:
        return sum(1 for _, n in self.compiles if n > 0)

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        from torch._dynamo.backends.registry import lookup_backend
        from torch._guards import CompileContext

        cid = CompileContext.current_compile_id()
        self.compiles.add((cid.frame_id, cid.frame_compile_id) if cid is not None else (-1, len(self.compiles)))
        return lookup_backend(self.backend)(gm, example_inputs)


def compile_repeated_blocks(model: nn.Module, backend: str = "inductor", dynamic: bool = True) -> GraphCounter:
    """Compile every repeated block of `model` in place; returns the counter of compiled graphs. `dynamic=False`
    (static shapes: a recompile for every new row count) exists to measure what symbolic shapes cost."""
    counter = GraphCounter(backend)
    found = 0
    for module in model.modules():
        if isinstance(module, REPEATED_BLOCKS):
            module.compile(fullgraph=True, dynamic=dynamic, backend=counter)
            found += 1
    if not found:
        raise ValueError(
            f"{type(model).__name__} has no repeated blocks ({', '.join(c.__name__ for c in REPEATED_BLOCKS)})"
        )
    return counter
