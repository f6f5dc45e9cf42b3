"""Adapters applied at run time instead of merged (`H3_ADAPTERS`): each linear a declared adapter targets gets its
low-rank delta added beside it, `y = base(x) + (x @ down.T) @ up.T`, from device buffers made once at the rank the
declared adapters need (`checkpoint.adapters.library.buffer_ranks`: the `max_active` largest ranks at each target,
padded to the largest of its role so every block is alike). A switch copies factors into them and changes no shape,
so a compiled graph stays as it is. A forward computes over the rank k adapters need (`buffer_ranks(applied=k)`),
so there is one compiled variant per number of adapters applied (and one without), all compiled by the warmup. The
base may be any linear (BF16, CUTLASS FP8, HUMMING): the delta is its own product in the compute dtype (float32 for
the fp32 heads), its second GEMM accumulating into the base's output. An FP8 base's fused passes hand it quantized
rows (`matmul_rows`): the down projection runs in FP8 on them, the factor quantized per rank row at each switch.

`activate` packs the chosen adapters' factors side by side along the rank (their up factors times the file's
alpha / rank and the request's scale, made in float32, rounded once), zeroes the rest, and sets every wrapper's
width together. With none chosen every wrapper runs its base alone, so a render without an adapter is bit for bit
the plain model's.

A block's AdaLN projection is wrapped like any linear: its modulation tables are made by calling it, so the tables
of an adapter set that changes AdaLN are made with the delta, once per schedule and adapter set
(`AdalnTables.for_steps(key=...)`: `adaln_key`).

Full-rank deltas are refused when the adapters are declared (`AdapterLibrary`): merging (`H3_LORA`) applies them.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from h3serve.accel.linear import FP8, FP8_MAX, Fp8Linear, quantize_rows, quantize_weight
from h3serve.checkpoint.adapters.formats import Names
from h3serve.checkpoint.adapters.library import AdapterLibrary, Catalog, buffer_ranks
from h3serve.checkpoint.adapters.read import is_block_adaln
from h3serve.model.dit import is_fp32_name

log = logging.getLogger(__name__)

# A wrapper's buffers: resident on the compute device, never streamed.
BUFFERS = ("lora_down", "lora_up", "lora_down_q", "lora_down_scale", "wide", "wide_scale")
# The wide GEMM's rank columns hold h_mj / (s_m c_j), c_j = HEADROOM * |down_j| (smaller only where the up factor's
# column would leave FP8's range): typical values in the units to tens, far from 448 and from FP8's subnormals. A
# row whose values would pass 448 anyway is scaled down whole (`LoraLinear.matmul_rows`): nothing saturates.
HEADROOM = 8.0
# Below this room (c_j / (HEADROOM |down_j|)), rows' h values near 4 standard deviations pass 448: `activate` warns.
ROOM_WARNING = 1 / 8


class LoraLinear(nn.Module):
    """A linear with an adapter slot beside it, `rank` = max(`widths`) columns wide. The delta is added only while
    `width` > 0, over the first `width` rank columns (`widths[k - 1]` with k adapters applied).

    Three ways, chosen at construction:
    - `wide` (an FP8 base, resident): the base's weight moves into a wider FP8 buffer, (out, in + rank), whose extra
      columns hold the up factor; one FP8 GEMM computes base and delta, over the input rows extended by the down
      projection's output (`h`, made in FP8 from the same quantized rows). No pass over the output, no second
      GEMM: the base's own row and column scales serve, the rank columns carry `h / (s_m c_j)` and `up c_j / t_n`.
      The base reads a view of the buffer's first `in` columns: without an adapter, the same GEMM on the same bytes.
    - an FP8 base that streams: the down projection in FP8 on the fused pass's rows (`lora_down_q`), the up
      projection's GEMM accumulating into the base's output (`addmm`).
    - any other base: both projections in the compute dtype, the second accumulating into the output.
    `keep_factors` keeps the compute-dtype factors beside the wide buffer (a benchmark's comparison: `use_wide`)."""

    def __init__(
        self,
        base: nn.Module,
        widths: Sequence[int],
        dtype: torch.dtype,
        device: torch.device,
        wide: bool = False,
        keep_factors: bool = False,
    ):
        super().__init__()
        self.base = base
        self.in_features, self.out_features = base.in_features, base.out_features
        self.widths = tuple(widths)
        rank = max(self.widths)
        fp8 = isinstance(base, Fp8Linear)
        self.use_wide = wide and fp8
        zeros = functools.partial(torch.zeros, device=device)
        if not self.use_wide or keep_factors:
            self.register_buffer("lora_down", zeros(rank, self.in_features, dtype=dtype), persistent=False)
            self.register_buffer("lora_up", zeros(self.out_features, rank, dtype=dtype), persistent=False)
            if fp8:  # the down factor's per-rank-row scales, for the FP8 down projection of the addmm way
                self.register_buffer("lora_down_scale", zeros(1, rank, dtype=torch.float32), persistent=False)
        if fp8:
            self.register_buffer("lora_down_q", zeros(rank, self.in_features, dtype=FP8), persistent=False)
        if self.use_wide:
            wide_weight = zeros(self.out_features, self.in_features + rank, dtype=FP8)
            wide_weight[:, : self.in_features].copy_(base.weight)
            self.register_buffer("wide", wide_weight, persistent=False)
            base.register_buffer("weight", wide_weight[:, : self.in_features])  # the same bytes, in the wide rows
            self.register_buffer("wide_scale", zeros(1, rank, dtype=torch.float32), persistent=False)  # a_j / c_j
        self.down_fp8 = fp8  # the addmm way over an FP8 base: the down projection in FP8 (False: dequantized rows)
        self.width = 0

    @torch.no_grad()
    def clear(self) -> None:
        """No adapter in the slot: every factor zero."""
        for name in ("lora_down", "lora_up", "lora_down_q", "lora_down_scale", "wide_scale"):
            if name in self._buffers:
                self._buffers[name].zero_()
        if "wide" in self._buffers:
            self.wide[:, self.in_features :].zero_()

    @torch.no_grad()
    def put(self, cols: slice, rows: slice, down: torch.Tensor, up: torch.Tensor) -> torch.Tensor | None:
        """One adapter's delta at rank columns `cols`, output rows `rows`: `down` (rank, in), `up` (rows, rank) in
        float32, already scaled (alpha / rank times the request's scale). Returns the wide way's room for it (a
        0-d tensor, None elsewhere): 1 where every c_j is HEADROOM |down_j|, less where the up factor's range made it
        smaller (`RuntimeAdapters.activate` reports it)."""
        if "lora_down" in self._buffers:
            self.lora_down[cols].copy_(down)
            self.lora_up[rows, cols].copy_(up)
        if "lora_down_q" not in self._buffers:
            return None
        q, a = quantize_weight(down)  # per rank row: (rank, in) e4m3, (1, rank)
        self.lora_down_q[cols].copy_(q)
        if "lora_down_scale" in self._buffers:
            self.lora_down_scale[:, cols].copy_(a)
        if not self.use_wide:
            return None
        up = up.float()
        t = self.base.scale[0, rows].float()[:, None]  # the base's column scales of these output rows
        # c_j: HEADROOM |down_j|, or less where up_nj c_j / t_n would pass 448 (then h's rows scale down instead)
        fits = (FP8_MAX * t / up.abs().clamp(min=1e-30)).amin(dim=0)
        full = down.float().norm(dim=1).clamp(min=1e-30) * HEADROOM
        c = torch.minimum(full, fits).clamp(min=1e-30)
        self.wide_scale[:, cols].copy_(a / c)
        folded = (up * c / t).clamp(-FP8_MAX, FP8_MAX)  # within range by c's choice; the clamp: rounding
        self.wide[rows, self.in_features + cols.start : self.in_features + cols.stop].copy_(folded.to(FP8))
        return (c / full).amin()

    def set_applied(self, count: int) -> None:
        """`count` adapters applied from the next forward on (0: none): the width they need."""
        self.width = self.widths[count - 1] if count else 0

    def _add_delta(self, y: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """y + h @ up.T over the applied width, the GEMM accumulating into y's rows."""
        rows = y.reshape(-1, self.out_features)
        up = self.lora_up[:, : self.width].t().to(rows.dtype)
        return torch.addmm(rows, h.reshape(-1, self.width).to(rows.dtype), up).reshape(y.shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.width and self.use_wide:
            q, scale = quantize_rows(x.reshape(-1, self.in_features))
            return self.matmul_rows(q, scale, x.dtype).reshape(*x.shape[:-1], self.out_features)
        y = self.base(x)
        if not self.width:
            return y
        h = F.linear(x.reshape(-1, self.in_features).to(self.lora_down.dtype), self.lora_down[: self.width])
        return self._add_delta(y, h)

    def matmul_rows(self, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """An FP8 base on rows its pass already quantized (`accel.fused`); the down projection reads the same rows."""
        width = self.width
        if not width:
            return self.base.matmul_rows(q, scale, dtype)
        down = self.lora_down_q[:width]
        if self.use_wide:
            # h_mj / (s_m c_j) = (q_m . down_q_j) a_j / c_j, beside the rows; a row whose values would pass FP8's
            # 448 is scaled down whole by r_m (its row scale up by as much): r_m = 1, the rows as they were, exactly
            h = torch._scaled_mm(q, down.t(), scale_a=torch.ones_like(scale), scale_b=self.wide_scale[:, :width],
                                 out_dtype=torch.float32, use_fast_accum=True)  # fmt: skip
            r = (h.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1.0)
            rows = torch.cat([(q.float() / r).to(FP8), (h / r).clamp(-FP8_MAX, FP8_MAX).to(FP8)], dim=1)
            return self.base.matmul_rows(rows, scale * r, dtype, weight=self.wide[:, : self.in_features + width])
        y = self.base.matmul_rows(q, scale, dtype)
        if self.down_fp8:
            down_scale = self.lora_down_scale[:, :width].contiguous()
            h = torch._scaled_mm(q, down.t(), scale_a=scale, scale_b=down_scale, out_dtype=self.lora_up.dtype,
                                 use_fast_accum=True)  # fmt: skip
        else:
            h = F.linear((q.to(torch.float32) * scale).to(self.lora_down.dtype), self.lora_down[:width])
        return self._add_delta(y, h)


@dataclass(frozen=True)
class Activation:
    """What one `activate` did: the adapters now applied, the seconds it took and, of those, the reads from disk (an
    adapter the host cache had given up)."""

    chosen: tuple[tuple[str, float], ...]
    seconds: float
    read_seconds: float
    switched: bool  # False: the same set as before, nothing copied
    # The wide GEMM's room (`LoraLinear.put`): 1, or less where an up factor is large beside its base's weights; below
    # ROOM_WARNING typical rows' h passes FP8's range and those rows are scaled down whole (more error than merged).
    room: float = 1.0


class RuntimeAdapters:
    """The declared adapters (`library`) that suit the DiT of `kind` (a preset for the other DiT is left out), applied
    at run time to `dit`: `activate([(name, scale), ...])` before a forward, `activate([])` for the plain model.
    Wrapping happens here, once, after the profile's linears are made and before the placement streams any block;
    every buffer is on `device` in `dtype` (the DiT's compute dtype; float32 at an fp32 head). `wide`: FP8 bases
    take the delta into their own GEMM (`LoraLinear`); off where the placement streams blocks (a streamed weight
    is copied into its slot as it is, not into a wide buffer)."""

    def __init__(
        self,
        dit: nn.Module,
        library: AdapterLibrary,
        kind: str | None,
        dtype: torch.dtype,
        device,
        wide: bool = True,
        keep_factors: bool = False,
    ):
        self.library = library
        self.device = torch.device(device)
        usable = {n: e for n, e in library.catalog.entries.items() if e.dit_kind in (None, kind)}
        self.names = tuple(usable)
        self.adaln = frozenset(n for n, e in usable.items() if any(is_block_adaln(t) for t in e.ranks))
        shapes, most = Names.of(dit.config).shapes, library.catalog.max_active
        widths = [buffer_ranks(Catalog(usable, most), shapes, applied=k) for k in range(1, most + 1)]
        self.linears: dict[str, LoraLinear] = {}
        for target in widths[-1]:
            parent_name, _, leaf = target.removesuffix(".weight").rpartition(".")
            parent = dit.get_submodule(parent_name)
            base = getattr(parent, leaf)
            dtype_here = torch.float32 if is_fp32_name(target) else dtype
            wrapped = LoraLinear(base, [w[target] for w in widths], dtype_here, self.device, wide, keep_factors)
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
            linear.clear()
        filled: dict[str, int] = {}
        rooms: list[torch.Tensor] = []
        for name, scale in chosen:
            adapter, seconds = self.library.get(name)
            read += seconds
            for d in adapter.deltas:
                linear = self.linears[d.target]
                first = filled.get(d.target, 0)
                cols = slice(first, first + d.rank)
                down = d.down.to(self.device, non_blocking=True)
                # Out of place: on a CPU `.to` returns the library's own tensor.
                up = d.up.to(self.device, non_blocking=True).to(torch.float32) * (d.scale * scale)
                room = linear.put(cols, slice(d.row, d.row + up.shape[0]), down, up)
                if room is not None:
                    rooms.append(room)
                filled[d.target] = first + d.rank
        for linear in self.linears.values():
            linear.set_applied(len(chosen))
        room = float(torch.stack(rooms).amin()) if rooms else 1.0  # one sync, which the switch needs anyway
        if self.linears and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.chosen = chosen
        if room < ROOM_WARNING:
            log.warning(
                "adapters %s: an up factor is large beside its base's FP8 weights (room %.3f of the wide GEMM's, "
                "below %.3f): rows whose low-rank projection passes FP8's range are scaled down whole, at more error "
                "than the adapter merged; merge it (H3_LORA) where that matters",
                ", ".join(n for n, _ in chosen), room, ROOM_WARNING,
            )  # fmt: skip
        return Activation(chosen, time.perf_counter() - start, read, True, room)

    @property
    def buffer_bytes(self) -> int:
        """Device memory the adapters' buffers take (of a wide buffer, its rank columns: the rest is the base's)."""
        total = 0
        for m in self.linears.values():
            for name, t in m.named_buffers(recurse=False):
                size = t.numel() - (m.out_features * m.in_features if name == "wide" else 0)
                total += size * t.element_size()
        return total
