"""Regional compilation: each repeated block class (`REPEATED_BLOCKS`: the 50 DiT blocks and the refiner's) compiled
once, full graph, and the compiled code shared by every instance, as diffusers' `compile_repeated_blocks` does.

Only the row count is symbolic. Every call marks the first dimension of each tensor argument that has the row count
(the rows, their AdaLN indices, the RoPE tables) as dynamic; every other size stays static (the modulation table is
padded to `TABLE_ROWS`, widths are the model's). So the first forward compiles two graphs (block, refiner block) and
nothing recompiles afterwards: not across the steps of a request (1 to 4 distinct timesteps), nor across requests
with other prompt lengths, tasks, canvases or frame counts. `GraphCounter` counts the graphs Dynamo hands to the
backend, so that claim is checked, not assumed.

Precision: Inductor fuses the pointwise ops around the GEMMs and, by default, skips the bf16 rounding eager makes
between two fused ops. The full-size BF16 forward then differed from eager (ours and diffusers', bitwise equal)
by 2.37e-2 relative; keeping those roundings (`eager_precision`, Inductor's `emulate_precision_casts`) brings it to
1.62e-2 for 2 ms (0.4%) more. The engine keeps them for the BF16 profile, whose point is fidelity; with FP8 linears
the FP8 rounding dominates (6.8e-2 either way) and the roundings cost 4 ms, so CUTLASS does without.

Why not `dynamic=True`: it makes every input size symbolic, the head count and head width of the RoPE tables too, and
Inductor's kernels for the fused qk-norm + rotary then ran 3x slower (23.2 ms against 7.7 ms per forward at the
reference shape): 528 ms per forward against 508 ms with the row count alone symbolic, and 511 ms with static shapes
(bench/results, 2026-12-01). Marking only the rows costs nothing measurable against static shapes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping

import torch
from torch import nn

from h3serve.model.dit import REPEATED_BLOCKS


class GraphCounter:
    """A torch.compile backend that records which code it compiled and hands each graph to the real backend.

    Dynamo numbers compilations per frame: (frame, 0) is a frame's first compile, (frame, n > 0) its n-th
    recompile (a guard failed). An analysis restart within one compile is the same compilation, not counted twice.
    The numbering is the process's: a frame compiled before this counter existed (an earlier compile of the same
    block class, e.g. another model's) starts above 0, so a recompile is any compile of a frame after the first
    one this counter saw.
    """

    def __init__(self, backend: str = "inductor", inductor_config: dict | None = None):
        self.backend = backend
        self.inductor_config = inductor_config or {}
        self.compiles: set[tuple[int, int]] = set()

    @property
    def graphs(self) -> int:
        return len(self.compiles)

    @property
    def recompiles(self) -> int:
        frames = {frame for frame, _ in self.compiles}
        return len(self.compiles) - len(frames)

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        from torch._dynamo.backends.registry import lookup_backend
        from torch._guards import CompileContext

        cid = CompileContext.current_compile_id()
        self.compiles.add((cid.frame_id, cid.frame_compile_id) if cid is not None else (-1, len(self.compiles)))
        if self.backend != "inductor" or not self.inductor_config:
            return lookup_backend(self.backend)(gm, example_inputs)
        import torch._inductor.config

        with torch._inductor.config.patch(self.inductor_config):  # code generation happens inside this call
            return lookup_backend(self.backend)(gm, example_inputs)


def _mark_rows(value, rows: int) -> None:
    if torch.is_tensor(value):
        if value.ndim and value.shape[0] == rows:
            torch._dynamo.mark_dynamic(value, 0)
    elif isinstance(value, (tuple, list)):
        for item in value:
            _mark_rows(item, rows)


def _call_marked(compiled, module: nn.Module, x: torch.Tensor, *args, **kwargs):
    _mark_rows((x, args, tuple(kwargs.values())), x.shape[0])
    return compiled(module, x, *args, **kwargs)


def _call(compiled, module: nn.Module, *args, **kwargs):
    return compiled(module, *args, **kwargs)


def compile_repeated_blocks(
    model: nn.Module,
    backend: str = "inductor",
    dynamic: bool = True,
    eager_precision: bool = False,
    forwards: Mapping[type, Callable] | None = None,
    inductor_config: Mapping[str, object] | None = None,
) -> GraphCounter:
    """Compile every repeated block of `model` in place (the instance's `forward` becomes the shared compiled code);
    returns the counter of compiled graphs. `dynamic=False` (static shapes: a recompile for every new row count)
    exists to measure what the symbolic row count costs. `eager_precision`: Inductor keeps the low-precision
    roundings eager makes between the ops it fuses (`emulate_precision_casts`), so the compiled block stays as
    close to the exact (eager) profile as a different GEMM order allows. `forwards`: for a block class, the function
    compiled instead of its own `forward` (same signature; `accel.fused.block_forwards`). `inductor_config`: further
    Inductor options for these graphs (a benchmark's experiments, e.g. `max_autotune`)."""
    config = {"emulate_precision_casts": True} if eager_precision else {}
    counter = GraphCounter(backend, {**config, **(inductor_config or {})} or None)
    compiled: dict[type, object] = {}
    call = _call_marked if dynamic else _call
    for module in model.modules():
        if isinstance(module, REPEATED_BLOCKS):
            cls = type(module)
            if cls not in compiled:
                fn = (forwards or {}).get(cls, cls.forward)
                compiled[cls] = torch.compile(fn, fullgraph=True, dynamic=None if dynamic else False, backend=counter)
            module.forward = functools.partial(call, compiled[cls], module)
    if not compiled:
        raise ValueError(
            f"{type(model).__name__} has no repeated blocks ({', '.join(c.__name__ for c in REPEATED_BLOCKS)})"
        )
    return counter


def uncompile_repeated_blocks(model: nn.Module) -> None:
    """Undo `compile_repeated_blocks`: the blocks run their own (eager) forward again."""
    for module in model.modules():
        if isinstance(module, REPEATED_BLOCKS):
            module.__dict__.pop("forward", None)
