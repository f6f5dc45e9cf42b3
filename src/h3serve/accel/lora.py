"""Adapters applied at run time instead of merged (issue 57, the engine's side; not yet reachable from a request): each
linear an adapter targets gets its low-rank delta added beside it, `y = base(x) + (x @ down.T) @ up.T`, from buffers
made once, at the rank every declared adapter together needs, so switching adapters copies into them and changes no
shape (a compiled graph stays as it is). The base may be any linear (BF16, CUTLASS FP8, HUMMING): the delta is its
own product in the compute dtype.

A target's buffers hold, side by side along the rank, every delta that may land on it: its own rank slice for each
(the fused QKV takes q's, k's and v's factors in their rows). `activate` fills the slices of the chosen adapters
(their up factors times the file's alpha/rank and the request's scale, made in float32, rounded once) and zeroes the
rest; a target none of them touches runs its base alone, so a forward with no adapter active is bit for bit the
plain model's.

What is refused (an `AdapterError` naming the file and key), where merging (`H3_LORA`) stays the way: full-rank
deltas (a bias or a norm's difference), and adapters that change an AdaLN projection (its modulation tables are
made from the weights, once per schedule: per adapter, they are not made yet).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from h3serve.checkpoint.adapters.formats import AdapterError, Delta
from h3serve.checkpoint.adapters.read import Adapter, is_adaln


class LoraLinear(nn.Module):
    """A linear with an adapter's slot beside it: `down` (rank, in) and `up` (out, rank) in the compute dtype; the
    delta is added only while `active`."""

    def __init__(self, base: nn.Module, in_features: int, out_features: int, rank: int, dtype, device):
        super().__init__()
        self.base = base
        self.register_buffer("down", torch.zeros(rank, in_features, dtype=dtype, device=device), persistent=False)
        self.register_buffer("up", torch.zeros(out_features, rank, dtype=dtype, device=device), persistent=False)
        self.active = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if not self.active:
            return y
        return y + F.linear(F.linear(x.to(self.down.dtype), self.down), self.up).to(y.dtype)


@dataclass(frozen=True)
class _Slice:
    """Where one delta lives in its target's buffers: rank columns `start : start + rank`, output rows from `row`."""

    adapter: str
    delta: Delta
    start: int


class RuntimeAdapters:
    """The declared adapters, by name, applied at run time to `dit`: `activate([(name, scale), ...])` before a forward,
    `activate([])` for the plain model. Wrapping happens here, once; every target's buffers are on the device of its
    linear, in `dtype` (the DiT's compute dtype)."""

    def __init__(self, dit: nn.Module, adapters: Mapping[str, Adapter], dtype: torch.dtype):
        self.adapters = dict(adapters)
        slices: dict[str, list[_Slice]] = {}
        for name, adapter in self.adapters.items():
            full = next((d for d in adapter.deltas if d.down is None), None)
            if full is not None:
                raise AdapterError(adapter.path, f"has a full-rank delta on {full.target}: merge it at load (H3_LORA) "
                                   "instead of applying it per request", key=full.key)  # fmt: skip
            if adapter.touches_adaln:
                first = next(d for d in adapter.deltas if is_adaln(d.target))
                raise AdapterError(adapter.path, "changes an AdaLN projection: merge it at load (H3_LORA) instead of "
                                   "applying it per request", key=first.key)  # fmt: skip
            for delta in adapter.deltas:
                target = slices.setdefault(delta.target, [])
                start = target[-1].start + target[-1].delta.rank if target else 0
                target.append(_Slice(name, delta, start))
        self._slices = slices
        self.linears: dict[str, LoraLinear] = {}
        for target, parts in slices.items():
            module_name = target.removesuffix(".weight")
            parent_name, _, leaf = module_name.rpartition(".")
            parent = dit.get_submodule(parent_name)
            base = getattr(parent, leaf)
            if not target.endswith(".weight") or not hasattr(base, "in_features"):
                raise AdapterError(self.adapters[parts[0].adapter].path, f"targets {target}, which is no linear's "
                                   "weight", key=parts[0].delta.key)  # fmt: skip
            rank = parts[-1].start + parts[-1].delta.rank
            device = next(base.parameters()).device
            wrapped = LoraLinear(base, base.in_features, base.out_features, rank, dtype, device)
            setattr(parent, leaf, wrapped)
            self.linears[target] = wrapped
        self.chosen: tuple[tuple[str, float], ...] = ()

    @torch.no_grad()
    def activate(self, chosen: Sequence[tuple[str, float]]) -> None:
        """Apply these adapters with these scales from the next forward on (none: the plain model)."""
        scales = dict(chosen)
        unknown = [name for name in scales if name not in self.adapters]
        if unknown or len(scales) != len(chosen):
            raise ValueError(f"adapters must be declared ones, each once: {', '.join(self.adapters) or 'none'}; got "
                             f"{[name for name, _ in chosen]}")  # fmt: skip
        for target, parts in self._slices.items():
            linear = self.linears[target]
            linear.down.zero_()
            linear.up.zero_()
            used = [p for p in parts if p.adapter in scales]
            for p in used:
                d, rank = p.delta, p.delta.rank
                up = d.up.to(torch.float32) * (d.scale * self.adapters[p.adapter].scale * scales[p.adapter])
                linear.down[p.start : p.start + rank].copy_(d.down)
                linear.up[d.row : d.row + up.shape[0], p.start : p.start + rank].copy_(up)
            linear.active = bool(used)
        self.chosen = tuple(chosen)

    @property
    def buffer_bytes(self) -> int:
        """Device memory the adapters' buffers take."""
        return sum(m.down.numel() * m.down.element_size() + m.up.numel() * m.up.element_size()
                   for m in self.linears.values())  # fmt: skip
