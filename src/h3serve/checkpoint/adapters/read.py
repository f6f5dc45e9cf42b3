"""Reading an adapter file (`read_adapter`): every tensor mapped onto one of the DiT's native tensors and checked.

An adapter is read once against the DiT's config: every tensor of the file is mapped onto one of our native tensors
(`H3DiT.state_dict()` names, QKV rows stacked `[q; k; v]`, fc1 rows `[gate; value]`, in `checkpoint.rows`' orders)
and its shape checked before any weight changes. Its format (`formats`) decides the names and row orders, its file
the preset (`presets`); merging is `merge`'s.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from h3serve.checkpoint.adapters.formats import (
    AdapterError,
    AdapterFormat,
    Delta,
    Layout,
    Names,
    Slot,
    detect_layout,
    split_key,
)
from h3serve.checkpoint.adapters.presets import Preset, num, preset_of
from h3serve.checkpoint.rows import deinterleave_qkv, swap_halves
from h3serve.config import DiTConfig
from h3serve.files import FileRefused, open_regular


@dataclass(frozen=True)
class Adapter:
    """A validated adapter file: its deltas on our native tensor names, and what is known about it."""

    path: Path
    format: str
    scale: float  # the user's multiplier (PATH:SCALE)
    targets: int  # native tensors it changes (our fused QKV counts once for q, k and v)
    ranks: tuple[int, ...]  # distinct ranks of its low-rank factors
    alpha_scale: tuple[float, ...]  # distinct alpha / rank scales of its low-rank factors
    touches_adaln: bool  # changes an AdaLN projection (the modulation tables must come from merged weights)
    preset: Preset | None
    preset_note: str  # where the preset came from, or why there is none
    shapes: Mapping[str, tuple[int, ...]] = field(repr=False, compare=False)  # target -> its shape in the DiT
    deltas: tuple[Delta, ...] = field(repr=False, compare=False)

    def describe(self) -> str:
        full = sum(d.down is None for d in self.deltas)
        ranks = "/".join(str(r) for r in self.ranks) or "-"
        alpha = "/".join(num(a) for a in self.alpha_scale) or "-"
        extra = f" + {full} full-rank deltas" if full else ""
        adaln = ", touches AdaLN" if self.touches_adaln else ""
        preset = "unknown" if self.preset is None else self.preset.describe()
        return (
            f"{self.path.name}: {self.format}, {self.targets} targets{extra}, rank {ranks}, alpha/rank {alpha}, "
            f"scale {num(self.scale)}{adaln}; preset: {preset} ({self.preset_note})"
        )


def read_adapter(path: Path | str, scale: float = 1.0, *, config: DiTConfig) -> Adapter:
    """Read and validate an adapter file against the DiT of `config`: every key must map to one of its tensors with
    the right shape. Nothing is merged here; an AdapterError names the file, the key and both shapes."""
    path = Path(path)
    if not math.isfinite(scale):
        raise AdapterError(path, f"scale must be a finite number, got {scale!r}")
    try:
        with open_regular(path) as fd:  # a FIFO or a device is refused, never opened to block or read without end
            # The descriptor's own path where there is one: the file checked is the file read, even if the path is
            # swapped meanwhile. No cap: adapters are large, and safetensors maps the file rather than reading it.
            fd_path = f"/proc/self/fd/{fd}"
            handle = safe_open(fd_path if os.path.exists(fd_path) else str(path), framework="pt", device="cpu")
    except FileRefused as err:
        raise AdapterError(path, err.reason) from None
    except Exception as err:  # safetensors raises its own error types for a corrupt header
        raise AdapterError(path, f"not a readable safetensors file: {err}") from err
    meta = dict(handle.metadata() or {})
    keys = list(handle.keys())
    if not keys:
        raise AdapterError(path, "holds no tensors")
    names = Names.of(config)
    layout = detect_layout(path, keys, meta, names, lambda k: handle.get_slice(k).get_shape())
    modules = _group(path, keys, layout)
    tensors = {k: handle.get_tensor(k).clone() for k in keys}  # owned copies, not views into the file's mapping
    file = _File(path, layout, names, config, tensors, _metadata_alpha(path, meta, layout))
    deltas: list[Delta] = []
    for module, roles in sorted(modules.items()):
        deltas.extend(file.deltas(module, roles))
    _check_overlaps(path, deltas)
    if layout.format is AdapterFormat.FLASHGEN_NATIVE and "lora_rank" in meta:
        ranks = {d.rank for d in deltas if d.rank is not None}
        if ranks != {_int(path, meta, "lora_rank")}:
            raise AdapterError(
                path, f"metadata lora_rank={meta['lora_rank']} but its factors have ranks {sorted(ranks)}"
            )
    preset, note = preset_of(path, layout, meta, deltas, config)
    targets = sorted({d.target for d in deltas})
    return Adapter(
        path=path,
        format=str(layout.format),
        scale=float(scale),
        targets=len(targets),
        ranks=tuple(sorted({d.rank for d in deltas if d.rank is not None})),
        alpha_scale=tuple(sorted({d.scale for d in deltas if d.down is not None})),
        touches_adaln=any(is_adaln(t) for t in targets),
        preset=preset,
        preset_note=note,
        shapes={t: names.shapes[t] for t in targets},
        deltas=tuple(deltas),
    )


def _group(path: Path, keys: Sequence[str], layout: Layout) -> dict[str, dict[str, str]]:
    """module name (in the file's naming, prefix stripped) -> role -> file key."""
    modules: dict[str, dict[str, str]] = {}
    for key in keys:
        split = split_key(key)
        if split is None or split[2] not in layout.families:
            raise AdapterError(path, f"is not a tensor a {layout.format} adapter holds", key=key)
        module, role, _ = split
        if layout.prefix and module.startswith(layout.prefix):
            module = module[len(layout.prefix) :]
        elif layout.prefix and layout.format is not AdapterFormat.FLASHGEN_NATIVE:
            raise AdapterError(path, f"lacks the {layout.prefix!r} prefix its other keys carry", key=key)
        if module in modules and role in modules[module]:
            raise AdapterError(path, f"duplicates {modules[module][role]!r} (same module and role)", key=key)
        modules.setdefault(module, {})[role] = key
    return modules


@dataclass(frozen=True)
class _File:
    """One adapter file being read: what every module's deltas are made from (its path for messages, its format's
    layout, the DiT's names and config, the file's tensors and its metadata alpha)."""

    path: Path
    layout: Layout
    names: Names
    config: DiTConfig
    tensors: Mapping[str, torch.Tensor]
    alpha_meta: float | None

    def deltas(self, module: str, roles: Mapping[str, str]) -> list[Delta]:
        """The deltas of one module of the file (`roles`: role -> file key)."""
        any_key = next(iter(roles.values()))
        slot = self._slot(module, any_key)
        out: list[Delta] = []
        if "up" in roles or "down" in roles or "alpha" in roles:
            out.append(self._low_rank(slot, roles))
        for role, suffix in (("diff", "weight"), ("diff_b", "bias")):
            if role in roles:
                out.append(self._full(slot, f"{slot.target}.{suffix}", roles[role]))
        if "set_weight" in roles:  # any module this DiT has is not a gate: the name alone is wrong
            raise AdapterError(
                self.path, "assigns a whole parameter, which no H3 adapter may do to this DiT", key=roles["set_weight"]
            )
        return out

    def _slot(self, module: str, key: str) -> Slot:
        names, naming = self.names, self.layout.naming
        if naming == "diffusers":
            slot = names.diffusers.get(module)
        elif naming == "flat":
            slot = Slot(names.flat[module]) if module in names.flat else None
        else:
            slot = Slot(module) if module in names.native else None
        if slot is None:
            hint = ""
            if key.endswith(".set_weight"):
                hint = (
                    " (a sparse-attention gate of FastH3's VSA variant: this DiT has dense attention; use the dense "
                    "file)"
                )
            raise AdapterError(
                self.path,
                f"names module {module!r}, which this DiT ({self.config.num_layers} blocks, "
                f"{self.config.token_refiner_num_layers} refiner blocks) does not have{hint}",
                key=key,
            )
        return slot

    def _reorder(self, t: torch.Tensor, slot: Slot, target: str) -> torch.Tensor:
        """A B factor's or a full delta's rows in our order."""
        if slot.swap:
            t = swap_halves(t)
        if self.layout.qkv_interleaved and target.endswith("attn.qkv_proj.weight"):
            t = deinterleave_qkv(t, self.config.num_attention_heads)
        return t.contiguous()

    def _low_rank(self, slot: Slot, roles: Mapping[str, str]) -> Delta:
        path = self.path
        if "up" not in roles or "down" not in roles:
            have = ", ".join(sorted(roles))
            raise AdapterError(
                path, f"is one of {have} for its module, without both LoRA factors", key=min(roles.values())
            )
        up_key, down_key = roles["up"], roles["down"]
        up, down = self.tensors[up_key], self.tensors[down_key]
        target = f"{slot.target}.weight"
        shape = self.names.shapes.get(target)
        if shape is None:
            raise AdapterError(path, f"targets {slot.target!r}, which has no weight in this DiT", key=up_key)
        rows = _rows(slot, shape)
        fits = (
            len(shape) == 2
            and up.ndim == 2
            and down.ndim == 2
            and up.shape[1] == down.shape[0]
            and up.shape[0] == rows
            and down.shape[1] == shape[1]
            and up.is_floating_point()
            and down.is_floating_point()
        )
        if not fits:
            part = "" if slot.rows is None else f" (rows {slot.row}:{slot.row + slot.rows} of it)"
            raise AdapterError(
                path,
                f"B {list(up.shape)} and {down_key!r} A {list(down.shape)} do not fit {target} {list(shape)}{part}"
                + _pruned_hint(target),
                key=up_key,
            )
        rank = down.shape[0]
        if self.layout.format in (AdapterFormat.FASTH3, AdapterFormat.FASTVIDEO):
            file_scale = 1.0  # FastVideo's reconstruction adds B @ A as it is
        elif "alpha" in roles:
            alpha = self.tensors[roles["alpha"]]
            if alpha.numel() != 1:
                raise AdapterError(
                    path, f"an alpha must be one number, got shape {list(alpha.shape)}", key=roles["alpha"]
                )
            file_scale = float(alpha.float().item()) / rank
        elif self.alpha_meta is not None:
            file_scale = self.alpha_meta / rank
        else:
            file_scale = 1.0
        if not math.isfinite(file_scale):
            raise AdapterError(path, f"alpha / rank is not finite ({file_scale})", key=roles.get("alpha", up_key))
        return Delta(target, slot.row, self._reorder(up, slot, target), down.contiguous(), file_scale, up_key)

    def _full(self, slot: Slot, target: str, key: str) -> Delta:
        delta = self.tensors[key]
        shape = self.names.shapes.get(target)
        if shape is None:
            raise AdapterError(self.path, f"is a delta for {target}, which this DiT does not have", key=key)
        want = (_rows(slot, shape), *shape[1:])
        if tuple(delta.shape) != want or not delta.is_floating_point():
            raise AdapterError(
                self.path,
                f"shape {list(delta.shape)} does not fit {target} {list(shape)} (expected {list(want)})"
                + _pruned_hint(target),
                key=key,
            )
        return Delta(target, slot.row, self._reorder(delta, slot, target), None, 1.0, key)


def _rows(slot: Slot, shape: tuple[int, ...]) -> int:
    return shape[0] if slot.rows is None else slot.rows


def _pruned_hint(target: str) -> str:
    if is_adaln(target):
        return "; an AdaLN projection of another width: an adapter trained on a pruned base (AdaLN removed)?"
    return ""


def is_adaln(name: str) -> bool:
    return ".adaln_proj." in name or name.startswith("final_layer.adaln_proj.")


def is_block_adaln(name: str) -> bool:
    """Whether a DiT tensor name is a block's AdaLN projection (made into tables once per schedule, never run in a
    forward)."""
    return name.startswith("blocks.") and ".adaln_proj." in name


def _check_overlaps(path: Path, deltas: Sequence[Delta]) -> None:
    """Two modules of one file may not land on the same rows (q and k of one block never do; a file holding both
    `to_q` and `qkv_proj` names is malformed and was refused by its naming already)."""
    seen: dict[tuple[str, int, bool], str] = {}
    for d in deltas:
        slot = (d.target, d.row, d.down is None)
        if slot in seen:
            raise AdapterError(path, f"lands on the same rows of {d.target} as {seen[slot]!r}", key=d.key)
        seen[slot] = d.key


def _metadata_alpha(path: Path, meta: Mapping[str, str], layout: Layout) -> float | None:
    key = "lora_alpha" if layout.format is AdapterFormat.FLASHGEN_NATIVE else "alpha"
    if layout.format in (AdapterFormat.FASTH3, AdapterFormat.FASTVIDEO) or key not in meta:
        return None
    try:
        alpha = float(meta[key])
    except ValueError:
        raise AdapterError(path, f"metadata {key}={meta[key]!r} is not a number") from None
    if not math.isfinite(alpha) or alpha <= 0:
        raise AdapterError(path, f"metadata {key}={meta[key]!r} must be a positive number")
    return alpha


def _int(path: Path, meta: Mapping[str, str], key: str) -> int:
    try:
        return int(meta[key])
    except ValueError:
        raise AdapterError(path, f"metadata {key}={meta[key]!r} is not an integer") from None
