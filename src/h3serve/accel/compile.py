"""Regional compilation: each repeated block class (`REPEATED_BLOCKS`: the 50 DiT blocks and the refiner's) compiled
once, full graph, and the compiled code shared by every instance, as diffusers' `compile_repeated_blocks` does.

Only the row count is symbolic. Every call marks the first dimension of each tensor argument that has the row count
(the rows, their AdaLN indices, the RoPE tables) as dynamic; every other size stays static (the modulation table is
padded to `TABLE_ROWS`, widths are the model's). So the first forward compiles two graphs (block, refiner block) and
nothing recompiles afterwards: not across the steps of a request, nor across requests with other prompt lengths,
tasks, canvases or frame counts. `GraphCounter` counts the graphs Dynamo hands to the backend, so that claim is
checked, not assumed. Why not `dynamic=True`: it makes every size symbolic (the head count and width of the RoPE
tables too), and Inductor's code for the qk-norm + rotary then ran three times slower.

Precision: Inductor fuses the pointwise ops around the GEMMs and, by default, skips the bf16 rounding eager makes
between two fused ops. `eager_precision` (Inductor's `emulate_precision_casts`) keeps those roundings: the BF16
profile, whose point is fidelity, keeps them; with FP8 linears the FP8 rounding dominates, so CUTLASS does without.
The measured effect of each choice is in bench/results/README.md.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping

import torch
from torch import nn

from h3serve.accel.blocks import BlockStack


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


class Compiler:
    """torch.compile of block bodies: one compiled function per (block class, body), shared by every block bound to
    it (both DiTs of a `both` server share one compiler, so their blocks share code and one `GraphCounter`)."""

    def __init__(
        self,
        backend: str = "inductor",
        dynamic: bool = True,
        eager_precision: bool = False,
        inductor_config: Mapping[str, object] | None = None,
    ):
        config = {"emulate_precision_casts": True} if eager_precision else {}
        self.counter = GraphCounter(backend, {**config, **(inductor_config or {})} or None)
        self.dynamic = dynamic
        self._compiled: dict[tuple[type, Callable], Callable] = {}

    def bind(self, block: nn.Module, body: Callable) -> Callable:
        """The compiled `body` as `block`'s forward: called as forward(x, *args)."""
        key = (type(block), body)
        if key not in self._compiled:
            self._compiled[key] = torch.compile(
                body, fullgraph=True, dynamic=None if self.dynamic else False, backend=self.counter
            )
        return functools.partial(_call_marked if self.dynamic else _call, self._compiled[key], block)


def compile_repeated_blocks(
    model: nn.Module,
    backend: str = "inductor",
    dynamic: bool = True,
    eager_precision: bool = False,
    inductor_config: Mapping[str, object] | None = None,
) -> GraphCounter:
    """Compile every repeated block of `model` in place, over whatever body its block stack runs
    (`accel.blocks`); returns the counter of compiled graphs. `dynamic=False` (static shapes: a recompile for every
    new row count) exists to measure what the symbolic row count costs. `inductor_config`: further Inductor options
    (a benchmark's experiments)."""
    compiler = Compiler(backend, dynamic, eager_precision, inductor_config)
    BlockStack.of(model).set_compiler(compiler).install(model)
    return compiler.counter


def uncompile_repeated_blocks(model: nn.Module) -> None:
    """Undo `compile_repeated_blocks`: the blocks run their body (own forward, or passes) eagerly again."""
    BlockStack.of(model).set_compiler(None).install(model)
