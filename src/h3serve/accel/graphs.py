"""One request's DiT step captured in a CUDA graph and replayed for the steps after it.

Within a request every step's forward has the same shapes (the packed layout is fixed; the AdaLN tables are padded
to `TABLE_ROWS`), so after the first step runs as usual, the second is captured once and every later one is a
replay: the inputs are copied into the graph's own tensors, the whole forward (50 blocks, about 600 kernels) is
launched as one graph, and its outputs are copied out. That removes the launch gaps between kernels, which a
profile of the compiled forward shows beside the kernels' own time.

The first call of each input signature runs the function directly (so any lazy initialisation, a kernel compiled
for a new shape, happens outside a capture); the second captures. A signature seen later (a step with another number
of distinct timesteps) is captured once too, into the same memory pool. Graphs hold their intermediate tensors in
that pool until `release`: a request's graphs are made and dropped with the request (`StepGraphs` is per request),
so nothing outlives it. The forward must not synchronise with the host (no `.item()`, no data-dependent shapes):
a step cache's per-step decision does, so a request with one runs without graphs (the engine's choice).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

Signature = tuple[tuple[tuple[int, ...], torch.dtype], ...]


class _Captured:
    def __init__(self, graph: torch.cuda.CUDAGraph, inputs: list[torch.Tensor], outputs: Sequence[torch.Tensor]):
        self.graph = graph
        self.inputs = inputs
        self.outputs = outputs


class StepGraphs:
    """`fn(*tensors) -> tuple of tensors`, run directly on the first call of a signature, captured on the second,
    replayed from then on. Every argument is a CUDA tensor; the results are fresh tensors (copies of the graph's)."""

    def __init__(self, fn: Callable[..., Sequence[torch.Tensor]]):
        self.fn = fn
        self.seen: set[Signature] = set()
        self.captured: dict[Signature, _Captured] = {}
        self.pool = None
        self.replays = 0

    def __call__(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        key = tuple((tuple(t.shape), t.dtype) for t in tensors)
        captured = self.captured.get(key)
        if captured is None and key not in self.seen:
            self.seen.add(key)
            return tuple(self.fn(*tensors))
        if captured is None:
            captured = self.captured[key] = self._capture(tensors)
        for static, value in zip(captured.inputs, tensors, strict=True):
            static.copy_(value, non_blocking=True)
        captured.graph.replay()
        self.replays += 1
        return tuple(t.clone() for t in captured.outputs)

    def _capture(self, tensors: Sequence[torch.Tensor]) -> _Captured:
        inputs = [t.clone() for t in tensors]
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        # Entering the capture synchronises and empties the allocator's cache, so the graph's pool of one forward's
        # activations does not come on top of the idle blocks the direct call left (the memory plan counts one).
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = tuple(self.fn(*inputs))
        return _Captured(graph, inputs, outputs)

    def release(self) -> None:
        """Drop every graph and its memory (the end of the request)."""
        self.captured.clear()
        self.seen.clear()
        self.pool = None
        torch.cuda.empty_cache()
