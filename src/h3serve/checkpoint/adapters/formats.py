"""Adapter files: which of the nine published formats one is, and how its module names land on the DiT's tensors.

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
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

import torch

from h3serve.checkpoint.dit import diffusers_keys
from h3serve.config import DiTConfig
from h3serve.model.dit import H3DiT


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


# --------------------------------------------------------------------------------------------- the DiT's names


@dataclass(frozen=True)
class Slot:
    """Where a file's module lands in a native tensor: rows from `row` (q/k/v inside our QKV) and whether its rows
    arrive in another order (`swap`: diffusers' fc1 `[value; gate]`)."""

    target: str  # native module name, without `.weight` / `.bias`
    row: int = 0
    rows: int | None = None  # None: all rows of the target
    swap: bool = False


@dataclass(frozen=True)
class Names:
    """The DiT's tensor shapes and the module names each naming uses for them."""

    shapes: Mapping[str, tuple[int, ...]]  # native tensor -> shape
    native: frozenset[str]  # native module names (tensor names less `.weight` / `.bias`)
    diffusers: Mapping[str, Slot]  # diffusers module name -> where it lands
    flat: Mapping[str, str]  # musubi's flattened module name -> native module name

    @classmethod
    def of(cls, config: DiTConfig) -> Names:
        with torch.device("meta"):
            shapes = {k: tuple(v.shape) for k, v in H3DiT(config).state_dict().items() if k != "rope.inv_freq"}
        modules = {name.rsplit(".", 1)[0] for name in shapes}
        inner = config.inner_dim
        diffusers: dict[str, Slot] = {}
        for module in sorted(modules):
            keys, swapped = diffusers_keys(module + ".weight")  # the DiT loader's renames, q/k/v in row order
            if len(keys) > 1:
                for i, key in enumerate(keys):
                    diffusers[key.removesuffix(".weight")] = Slot(module, i * inner, inner)
            else:
                diffusers[keys[0].removesuffix(".weight")] = Slot(module, swap=swapped)
        flat = {m.replace(".", "_"): m for m in modules}
        assert len(flat) == len(modules), "two native module names flatten alike"
        return cls(shapes=shapes, native=frozenset(modules), diffusers=diffusers, flat=flat)


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


ShapeOf = Callable[[str], Sequence[int]]  # a file key -> its stored shape, read from the header


def split_key(key: str) -> tuple[str, str, str] | None:
    """key -> (module, role, suffix family), or None for a suffix no format writes."""
    for suffix, role, family in _SUFFIXES:
        if key.endswith(suffix):
            return key[: -len(suffix)], role, family
    return None


@dataclass(frozen=True)
class Layout:
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


def detect_layout(path: Path, keys: Sequence[str], meta: Mapping[str, str], names: Names, shape_of: ShapeOf) -> Layout:
    if _is_pdd(keys, meta, shape_of):
        raise AdapterError(
            path,
            "a PDD adapter (parallel decoding distillation: a trunk LoRA plus a bank of per-step output heads); "
            "its heads need a model variant of the DiT, not a merge, and this server does not have it",
        )
    key_format = meta.get("key_format")
    fastvideo = meta.get("format") == _FASTVIDEO_FORMAT or any(
        (s := split_key(k)) is not None and s[2] == "fastvideo" for k in keys
    )
    if fastvideo:
        fmt = AdapterFormat.FASTH3 if _is_fasth3(meta) else AdapterFormat.FASTVIDEO
        return Layout(fmt, "", "diffusers", False, frozenset({"peft", "fastvideo"}))
    if key_format == "minimax-h3-native":
        qkv = meta.get("qkv_layout", "grouped")
        if qkv not in ("grouped", "stacked"):
            raise AdapterError(path, f"metadata qkv_layout={qkv!r}; a FlashGen native file is 'grouped' or 'stacked'")
        return Layout(
            AdapterFormat.FLASHGEN_NATIVE, "transformer.", "native", qkv == "grouped", frozenset({"peft-default"})
        )
    if key_format not in (None, "minimax-h3-diffusers"):
        raise AdapterError(
            path,
            f"metadata key_format={key_format!r} is no H3 adapter format this server reads "
            "(known: minimax-h3-diffusers, minimax-h3-native)",
        )
    if any(k.startswith("lora_unet_") for k in keys):
        return Layout(AdapterFormat.MUSUBI, "lora_unet_", "flat", False, frozenset({"kohya", "peft", "alpha"}))
    if any(k.startswith("diffusion_model.") for k in keys):
        return Layout(
            AdapterFormat.AI_TOOLKIT, "diffusion_model.", "native", False, frozenset({"kohya", "peft", "alpha"})
        )
    split = [s for k in keys if (s := split_key(k)) is not None]
    modules = {m for m, _, _ in split}
    native = next((m for m in sorted(modules) if m in names.native and m not in names.diffusers), None)
    diffusers = next((m for m in sorted(modules) if m in names.diffusers and m not in names.native), None)
    if native is not None and diffusers is not None:
        raise AdapterError(path, f"mixes native module names ({native!r}) with diffusers ones ({diffusers!r})")
    default = any(f == "peft-default" for _, _, f in split)
    if diffusers is not None and default:
        return Layout(AdapterFormat.LIGHTX2V_DIFFUSERS, "", "diffusers", False, frozenset({"peft-default"}))
    if native is not None and default:
        return Layout(AdapterFormat.DIFFSYNTH, "", "native", True, frozenset({"peft-default"}))
    if native is not None:
        alpha = "alpha" in meta or any(f == "alpha" for _, _, f in split)
        fmt = AdapterFormat.COMFYUI_FUSED if alpha else AdapterFormat.NATIVE
        return Layout(fmt, "", "native", False, frozenset({"kohya", "peft", "alpha"}))
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
