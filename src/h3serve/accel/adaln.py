"""AdaLN tables: the 13 B AdaLN parameters (26 GB in BF16) depend on the timestep only, so for a request's schedule
every block's modulation table at every step is made once before the denoise loop, and the weights need not stay on
the GPU while it runs.

A table is made exactly as the block makes it during a forward (`Block.modulation`: the same projection on the same
(M, time_embed_dim) rows, one step at a time), so a denoise over tables is bitwise the denoise without them. Off the
GPU (the default on CUDA), the weights live in host memory and are copied in one block at a time when a schedule's
tables are made; tables are kept for a few schedules (`cache_size`), so repeated requests of one schedule pay once.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

import torch
from torch.func import functional_call

from h3serve.model.dit import H3DiT, pad_table

Tables = list[list[torch.Tensor]]  # [step][block] -> (TABLE_ROWS, 6 * hidden)


class AdalnTables:
    def __init__(self, dit: H3DiT, *, resident: bool, cache_size: int = 4):
        self.dit = dit
        self.device = dit.blocks[0].norm1.weight.device
        self.cache_size = cache_size
        self._cache: collections.OrderedDict[tuple, Tables] = collections.OrderedDict()
        self.offloaded = not resident and self.device.type != "cpu"
        if self.offloaded:
            pin = torch.cuda.is_available()
            for block in dit.blocks:
                for p in block.adaln_proj.parameters():
                    p.data = p.data.to("cpu").pin_memory() if pin else p.data.to("cpu")
            torch.cuda.empty_cache()

    @torch.no_grad()
    def for_steps(self, timesteps: Sequence[torch.Tensor]) -> Tables:
        """Tables for a schedule given as each step's distinct timesteps ((M_i,) float32, as `timestep_plan` gives
        them). Cached by the exact values."""
        key = tuple(v for t in timesteps for v in t.tolist()) + tuple(len(t) for t in timesteps)
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        dtype = self.dit.compute_dtype
        tembs = [self.dit.time_embedder(t.to(self.device)) for t in timesteps]  # (M_i, time_embed_dim) fp32
        tables: Tables = [[] for _ in timesteps]
        for block in self.dit.blocks:
            proj = block.adaln_proj
            params = None
            if self.offloaded:  # this block's weights, on the GPU only while its tables are made
                params = {n: p.to(self.device, non_blocking=True) for n, p in proj.named_parameters()}
            for step, temb in enumerate(tembs):
                table = proj(temb, dtype) if params is None else functional_call(proj, params, (temb, dtype))
                tables[step].append(pad_table(table))
            del params
        self._cache[key] = tables
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return tables
