"""AdaLN tables: the 13 B AdaLN parameters (26 GB in BF16) depend on the timestep only, so for a request's schedule
every block's modulation table at every step is made once before the denoise loop, and the weights need not stay on
the GPU while it runs.

A table is made exactly as the block makes it during a forward (`Block.modulation`: the same projection on the same
(M, time_embed_dim) rows, one step at a time), so a denoise over tables is bitwise the denoise without them. Off the
GPU (the default on CUDA), the weights live in host memory and are copied in one block at a time when a schedule's
tables are made, and the tables themselves are kept in (pinned) host memory too: a schedule's tables are one step's
times its step count, so the GPU holds one step's, copied in as the step starts: a copy far shorter than a forward
(bench/results/README.md, the AdaLN-tables runs). Tables are kept for a few schedules (`cache_size`), so repeated
requests of one schedule pay once.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

import torch
from torch.func import functional_call

from h3serve.model.dit import H3DiT, pad_table

Tables = list[list[torch.Tensor]]  # [step][block] -> (TABLE_ROWS, 6 * hidden)


class ScheduleTables(Sequence[list[torch.Tensor]]):
    """A schedule's tables; `[step]` gives that step's per-block tables on the compute device (a copy from host
    memory when they are kept there, the tensors themselves otherwise)."""

    def __init__(self, tables: Tables, device: torch.device):
        self.tables = tables
        self.device = device

    def __len__(self) -> int:
        return len(self.tables)

    def __getitem__(self, step: int) -> list[torch.Tensor]:  # type: ignore[override]
        return [t.to(self.device, non_blocking=True) for t in self.tables[step]]


def is_block_adaln(name: str) -> bool:
    """Whether a DiT tensor name is a block's AdaLN projection (what waits in host memory off the device)."""
    return name.startswith("blocks.") and ".adaln_proj." in name


class AdalnHostHook:
    """Puts the DiT blocks' AdaLN weights in (pinned) host memory as they load (`load_dit(hook=...)`), one tensor
    at a time: with the tables made off the device they never need to be resident, so a load does not peak 24 GiB
    above what the GPU keeps."""

    def transform(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        if not is_block_adaln(name) or tensor.device.type == "cpu":
            return {name: tensor}
        return {name: torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True).copy_(tensor)}

    def prepare(self, module) -> None:
        pass


class AdalnTables:
    def __init__(self, dit: H3DiT, *, resident: bool, cache_size: int = 4):
        self.dit = dit
        self.device = dit.blocks[0].norm1.weight.device  # the compute device, whatever the AdaLN weights' is
        self.cache_size = cache_size
        self._cache: collections.OrderedDict[tuple, ScheduleTables] = collections.OrderedDict()
        self.offloaded = not resident and self.device.type != "cpu"
        if self.offloaded:
            pin = torch.cuda.is_available()
            for block in dit.blocks:
                for p in block.adaln_proj.parameters():
                    if p.device.type == "cpu":  # already there (`AdalnHostHook` put it there as it loaded)
                        continue
                    # Straight into page-locked memory: one copy, not a pageable copy and then a pinned one.
                    p.data = torch.empty(p.shape, dtype=p.dtype, pin_memory=pin).copy_(p.data)
            torch.cuda.empty_cache()
        else:  # resident: on the compute device, wherever they were loaded
            for block in dit.blocks:
                for p in block.adaln_proj.parameters():
                    p.data = p.data.to(self.device)

    @torch.no_grad()
    def for_steps(self, timesteps: Sequence[torch.Tensor]) -> ScheduleTables:
        """Tables for a schedule given as each step's distinct timesteps ((M_i,) float32, as `timestep_plan` gives
        them). Cached by the exact values."""
        key = tuple(v for t in timesteps for v in t.tolist()) + tuple(len(t) for t in timesteps)
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        dtype = self.dit.compute_dtype
        pin = self.offloaded and torch.cuda.is_available()
        tembs = [self.dit.time_embedder(t.to(self.device)) for t in timesteps]  # (M_i, time_embed_dim) fp32
        tables: Tables = [[] for _ in timesteps]
        for block in self.dit.blocks:
            proj = block.adaln_proj
            params = None
            if self.offloaded:  # this block's weights, on the GPU only while its tables are made
                params = {n: p.to(self.device, non_blocking=True) for n, p in proj.named_parameters()}
            for step, temb in enumerate(tembs):
                table = pad_table(proj(temb, dtype) if params is None else functional_call(proj, params, (temb, dtype)))
                if self.offloaded:  # kept in host memory; the step's copy comes in as it starts
                    table = torch.empty(table.shape, dtype=table.dtype, pin_memory=pin).copy_(table)
                tables[step].append(table)
            del params
        made = ScheduleTables(tables, self.device)
        self._cache[key] = made
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return made
