"""The sampler a few-step adapter was trained for (`Preset`), from what its file states.

Presets (the sampler an adapter was trained for, from its model card) come only from what the file states: FastH3's
identity; FlashGen's `base_schedule` / `tasks`; the published LightX2V file names
`minimax_h3_{fl2v|ref2v}_turbo_{N}step_v{X.Y}[_768p][_comfyui][_bf16].safetensors` (the only place LightX2V records
steps and resolution: 768p trains at video shift 6, 544p at 12); LightX2V's metadata alpha 128 at rank 128 (only
the 4-step v1.0 / v1.1 768p files have it); larryvrh's key signature (every block's attention, FFN and AdaLN plus the
final AdaLN, rank 64 with rank 16 on the AdaLN, no alpha; the card says 6-8 forwards, we take 8). Anything else --
alpha 8 LightX2V files, which are four variants -- keeps `preset=None`, and `describe` says why. No published file's
metadata carries `num_inference_steps` or shift entries, so none are read.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

from h3serve.checkpoint.adapters.formats import AdapterError, AdapterFormat, Delta, Layout
from h3serve.config import DiTConfig


@dataclass(frozen=True)
class Preset:
    """The sampler an adapter was trained for; a None field is not known."""

    steps: int | None  # grid points (num_inference_steps), terminal zero included: 5 for a 4-step adapter
    video_shift: float | None
    audio_shift: float | None
    sigmas: tuple[float, ...] | None = None  # the adapter's own positions before the shift
    tasks: tuple[str, ...] | None = None  # the tasks it was distilled for, when restricted
    dit_kind: str | None = None  # vocab.DiTKind value of the DiT it was trained on

    @property
    def points(self) -> int | None:
        """The grid points it runs: its own sigma positions' count, else `steps`."""
        return len(self.sigmas) if self.sigmas else self.steps

    def describe(self) -> str:
        parts = []
        if self.steps is not None:
            parts.append(f"{self.steps} steps")
        if self.video_shift is not None or self.audio_shift is not None:
            parts.append(f"shift {num(self.video_shift)}/{num(self.audio_shift)}")
        if self.sigmas is not None:
            parts.append("sigmas " + ",".join(num(s) for s in self.sigmas))
        if self.tasks is not None:
            parts.append("tasks " + ",".join(self.tasks))
        if self.dit_kind is not None:
            parts.append(f"{self.dit_kind} DiT")
        return ", ".join(parts) or "nothing known"


def num(x: float | None) -> str:
    return "?" if x is None else f"{x:g}"


_FASTH3_PRESET = Preset(
    steps=5, video_shift=12.0, audio_shift=3.0, sigmas=(0.999, 0.749, 0.5, 0.25, 0.0), tasks=("t2va",), dit_kind="fl2va"
)
_LIGHTX2V_NAME = re.compile(
    r"^minimax_h3_(?P<task>fl2v|ref2v)_turbo_(?P<steps>\d+)step_v\d+\.\d+(?P<res>_768p)?(?:_comfyui)?(?:_bf16)?"
    r"\.safetensors$"
)
_LARRYVRH_PRESET = Preset(steps=9, video_shift=12.0, audio_shift=3.0)


def preset_of(
    path: Path, layout: Layout, meta: Mapping[str, str], deltas: Sequence[Delta], config: DiTConfig
) -> tuple[Preset | None, str]:
    """The sampler the file says it was trained for (None when it says nothing), and where that came from or why
    nothing is known."""
    fmt = layout.format
    if fmt is AdapterFormat.FASTH3:
        return _FASTH3_PRESET, f"FastH3 release {meta.get('finetuned_model')!r}"
    if fmt is AdapterFormat.FASTVIDEO:
        return None, "a FastVideo adapter that does not name the FastH3 release"
    if fmt is AdapterFormat.FLASHGEN_NATIVE:
        return _flashgen_preset(path, meta)
    if fmt in (AdapterFormat.LIGHTX2V_DIFFUSERS, AdapterFormat.COMFYUI_FUSED):
        named = _LIGHTX2V_NAME.match(path.name)
        if named is not None:
            forwards = int(named["steps"])
            kind = "ref2va" if named["task"] == "ref2v" else "fl2va"
            shift = 6.0 if named["res"] else 12.0
            return Preset(forwards + 1, shift, 3.0, dit_kind=kind), "from LightX2V's published file name"
        ranks = {d.rank for d in deltas if d.rank is not None}
        if fmt is AdapterFormat.LIGHTX2V_DIFFUSERS and meta.get("alpha") is not None:
            if ranks == {128} and float(meta["alpha"]) == 128.0:
                return Preset(5, 6.0, 3.0, dit_kind="fl2va"), "LightX2V alpha 128 at rank 128: 4-step v1.0/v1.1 768p"
            return None, (
                f"LightX2V alpha {meta['alpha']} is shared by 4-step v1.2, 8-step 544p/768p and ref2v 8-step; "
                "set steps and shifts from its model card"
            )
        if fmt is AdapterFormat.LIGHTX2V_DIFFUSERS:
            return None, "LightX2V file without alpha metadata (diffusers' rule: scale 1; vLLM-Omni uses alpha 8)"
        return None, "a LightX2V ComfyUI conversion whose variant the file does not state (renamed?)"
    if fmt is AdapterFormat.NATIVE and _is_larryvrh(deltas, config):
        return _LARRYVRH_PRESET, "larryvrh turbo signature (rank 64, AdaLN rank 16, no alpha); its card: 6-8 forwards"
    return None, "the file does not say which sampler it was trained for"


def _flashgen_preset(path: Path, meta: Mapping[str, str]) -> tuple[Preset, str]:
    sigmas = None
    if "base_schedule" in meta:
        try:
            sigmas = tuple(float(p) for p in meta["base_schedule"].split(",") if p.strip())
        except ValueError:
            raise AdapterError(
                path, f"metadata base_schedule={meta['base_schedule']!r} is not comma-separated numbers"
            ) from None
        ok = len(sigmas) >= 2 and all(math.isfinite(s) for s in sigmas) and sigmas[-1] == 0.0
        if not ok or any(a <= b for a, b in pairwise(sigmas)) or sigmas[0] > 1.0:
            raise AdapterError(
                path, f"metadata base_schedule={meta['base_schedule']!r} must decrease strictly from <= 1 to 0"
            )
    tasks = tuple(t.strip().lower() for t in meta.get("tasks", "").split(",") if t.strip()) or None
    # The positions are pre-shift: the sampler applies its own shifts (the released 12 / 3), which the file leaves.
    preset = Preset(None if sigmas is None else len(sigmas), None, None, sigmas=sigmas, tasks=tasks, dit_kind="fl2va")
    return preset, "FlashGen metadata (base_schedule, tasks); shifts: the sampler's own"


def _is_larryvrh(deltas: Sequence[Delta], config: DiTConfig) -> bool:
    """Every block's qkv/out/fc1/fc2 at rank 64 and its AdaLN at rank 16, the refiner's linears at 64, the final
    AdaLN at 16: 259 pairs on the released DiT."""
    blocks = ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2")
    want = {f"blocks.{i}.{m}.weight": 64 for i in range(config.num_layers) for m in blocks}
    want |= {f"blocks.{i}.adaln_proj.linear.weight": 16 for i in range(config.num_layers)}
    want |= {f"token_refiner.blocks.{i}.{m}.weight": 64 for i in range(config.token_refiner_num_layers) for m in blocks}
    want["final_layer.adaln_proj.linear.weight"] = 16
    got = {d.target: d.rank for d in deltas}
    return got == want and all(d.scale == 1.0 for d in deltas)
