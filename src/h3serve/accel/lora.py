"""Adapters applied at run time instead of merged (`H3_ADAPTERS`): each linear a declared adapter targets gets its
low-rank delta added beside it, `y = base(x) + (x @ down.T) @ up.T`, from device buffers made once at the rank the
declared adapters need (`checkpoint.adapters.library.buffer_ranks`: the `max_active` largest ranks at each target,
padded to the largest of its role so every block is alike). A switch copies factors into them and changes no shape,
so a compiled graph stays as it is. The base may be any linear (BF16, CUTLASS FP8, HUMMING): the delta is its own
product in the compute dtype (float32 for the fp32 heads), its second GEMM accumulating into the base's output. An
FP8 base's fused passes hand it quantized rows (`matmul_rows`): the delta reads them dequantized, the input a merged
FP8 weight would have read.

`activate` packs the chosen adapters' factors side by side along the rank (their up factors times the file's
alpha / rank and the request's scale, made in float32, rounded once), zeroes the rest, and turns every wrapper on or
off together (two compiled variants at most: on and off). With none chosen every wrapper runs its base alone, so a
render without an adapter is bit for bit the plain model's.

A block's AdaLN projection is wrapped like any linear: its modulation tables are made by calling it, so the tables
of an adapter set that changes AdaLN are made with the delta, once per schedule and adapter set
(`AdalnTables.for_steps(key=...)`: `adaln_key`).

Full-rank deltas are refused when the adapters are declared (`AdapterLibrary`): merging (`H3_LORA`) applies them.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from h3serve.checkpoint.adapters.formats import Names
from h3serve.checkpoint.adapters.library import AdapterLibrary, Catalog, buffer_ranks
from h3serve.checkpoint.adapters.read import is_block_adaln
from h3serve.model.dit import is_fp32_name

# A wrapper's buffers: resident on the compute device, never streamed.
BUFFERS = ("lora_down", "lora_up")


class LoraLinear(nn.Module):
    """A linear with an adapter slot beside it: `lora_down` (rank, in) and `lora_up` (out, rank); the delta is added
    only while `active`, by the up projection's GEMM accumulating into the base's output (`addmm`: no delta tensor and
    no separate add pass over it)."""

    def __init__(self, base: nn.Module, rank: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.base = base
        self.in_features, self.out_features = base.in_features, base.out_features
        self.register_buffer("lora_down", torch.zeros(rank, self.in_features, dtype=dtype, device=device),
                             persistent=False)  # fmt: skip
        self.register_buffer("lora_up", torch.zeros(self.out_features, rank, dtype=dtype, device=device),
                             persistent=False)  # fmt: skip
        self.active = False

    def _add_delta(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """y + (x @ down.T) @ up.T, the second GEMM accumulating into y's rows."""
        rows = y.reshape(-1, self.out_features)
        h = F.linear(x.reshape(-1, self.in_features).to(self.lora_down.dtype), self.lora_down)
        return torch.addmm(rows, h.to(rows.dtype), self.lora_up.t().to(rows.dtype)).reshape(y.shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        return self._add_delta(y, x) if self.active else y

    def matmul_rows(self, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """An FP8 base on rows its pass already quantized (`accel.fused`); the delta reads them dequantized."""
        y = self.base.matmul_rows(q, scale, dtype)
        if not self.active:
            return y
        return self._add_delta(y, (q.to(torch.float32) * scale).to(self.lora_down.dtype))


@dataclass(frozen=True)
class Activation:
    """What one `activate` did: the adapters now applied, the seconds it took and, of those, the reads from disk (an
    adapter the host cache had given up)."""

    chosen: tuple[tuple[str, float], ...]
    seconds: float
    read_seconds: float
    switched: bool  # False: the same set as before, nothing copied


class RuntimeAdapters:
    """The declared adapters (`library`) that suit the DiT of `kind` (a preset for the other DiT is left out), applied
    at run time to `dit`: `activate([(name, scale), ...])` before a forward, `activate([])` for the plain model.
    Wrapping happens here, once, after the profile's linears are made and before the placement streams any block;
    every buffer is on `device` in `dtype` (the DiT's compute dtype; float32 at an fp32 head)."""

    def __init__(self, dit: nn.Module, library: AdapterLibrary, kind: str | None, dtype: torch.dtype, device):
        self.library = library
        usable = {n: e for n, e in library.catalog.entries.items() if e.dit_kind in (None, kind)}
        self.names = tuple(usable)
        self.adaln = frozenset(n for n, e in usable.items() if any(is_block_adaln(t) for t in e.ranks))
        ranks = buffer_ranks(Catalog(usable, library.catalog.max_active), Names.of(dit.config).shapes)
        self.linears: dict[str, LoraLinear] = {}
        for target, rank in ranks.items():
            parent_name, _, leaf = target.removesuffix(".weight").rpartition(".")
            parent = dit.get_submodule(parent_name)
            base = getattr(parent, leaf)
            wrapped = LoraLinear(base, rank, torch.float32 if is_fp32_name(target) else dtype, torch.device(device))
            setattr(parent, leaf, wrapped)
            self.linears[target] = wrapped
        self.chosen: tuple[tuple[str, float], ...] = ()

    def adaln_key(self, chosen: Sequence[tuple[str, float]] | None = None) -> tuple:
        """What a schedule's AdaLN tables depend on besides the timesteps: the chosen set when one of them changes a
        block's AdaLN projection, else nothing (the plain tables serve)."""
        chosen = self.chosen if chosen is None else tuple(chosen)
        return chosen if any(name in self.adaln for name, _ in chosen) else ()

    @torch.no_grad()
    def activate(self, chosen: Sequence[tuple[str, float]]) -> Activation:
        """Apply these adapters with these scales from the next forward on (none: the plain model)."""
        chosen = tuple((name, float(scale)) for name, scale in chosen)
        names = [name for name, _ in chosen]
        if any(n not in self.names for n in names) or len(set(names)) != len(names):
            declared = ", ".join(self.names) or "none"
            raise ValueError(f"adapters must be declared ones for this DiT, each once: {declared}; got {names}")
        if len(chosen) > self.library.catalog.max_active:
            raise ValueError(f"at most {self.library.catalog.max_active} adapters at once; got {len(chosen)}")
        if chosen == self.chosen:
            return Activation(chosen, 0.0, 0.0, False)
        start, read = time.perf_counter(), 0.0
        for linear in self.linears.values():
            linear.lora_down.zero_()
            linear.lora_up.zero_()
        filled: dict[str, int] = {}
        for name, scale in chosen:
            adapter, seconds = self.library.get(name)
            read += seconds
            for d in adapter.deltas:
                linear = self.linears[d.target]
                first = filled.get(d.target, 0)
                cols = slice(first, first + d.rank)
                linear.lora_down[cols].copy_(d.down, non_blocking=True)
                # Out of place: on a CPU `.to` returns the library's own tensor.
                up = d.up.to(linear.lora_up.device, non_blocking=True).to(torch.float32) * (d.scale * scale)
                linear.lora_up[d.row : d.row + up.shape[0], cols].copy_(up)
                filled[d.target] = first + d.rank
        for linear in self.linears.values():
            linear.active = bool(chosen)
        if self.linears and next(iter(self.linears.values())).lora_up.is_cuda:
            torch.cuda.synchronize(next(iter(self.linears.values())).lora_up.device)
        self.chosen = chosen
        return Activation(chosen, time.perf_counter() - start, read, True)

    @property
    def buffer_bytes(self) -> int:
        """Device memory the adapters' buffers take."""
        return sum(t.numel() * t.element_size() for m in self.linears.values() for t in m.buffers(recurse=False))
