"""Few-step adapters (LoRA and full-rank deltas) for the H3 DiT: read every published file layout, merge into weights.

An adapter is read once (`read_adapter`) against the DiT's config: every tensor of the file is mapped onto one of
our native tensors (`H3DiT.state_dict()` names, QKV rows stacked `[q; k; v]`, fc1 rows `[gate; value]`) and its shape
checked before any weight changes. Merging is `W' = W + sum_i(scale_i * file_scale_i * B_i @ A_i)` (plus full-rank
deltas), computed in float32 and rounded once to W's dtype: `AdapterMerge` does it per tensor as a checkpoint streams
in (a `LoadHook`, placed before any quantizing hook), `merge_into` to a model that already exists (the tiny model).
The AdaLN tables are made from the DiT's weights, so a merged AdaLN LoRA is simply in them.

What identifies each format (keys and safetensors metadata only; nothing is tried and retried). Key suffixes:
peft `.lora_A.weight` / `.lora_B.weight`, peft's adapter infix `.lora_A.default.weight`, kohya `.lora_down.weight` /
`.lora_up.weight`, with an optional per-module `.alpha` scalar.

* PDD (alibaba-pai Acc LoRAs) -- refused: metadata `key_format=minimax-h3-pdd-*` or any `pdd_*` entry, bare
  `.lora_down` / `.lora_up` keys, or a 3-D `proj_out.weight` (its bank of per-step output heads). It needs a model
  variant with those heads, not a merge.
* `fasth3` / `fastvideo` -- metadata `format=fastvideo-lora-v2`, or `.diff` / `.diff_b` / `.set_weight` keys:
  diffusers module names, rank-64 peft factors at scale 1 plus full-rank `.diff` (weights) / `.diff_b` (biases)
  deltas. It is FastH3 (with its preset) only when `finetuned_model` is in FastVideo's namespace and names FastH3
  (and `base_model`, when given, is MiniMaxAI/MiniMax-H3), the test vLLM-Omni uses; otherwise a plain `fastvideo`
  adapter without a preset. `.set_weight` (the sparse-attention variant's gates) names parameters this DiT lacks:
  refused.
* `flashgen-native` -- metadata `key_format=minimax-h3-native`: native names under an optional `transformer.`
  prefix, peft `.default.` infix, fused QKV interleaved per head (`qkv_layout=grouped`; `stacked` is honoured),
  scale `lora_alpha / rank`, preset from `base_schedule` (comma-separated positions) and `tasks`.
* `musubi` -- keys starting `lora_unet_`: native module names with every `.` flattened to `_` (resolved against the
  DiT's own module names, not split on `_`), kohya or peft suffixes, `.alpha` scalars; QKV stacked.
* `ai-toolkit` -- keys starting `diffusion_model.` over native names, `.alpha` scalars; QKV stacked.
* `lightx2v-diffusers` -- diffusers module names (`transformer_blocks.N.attn.to_q`, `ff.net.0.proj`, ...) with the
  `.default.` infix and no `transformer.` prefix; metadata `key_format` absent or `minimax-h3-diffusers`. q/k/v go
  to their rows of our QKV, `ff.net.0.proj` B halves `[value; gate]` are swapped to our `[gate; value]`.
* `diffsynth` -- native names with the `.default.` infix (no prefix, no key_format): QKV rows interleaved per head,
  de-interleaved here (diffusers' converter reads the same signature the same way).
* `comfyui-fused` / `native` -- native names, no prefix, plain peft or kohya suffixes, QKV stacked: `comfyui-fused`
  when the file carries an alpha (`.alpha` scalars or metadata `alpha`: LightX2V's `*_comfyui_bf16` conversions, rank
  384 and alpha 24 on the QKV, which with their 1.82 GiB against the diffusers files' 1.29 GiB reads as q, k and v's
  rank-128 factors stacked into one QKV factor at alpha 3 x 8), `native` when it has none (larryvrh's, scale 1).

Scale rules (diffusers 0.42.1's): a module's `.alpha` gives alpha / rank; else a metadata `alpha` is the network
alpha, alpha / rank per module; else 1.0. (vLLM-Omni drives an alpha-less LightX2V file at alpha 8 instead; we
follow diffusers, and say so in `describe`.)

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
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from itertools import pairwise
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from h3serve.config import DiTConfig
from h3serve.model.dit import H3DiT
from h3serve.model.loading import diffusers_name


class AdapterError(ValueError):
    """An adapter file that cannot be merged as asked: `path` is the file, `key` the offending tensor (None when the
    file as a whole is at fault)."""

    def __init__(self, path: Path | str, message: str, *, key: str | None = None):
        self.path = Path(path)
        self.key = key
        where = f"{self.path}" if key is None else f"{self.path}: key {key!r}"
        super().__init__(f"{where}: {message}")


class AdapterFormat(StrEnum):
    LIGHTX2V_DIFFUSERS = "lightx2v-diffusers"
    COMFYUI_FUSED = "comfyui-fused"
    NATIVE = "native"
    AI_TOOLKIT = "ai-toolkit"
    MUSUBI = "musubi"
    DIFFSYNTH = "diffsynth"
    FLASHGEN_NATIVE = "flashgen-native"
    FASTH3 = "fasth3"
    FASTVIDEO = "fastvideo"


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
            parts.append(f"shift {_num(self.video_shift)}/{_num(self.audio_shift)}")
        if self.sigmas is not None:
            parts.append("sigmas " + ",".join(_num(s) for s in self.sigmas))
        if self.tasks is not None:
            parts.append("tasks " + ",".join(self.tasks))
        if self.dit_kind is not None:
            parts.append(f"{self.dit_kind} DiT")
        return ", ".join(parts) or "nothing known"


@dataclass(frozen=True, eq=False)  # holds tensors: identity, not value, equality
class Delta:
    """One term of an adapter on one native tensor: `scale * up @ down` (or `scale * up` when `down` is None, a
    full-rank delta) added to rows `row : row + up.shape[0]` of `target`."""

    target: str
    row: int
    up: torch.Tensor = field(repr=False)  # B (rows, rank), or the full delta (rows, ...) / (rows,)
    down: torch.Tensor | None = field(repr=False)  # A (rank, in)
    scale: float  # the file's alpha / rank (1.0 for a full delta)
    key: str  # the file key it came from, for messages

    @property
    def rank(self) -> int | None:
        return None if self.down is None else self.down.shape[0]


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

    def with_scale(self, scale: float) -> Adapter:
        return replace(self, scale=float(scale))

    def describe(self) -> str:
        full = sum(d.down is None for d in self.deltas)
        ranks = "/".join(str(r) for r in self.ranks) or "-"
        alpha = "/".join(_num(a) for a in self.alpha_scale) or "-"
        extra = f" + {full} full-rank deltas" if full else ""
        adaln = ", touches AdaLN" if self.touches_adaln else ""
        preset = "unknown" if self.preset is None else self.preset.describe()
        return (
            f"{self.path.name}: {self.format}, {self.targets} targets{extra}, rank {ranks}, alpha/rank {alpha}, "
            f"scale {_num(self.scale)}{adaln}; preset: {preset} ({self.preset_note})"
        )


def _num(x: float | None) -> str:
    return "?" if x is None else f"{x:g}"


# --------------------------------------------------------------------------------------------- the DiT's names


@dataclass(frozen=True)
class _Slot:
    """Where a file's module lands in a native tensor: rows from `row` (q/k/v inside our QKV) and whether its rows
    arrive in another order (`swap`: diffusers' fc1 `[value; gate]`)."""

    target: str  # native module name, without `.weight` / `.bias`
    row: int = 0
    rows: int | None = None  # None: all rows of the target
    swap: bool = False


@dataclass(frozen=True)
class _Names:
    """The DiT's tensor shapes and the module names each naming uses for them."""

    shapes: Mapping[str, tuple[int, ...]]  # native tensor -> shape
    native: frozenset[str]  # native module names (tensor names less `.weight` / `.bias`)
    diffusers: Mapping[str, _Slot]  # diffusers module name -> where it lands
    flat: Mapping[str, str]  # musubi's flattened module name -> native module name

    @classmethod
    def of(cls, config: DiTConfig) -> _Names:
        with torch.device("meta"):
            shapes = {k: tuple(v.shape) for k, v in H3DiT(config).state_dict().items() if k != "rope.inv_freq"}
        modules = {name.rsplit(".", 1)[0] for name in shapes}
        inner = config.inner_dim
        diffusers: dict[str, _Slot] = {}
        for module in sorted(modules):
            if module.endswith("attn.qkv_proj"):
                stem = diffusers_name(module + ".weight").removesuffix("qkv_proj.weight")
                for i, p in enumerate("qkv"):
                    diffusers[f"{stem}to_{p}"] = _Slot(module, i * inner, inner)
            else:
                theirs = diffusers_name(module + ".weight").removesuffix(".weight")
                diffusers[theirs] = _Slot(module, swap=module.endswith("mlp.fc1"))
        flat = {m.replace(".", "_"): m for m in modules}
        assert len(flat) == len(modules), "two native module names flatten alike"
        return cls(shapes=shapes, native=frozenset(modules), diffusers=diffusers, flat=flat)


# ------------------------------------------------------------------------------------------------- row orders


def deinterleave_qkv_rows(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows `[h0: q k v, h1: q k v, ...]` -> our `[q_all; k_all; v_all]` (a B factor or a full delta)."""
    return t.reshape(heads, 3, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


def swap_halves(t: torch.Tensor) -> torch.Tensor:
    """diffusers' fc1 rows `[value; gate]` -> our `[gate; value]` (its own inverse)."""
    first, second = t.chunk(2, dim=0)
    return torch.cat((second, first), dim=0)


# ------------------------------------------------------------------------------------------------ key grammar

_SUFFIXES = (  # longest first: the role a key plays for its module, and the suffix family it belongs to
    (".lora_A.default.weight", "down", "peft-default"),
    (".lora_B.default.weight", "up", "peft-default"),
    (".lora_A.weight", "down", "peft"),
    (".lora_B.weight", "up", "peft"),
    (".lora_down.weight", "down", "kohya"),
    (".lora_up.weight", "up", "kohya"),
    (".alpha", "alpha", "alpha"),
    (".diff_b", "diff_b", "fastvideo"),
    (".diff", "diff", "fastvideo"),
    (".set_weight", "set_weight", "fastvideo"),
)
_FASTVIDEO_FORMAT = "fastvideo-lora-v2"
_FASTH3_PRESET = Preset(
    steps=5, video_shift=12.0, audio_shift=3.0, sigmas=(0.999, 0.749, 0.5, 0.25, 0.0), tasks=("t2va",), dit_kind="fl2va"
)
_LIGHTX2V_NAME = re.compile(
    r"^minimax_h3_(?P<task>fl2v|ref2v)_turbo_(?P<steps>\d+)step_v\d+\.\d+(?P<res>_768p)?(?:_comfyui)?(?:_bf16)?"
    r"\.safetensors$"
)
_LARRYVRH_PRESET = Preset(steps=9, video_shift=12.0, audio_shift=3.0)


ShapeOf = Callable[[str], Sequence[int]]  # a file key -> its stored shape, read from the header


def _split_key(key: str) -> tuple[str, str, str] | None:
    """key -> (module, role, suffix family), or None for a suffix no format writes."""
    for suffix, role, family in _SUFFIXES:
        if key.endswith(suffix):
            return key[: -len(suffix)], role, family
    return None


@dataclass(frozen=True)
class _Layout:
    """How one file names and orders things, decided from its keys and metadata."""

    format: AdapterFormat
    prefix: str  # stripped from every key (optional for FlashGen's `transformer.`)
    naming: str  # "native", "diffusers" or "flat" (musubi)
    qkv_interleaved: bool
    families: frozenset[str]  # the suffix families it may use


def _is_pdd(keys: Sequence[str], meta: Mapping[str, str], shape_of: ShapeOf) -> bool:
    if str(meta.get("key_format", "")).startswith("minimax-h3-pdd") or any(k.startswith("pdd_") for k in meta):
        return True
    if any(k.endswith((".lora_down", ".lora_up")) for k in keys):
        return True
    return "proj_out.weight" in keys and len(shape_of("proj_out.weight")) == 3


def _layout(path: Path, keys: Sequence[str], meta: Mapping[str, str], names: _Names, shape_of: ShapeOf) -> _Layout:
    if _is_pdd(keys, meta, shape_of):
        raise AdapterError(
            path,
            "a PDD adapter (parallel decoding distillation: a trunk LoRA plus a bank of per-step output heads); "
            "its heads need a model variant of the DiT, not a merge, and this server does not have it",
        )
    key_format = meta.get("key_format")
    fastvideo = meta.get("format") == _FASTVIDEO_FORMAT or any(
        (s := _split_key(k)) is not None and s[2] == "fastvideo" for k in keys
    )
    if fastvideo:
        fmt = AdapterFormat.FASTH3 if _is_fasth3(meta) else AdapterFormat.FASTVIDEO
        return _Layout(fmt, "", "diffusers", False, frozenset({"peft", "fastvideo"}))
    if key_format == "minimax-h3-native":
        qkv = meta.get("qkv_layout", "grouped")
        if qkv not in ("grouped", "stacked"):
            raise AdapterError(path, f"metadata qkv_layout={qkv!r}; a FlashGen native file is 'grouped' or 'stacked'")
        return _Layout(
            AdapterFormat.FLASHGEN_NATIVE, "transformer.", "native", qkv == "grouped", frozenset({"peft-default"})
        )
    if key_format not in (None, "minimax-h3-diffusers"):
        raise AdapterError(
            path,
            f"metadata key_format={key_format!r} is no H3 adapter format this server reads "
            "(known: minimax-h3-diffusers, minimax-h3-native)",
        )
    if any(k.startswith("lora_unet_") for k in keys):
        return _Layout(AdapterFormat.MUSUBI, "lora_unet_", "flat", False, frozenset({"kohya", "peft", "alpha"}))
    if any(k.startswith("diffusion_model.") for k in keys):
        return _Layout(
            AdapterFormat.AI_TOOLKIT, "diffusion_model.", "native", False, frozenset({"kohya", "peft", "alpha"})
        )
    split = [s for k in keys if (s := _split_key(k)) is not None]
    modules = {m for m, _, _ in split}
    native = next((m for m in sorted(modules) if m in names.native and m not in names.diffusers), None)
    diffusers = next((m for m in sorted(modules) if m in names.diffusers and m not in names.native), None)
    if native is not None and diffusers is not None:
        raise AdapterError(path, f"mixes native module names ({native!r}) with diffusers ones ({diffusers!r})")
    default = any(f == "peft-default" for _, _, f in split)
    if diffusers is not None and default:
        return _Layout(AdapterFormat.LIGHTX2V_DIFFUSERS, "", "diffusers", False, frozenset({"peft-default"}))
    if native is not None and default:
        return _Layout(AdapterFormat.DIFFSYNTH, "", "native", True, frozenset({"peft-default"}))
    if native is not None:
        alpha = "alpha" in meta or any(f == "alpha" for _, _, f in split)
        fmt = AdapterFormat.COMFYUI_FUSED if alpha else AdapterFormat.NATIVE
        return _Layout(fmt, "", "native", False, frozenset({"kohya", "peft", "alpha"}))
    if diffusers is not None:
        raise AdapterError(
            path,
            "diffusers module names with plain peft suffixes and no FastVideo metadata: no published H3 adapter "
            "layout (LightX2V's carry the `.default.` infix)",
        )
    raise AdapterError(
        path,
        f"not an H3 adapter in any known format: its keys (e.g. {sorted(keys)[:3]}) name no module of the DiT in "
        "native, diffusers or musubi naming",
    )


def _is_fasth3(meta: Mapping[str, str]) -> bool:
    identity = meta.get("finetuned_model", "").lower()
    base = meta.get("base_model")
    return (
        identity.startswith("fastvideo/")
        and "fasth3" in identity
        and (base is None or base.casefold() == "minimaxai/minimax-h3")
    )


# ---------------------------------------------------------------------------------------------- reading a file


def read_adapter(path: Path | str, scale: float = 1.0, *, config: DiTConfig) -> Adapter:
    """Read and validate an adapter file against the DiT of `config`: every key must map to one of its tensors with
    the right shape. Nothing is merged here; an AdapterError names the file, the key and both shapes."""
    path = Path(path)
    if not math.isfinite(scale):
        raise AdapterError(path, f"scale must be a finite number, got {scale!r}")
    if not path.is_file():
        raise AdapterError(path, "no such adapter file")
    try:
        handle = safe_open(str(path), framework="pt", device="cpu")
    except Exception as err:  # safetensors raises its own error types for a corrupt header
        raise AdapterError(path, f"not a readable safetensors file: {err}") from err
    meta = dict(handle.metadata() or {})
    keys = list(handle.keys())
    if not keys:
        raise AdapterError(path, "holds no tensors")
    names = _Names.of(config)
    layout = _layout(path, keys, meta, names, lambda k: handle.get_slice(k).get_shape())
    modules = _group(path, keys, layout, names)
    tensors = {k: handle.get_tensor(k).clone() for k in keys}  # owned copies, not views into the file's mapping
    alpha_meta = _metadata_alpha(path, meta, layout)
    deltas: list[Delta] = []
    for module, roles in sorted(modules.items()):
        deltas.extend(_module_deltas(path, module, roles, tensors, layout, names, config, alpha_meta))
    _check_overlaps(path, deltas)
    if layout.format is AdapterFormat.FLASHGEN_NATIVE and "lora_rank" in meta:
        ranks = {d.rank for d in deltas if d.rank is not None}
        if ranks != {_int(path, meta, "lora_rank")}:
            raise AdapterError(
                path, f"metadata lora_rank={meta['lora_rank']} but its factors have ranks {sorted(ranks)}"
            )
    preset, note = _preset(path, layout, meta, deltas, names, config)
    targets = sorted({d.target for d in deltas})
    return Adapter(
        path=path,
        format=str(layout.format),
        scale=float(scale),
        targets=len(targets),
        ranks=tuple(sorted({d.rank for d in deltas if d.rank is not None})),
        alpha_scale=tuple(sorted({d.scale for d in deltas if d.down is not None})),
        touches_adaln=any(_is_adaln(t) for t in targets),
        preset=preset,
        preset_note=note,
        shapes={t: names.shapes[t] for t in targets},
        deltas=tuple(deltas),
    )


def _group(path: Path, keys: Sequence[str], layout: _Layout, names: _Names) -> dict[str, dict[str, str]]:
    """module name (in the file's naming, prefix stripped) -> role -> file key."""
    modules: dict[str, dict[str, str]] = {}
    for key in keys:
        split = _split_key(key)
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


def _slot(path: Path, module: str, key: str, layout: _Layout, names: _Names, config: DiTConfig) -> _Slot:
    if layout.naming == "diffusers":
        slot = names.diffusers.get(module)
    elif layout.naming == "flat":
        slot = _Slot(names.flat[module]) if module in names.flat else None
    else:
        slot = _Slot(module) if module in names.native else None
    if slot is None:
        hint = ""
        if key.endswith(".set_weight"):
            hint = (
                " (a sparse-attention gate of FastH3's VSA variant: this DiT has dense attention; use the dense file)"
            )
        raise AdapterError(
            path,
            f"names module {module!r}, which this DiT ({config.num_layers} blocks, "
            f"{config.token_refiner_num_layers} refiner blocks) does not have{hint}",
            key=key,
        )
    return slot


def _module_deltas(
    path: Path,
    module: str,
    roles: Mapping[str, str],
    tensors: Mapping[str, torch.Tensor],
    layout: _Layout,
    names: _Names,
    config: DiTConfig,
    alpha_meta: float | None,
) -> list[Delta]:
    any_key = next(iter(roles.values()))
    slot = _slot(path, module, any_key, layout, names, config)
    out: list[Delta] = []
    if "up" in roles or "down" in roles or "alpha" in roles:
        out.append(_low_rank(path, slot, roles, tensors, layout, names, config, alpha_meta))
    for role, suffix in (("diff", "weight"), ("diff_b", "bias")):
        if role in roles:
            out.append(_full(path, slot, f"{slot.target}.{suffix}", roles[role], tensors, layout, names, config))
    if "set_weight" in roles:  # any module this DiT has is not a gate: the name alone is wrong
        raise AdapterError(
            path, "assigns a whole parameter, which no H3 adapter may do to this DiT", key=roles["set_weight"]
        )
    return out


def _rows(slot: _Slot, shape: tuple[int, ...]) -> int:
    return shape[0] if slot.rows is None else slot.rows


def _reorder(t: torch.Tensor, slot: _Slot, target: str, layout: _Layout, config: DiTConfig) -> torch.Tensor:
    """A B factor's or a full delta's rows in our order."""
    if slot.swap:
        t = swap_halves(t)
    if layout.qkv_interleaved and target.endswith("attn.qkv_proj.weight"):
        t = deinterleave_qkv_rows(t, config.num_attention_heads)
    return t.contiguous()


def _low_rank(
    path: Path,
    slot: _Slot,
    roles: Mapping[str, str],
    tensors: Mapping[str, torch.Tensor],
    layout: _Layout,
    names: _Names,
    config: DiTConfig,
    alpha_meta: float | None,
) -> Delta:
    if "up" not in roles or "down" not in roles:
        have = ", ".join(sorted(roles))
        raise AdapterError(path, f"is one of {have} for its module, without both LoRA factors", key=min(roles.values()))
    up_key, down_key = roles["up"], roles["down"]
    up, down = tensors[up_key], tensors[down_key]
    target = f"{slot.target}.weight"
    shape = names.shapes.get(target)
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
    if layout.format in (AdapterFormat.FASTH3, AdapterFormat.FASTVIDEO):
        file_scale = 1.0  # FastVideo's reconstruction adds B @ A as it is
    elif "alpha" in roles:
        alpha = tensors[roles["alpha"]]
        if alpha.numel() != 1:
            raise AdapterError(path, f"an alpha must be one number, got shape {list(alpha.shape)}", key=roles["alpha"])
        file_scale = float(alpha.float().item()) / rank
    elif alpha_meta is not None:
        file_scale = alpha_meta / rank
    else:
        file_scale = 1.0
    if not math.isfinite(file_scale):
        raise AdapterError(path, f"alpha / rank is not finite ({file_scale})", key=roles.get("alpha", up_key))
    return Delta(target, slot.row, _reorder(up, slot, target, layout, config), down.contiguous(), file_scale, up_key)


def _full(
    path: Path,
    slot: _Slot,
    target: str,
    key: str,
    tensors: Mapping[str, torch.Tensor],
    layout: _Layout,
    names: _Names,
    config: DiTConfig,
) -> Delta:
    delta = tensors[key]
    shape = names.shapes.get(target)
    if shape is None:
        raise AdapterError(path, f"is a delta for {target}, which this DiT does not have", key=key)
    want = (_rows(slot, shape), *shape[1:])
    if tuple(delta.shape) != want or not delta.is_floating_point():
        raise AdapterError(
            path,
            f"shape {list(delta.shape)} does not fit {target} {list(shape)} (expected {list(want)})"
            + _pruned_hint(target),
            key=key,
        )
    return Delta(target, slot.row, _reorder(delta, slot, target, layout, config), None, 1.0, key)


def _pruned_hint(target: str) -> str:
    if _is_adaln(target):
        return "; an AdaLN projection of another width: an adapter trained on a pruned base (AdaLN removed)?"
    return ""


def _is_adaln(name: str) -> bool:
    return ".adaln_proj." in name or name.startswith("final_layer.adaln_proj.")


def _check_overlaps(path: Path, deltas: Sequence[Delta]) -> None:
    """Two modules of one file may not land on the same rows (q and k of one block never do; a file holding both
    `to_q` and `qkv_proj` names is malformed and was refused by its naming already)."""
    seen: dict[tuple[str, int, bool], str] = {}
    for d in deltas:
        slot = (d.target, d.row, d.down is None)
        if slot in seen:
            raise AdapterError(path, f"lands on the same rows of {d.target} as {seen[slot]!r}", key=d.key)
        seen[slot] = d.key


def _metadata_alpha(path: Path, meta: Mapping[str, str], layout: _Layout) -> float | None:
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


# ------------------------------------------------------------------------------------------------------ presets


def _preset(
    path: Path, layout: _Layout, meta: Mapping[str, str], deltas: Sequence[Delta], names: _Names, config: DiTConfig
) -> tuple[Preset | None, str]:
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
    if fmt is AdapterFormat.NATIVE and _is_larryvrh(deltas, names, config):
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


def _is_larryvrh(deltas: Sequence[Delta], names: _Names, config: DiTConfig) -> bool:
    """Every block's qkv/out/fc1/fc2 at rank 64 and its AdaLN at rank 16, the refiner's linears at 64, the final
    AdaLN at 16: 259 pairs on the released DiT."""
    blocks = ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2")
    want = {f"blocks.{i}.{m}.weight": 64 for i in range(config.num_layers) for m in blocks}
    want |= {f"blocks.{i}.adaln_proj.linear.weight": 16 for i in range(config.num_layers)}
    want |= {f"token_refiner.blocks.{i}.{m}.weight": 64 for i in range(config.token_refiner_num_layers) for m in blocks}
    want["final_layer.adaln_proj.linear.weight"] = 16
    got = {d.target: d.rank for d in deltas}
    return got == want and all(d.scale == 1.0 for d in deltas)


# ---------------------------------------------------------------------------------------------------- PATH:SCALE


# -------------------------------------------------------------------------------------------------------- merging


_Term = tuple[Delta, float]  # a delta and the user's scale of its adapter


def _terms(adapters: Sequence[Adapter]) -> dict[str, list[_Term]]:
    terms: dict[str, list[_Term]] = {}
    for adapter in adapters:
        for d in adapter.deltas:
            terms.setdefault(d.target, []).append((d, adapter.scale))
    return terms


def merged(tensor: torch.Tensor, terms: Sequence[_Term]) -> torch.Tensor:
    """`tensor` plus every term's delta: summed in float32 on the tensor's device, rounded once to its dtype."""
    total = tensor.to(torch.float32, copy=True)
    for d, user_scale in terms:
        up = d.up.to(tensor.device, torch.float32)
        rows = total[d.row : d.row + up.shape[0]]
        if d.down is None:
            rows.add_(up, alpha=user_scale * d.scale)
        else:
            rows.addmm_(up, d.down.to(tensor.device, torch.float32), alpha=user_scale * d.scale)
    return total.to(tensor.dtype)


class AdapterMerge:
    """Load hook: each native tensor an adapter changes comes out merged (`merged`); the others pass untouched.
    Put it first in a chain, before a hook that quantizes or moves weights."""

    def __init__(self, adapters: Sequence[Adapter]):
        self.adapters = tuple(adapters)
        self._terms = _terms(self.adapters)
        self.seconds = 0.0  # time spent merging, summed over the load (a line of the load report)
        # target -> (its shape when read, the first adapter and key that change it), for messages
        self._read: dict[str, tuple[tuple[int, ...], Path, str]] = {}
        for a in self.adapters:
            for d in a.deltas:
                shape, path, _ = self._read.setdefault(d.target, (a.shapes[d.target], a.path, d.key))
                if shape != a.shapes[d.target]:
                    raise AdapterError(
                        a.path,
                        f"was read for {d.target} {list(a.shapes[d.target])}; {path} for {list(shape)}",
                        key=d.key,
                    )

    def transform(self, name: str, tensor: torch.Tensor) -> Mapping[str, torch.Tensor]:
        terms = self._terms.get(name)
        if terms is None:
            return {name: tensor}
        shape, path, key = self._read[name]
        if tuple(tensor.shape) != shape:
            raise AdapterError(
                path, f"was read for {name} {list(shape)}; the checkpoint's is {list(tensor.shape)}", key=key
            )
        start = time.perf_counter()
        out = merged(tensor, terms)
        if out.is_cuda:
            torch.cuda.synchronize(out.device)
        self.seconds += time.perf_counter() - start
        return {name: out}

    def prepare(self, module: nn.Module) -> None:
        """Nothing: the merge keeps every tensor's name, shape and dtype."""


@torch.no_grad()
def merge_into(dit: nn.Module, adapters: Sequence[Adapter]) -> None:
    """Merge `adapters` into an already-built DiT in place, tensor by tensor. Every target is checked against the
    model (present, same shape, floating point) before any weight changes."""
    state = dit.state_dict(keep_vars=True)
    for adapter in adapters:
        for target, shape in sorted(adapter.shapes.items()):
            tensor = state.get(target)
            if tensor is None or tuple(tensor.shape) != shape or not tensor.is_floating_point():
                found = "missing" if tensor is None else f"{list(tensor.shape)} {tensor.dtype}"
                key = next(d.key for d in adapter.deltas if d.target == target)
                raise AdapterError(
                    adapter.path, f"was read for {target} {list(shape)}; this model's is {found}", key=key
                )
    for target, terms in sorted(_terms(adapters).items()):
        tensor = state[target]
        tensor.data.copy_(merged(tensor.data, terms))


def check_adapter_kinds(adapters: Sequence[Adapter], task_type: str) -> None:
    """ValueError for adapters the loaded DiTs cannot take: one DiT per server with adapters (an FL2VA adapter must
    not reach the Ref2VA DiT, nor the reverse), and an adapter trained for the other DiT."""
    if not adapters:
        return
    if task_type == "both":
        raise ValueError(
            "H3_LORA (--lora): adapters are merged into one DiT; with task type both, which one is ambiguous. Start "
            "with H3_TASK_TYPE fl2va or ref2va"
        )
    for adapter in adapters:
        kind = adapter.preset.dit_kind if adapter.preset is not None else None
        if kind is not None and kind != task_type:
            raise ValueError(
                f"H3_LORA (--lora) {adapter.path}: an adapter for the {kind} DiT, but this server loads the "
                f"{task_type} DiT (H3_TASK_TYPE)"
            )
