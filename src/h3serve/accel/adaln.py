"""AdaLN tables: the 13 B AdaLN parameters (26 GB in BF16) depend on the timestep only, so for a request's schedule
every block's modulation table at every step is made once before the denoise loop, and the weights need not stay on
the GPU while it runs.

Where the weights live is the profile's `adaln_weights`: on the device; a page-locked host copy (`AdalnHostHook`
puts them there as they load); or mapped, never read at load (`assign_from_checkpoint(mapped=...)`):
the blocks' parameters are views of the checkpoint's file mapping, streamed one block at a time into fresh tensors
on the compute device when a schedule's tables are made (few-step adapters merged into each as it comes in, with
the load's own merge), so the weights are page cache the kernel can evict and re-read, never process memory.

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
from collections.abc import Mapping, Sequence
from typing import Protocol

import torch
from torch.func import functional_call

from h3serve.accel.profile import TABLES_KEPT, AdalnWeights
from h3serve.checkpoint.adapters.read import is_block_adaln
from h3serve.config import DEFAULT_STEPS
from h3serve.model.dit import H3DiT, is_fp32_name, pad_table

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


DEFAULT_FORWARDS = DEFAULT_STEPS - 1  # the default schedule's steps (forwards): what one kept schedule holds


class Merge(Protocol):
    """What a mapped block's weights pass through as they come in (`checkpoint.adapters.merge.AdapterMerge`)."""

    def transform(self, name: str, tensor: torch.Tensor) -> Mapping[str, torch.Tensor]: ...


class AdalnTables:
    """Each schedule's tables for one DiT, kept for the schedules used last, up to `cache_size` default schedules'
    worth of steps (a schedule longer than that is made for its render and not kept). `weights`: where the blocks'
    AdaLN weights live (see the module docstring); `merge`: with mapped weights, the adapters' merge applied to each
    block's weights as they are streamed in (None: no adapters); `mapped_load`: whether the DiT was loaded with its
    AdaLN weights mapped (`Components.adaln_mapped`), which mapped weights need."""

    def __init__(
        self,
        dit: H3DiT,
        *,
        weights: AdalnWeights | str = AdalnWeights.DEVICE,
        cache_size: int = TABLES_KEPT,
        merge: Merge | None = None,
        mapped_load: bool = False,
    ):
        self.dit = dit
        self.device = dit.blocks[0].norm1.weight.device  # the compute device, whatever the AdaLN weights' is
        self.weights = AdalnWeights(weights)
        self.cache_size = cache_size
        self.merge = merge
        self._cache: collections.OrderedDict[tuple, ScheduleTables] = collections.OrderedDict()
        # The tables wait in (pinned) host memory whenever the weights are off the compute device.
        self.offloaded = self.weights != AdalnWeights.DEVICE and self.device.type != "cpu"
        if self.weights == AdalnWeights.MAPPED:
            if not mapped_load:  # the DiT's own tensors (built in memory, perhaps merged already) are not streamed
                raise ValueError(
                    "adaln_weights mapped: this DiT's AdaLN weights were not loaded mapped (a checkpoint load with "
                    "`load_plan(profile)`'s dit_mapped leaves them views of its files): load it so, or use device or "
                    "pinned"
                )
            for name, p in self._adaln_parameters():
                if p.device.type != "cpu":
                    raise ValueError(f"{name} is on {p.device}: mapped AdaLN weights stay views of their files")
        elif self.weights == AdalnWeights.PINNED and self.offloaded:
            pin = torch.cuda.is_available()
            for _, p in self._adaln_parameters():
                if p.device.type == "cpu":  # already there (`AdalnHostHook` put it there as it loaded)
                    continue
                # Straight into page-locked memory: one copy, not a pageable copy and then a pinned one.
                p.data = torch.empty(p.shape, dtype=p.dtype, pin_memory=pin).copy_(p.data)
            torch.cuda.empty_cache()
        elif self.weights == AdalnWeights.DEVICE:  # resident: on the compute device, wherever they were loaded
            for _, p in self._adaln_parameters():
                p.data = p.data.to(self.device)

    def _adaln_parameters(self):
        for i, block in enumerate(self.dit.blocks):
            for n, p in block.adaln_proj.named_parameters():
                yield f"blocks.{i}.adaln_proj.{n}", p

    def _block_weights(self, index: int, proj: torch.nn.Module) -> dict[str, torch.Tensor] | None:
        """Block `index`'s AdaLN weights on the compute device for making its tables (None: the module's own)."""
        if self.weights == AdalnWeights.DEVICE:
            return None
        if self.weights == AdalnWeights.PINNED:
            return {n: p.to(self.device, non_blocking=True) for n, p in proj.named_parameters()}
        out = {}
        for n, p in proj.named_parameters():  # mapped: read from the page cache (or the disk) into a fresh tensor
            # The checkpoint's name: a run-time adapter's wrapper (`accel.lora`) holds the linear as its `base`.
            name = f"blocks.{index}.adaln_proj.{n}".replace(".base.", ".")
            dtype = torch.float32 if is_fp32_name(name) else self.dit.compute_dtype  # as the loader would place it
            fresh = torch.empty(p.shape, dtype=dtype, device=self.device).copy_(p)
            out[n] = fresh if self.merge is None else self.merge.transform(name, fresh)[name]
        return out

    @torch.no_grad()
    def for_steps(self, timesteps: Sequence[torch.Tensor], adapters: tuple = ()) -> ScheduleTables:
        """Tables for a schedule given as each step's distinct timesteps ((M_i,) float32, as `timestep_plan` gives
        them). Cached by the exact values and `adapters`: the run-time adapter set applied now, where it changes the
        AdaLN projections (`accel.lora.RuntimeAdapters.adaln_key`; the projections are called with it applied)."""
        key = (tuple(v for t in timesteps for v in t.tolist()), tuple(len(t) for t in timesteps), adapters)
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        # Room first, counted in steps: `cache_size` schedules of the default length (what the memory plan counts),
        # so a short schedule (the warmup's one step) does not push out a default one.
        capacity = self.cache_size * DEFAULT_FORWARDS
        keep = len(timesteps) <= capacity
        while self._cache and (not keep or sum(map(len, self._cache.values())) + len(timesteps) > capacity):
            self._cache.popitem(last=False)
        dtype = self.dit.compute_dtype
        pin = self.offloaded and torch.cuda.is_available()
        tembs = [self.dit.time_embedder(t.to(self.device)) for t in timesteps]  # (M_i, time_embed_dim) fp32
        tables: Tables = [[] for _ in timesteps]
        for index, block in enumerate(self.dit.blocks):
            proj = block.adaln_proj
            params = self._block_weights(index, proj)  # off the device: on it only while its tables are made
            for step, temb in enumerate(tembs):
                table = pad_table(proj(temb, dtype) if params is None else functional_call(proj, params, (temb, dtype)))
                if self.offloaded:  # kept in host memory; the step's copy comes in as it starts
                    table = torch.empty(table.shape, dtype=table.dtype, pin_memory=pin).copy_(table)
                tables[step].append(table)
            del params
        made = ScheduleTables(tables, self.device)
        if keep:  # a schedule longer than what is kept is made for its render only
            self._cache[key] = made
        return made
