"""Synthetic H3 adapter files in every published layout, sized for any DiT config.

Alpha / rank scales are powers of two (2, 0.5, 0.25): diffusers folds a `.alpha` into the stored (bf16) factors, which
is exact only then, so its fused model can be held to float32 precision.

No adapter can be downloaded here, so these write what the published files hold: their key names, suffixes, tensor
shapes, dtypes and safetensors metadata, with random factors. The factors are whatever the random draw gave, in the
file's own layout (an interleaved QKV factor is interleaved by definition), so a reader that orders rows wrongly gets
other weights than an independent oracle does.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file

from h3serve.config import DiTConfig

FORMATS = (
    "lightx2v-diffusers",
    "comfyui-fused",
    "native",
    "ai-toolkit",
    "musubi",
    "diffsynth",
    "flashgen-native",
    "fasth3",
    "pdd",
)
FASTH3_IDENTITY = "FastVideo/FastH3-4-step-Preview-v1-Dense-DataFree"
FLASHGEN_SCHEDULE = "1.0,0.85,0.6,0.3,0.0"  # non-uniform, as FlashGen's declared one is

Module = tuple[str, int, int, int]  # name in the file's naming, in_features, out_features, rank


def native_linears(cfg: DiTConfig, rank: int, *, adaln: bool) -> Iterator[Module]:
    """Our block and refiner linears (and the AdaLN projections when `adaln`, at a quarter of the rank)."""
    h, inner, ffn = cfg.hidden_size, cfg.inner_dim, cfg.ffn_hidden_size
    low = max(1, rank // 4)
    body = (("attn.qkv_proj", h, 3 * inner), ("attn.out_proj", inner, h), ("mlp.fc1", h, 2 * ffn), ("mlp.fc2", ffn, h))
    for i in range(cfg.num_layers):
        for name, fan_in, fan_out in body:
            yield f"blocks.{i}.{name}", fan_in, fan_out, rank
        if adaln:
            yield f"blocks.{i}.adaln_proj.linear", cfg.time_embed_dim, cfg.adaln_out_features, low
    for i in range(cfg.token_refiner_num_layers):
        for name, fan_in, fan_out in body:
            yield f"token_refiner.blocks.{i}.{name}", fan_in, fan_out, rank
    if adaln:
        yield "final_layer.adaln_proj.linear", cfg.time_embed_dim, cfg.final_adaln_out_features, low


def diffusers_linears(cfg: DiTConfig, rank: int, *, adaln: bool) -> Iterator[Module]:
    """The same linears under diffusers' names, q/k/v apart."""
    h, inner, ffn = cfg.hidden_size, cfg.inner_dim, cfg.ffn_hidden_size
    body = (
        ("attn.to_q", h, inner),
        ("attn.to_k", h, inner),
        ("attn.to_v", h, inner),
        ("attn.to_out.0", inner, h),
        ("ff.net.0.proj", h, 2 * ffn),
        ("ff.net.2", ffn, h),
    )
    for i in range(cfg.num_layers):
        for name, fan_in, fan_out in body:
            yield f"transformer_blocks.{i}.{name}", fan_in, fan_out, rank
        if adaln:
            yield f"transformer_blocks.{i}.adaln_proj.linear", cfg.time_embed_dim, cfg.adaln_out_features, rank
    for i in range(cfg.token_refiner_num_layers):
        for name, fan_in, fan_out in body:
            yield f"token_refiner.refiner_blocks.{i}.{name}", fan_in, fan_out, rank


def _factors(g: torch.Generator, fan_in: int, fan_out: int, rank: int, dtype: torch.dtype):
    """(A, B) whose product has entries of the size of a weight's (~1/sqrt(fan_in)), so a misplaced row shows."""
    down = torch.randn(rank, fan_in, generator=g) / fan_in**0.5
    up = torch.randn(fan_out, rank, generator=g) * 0.5 / rank**0.5
    return down.to(dtype), up.to(dtype)


def _pairs(
    modules: Iterator[Module], g: torch.Generator, dtype: torch.dtype, down: str, up: str, alpha=None
) -> dict[str, torch.Tensor]:
    out = {}
    for name, fan_in, fan_out, rank in modules:
        a, b = _factors(g, fan_in, fan_out, rank, dtype)
        out[name + down], out[name + up] = a, b
        if alpha is not None:
            out[name + ".alpha"] = torch.tensor(float(alpha(rank)))
    return out


def _fasth3_diffs(cfg: DiTConfig, g: torch.Generator) -> dict[str, torch.Tensor]:
    """FastH3's full-rank deltas: block norms and AdaLN biases, patch projections, the final layer."""
    h, patch = cfg.hidden_size, cfg.video_patch_dim
    shapes: dict[str, tuple[int, ...]] = {}
    for i in range(cfg.num_layers):
        shapes[f"transformer_blocks.{i}.norm1.diff"] = (h,)
        shapes[f"transformer_blocks.{i}.norm2.diff"] = (h,)
        shapes[f"transformer_blocks.{i}.adaln_proj.linear.diff_b"] = (cfg.adaln_out_features,)
    shapes |= {
        "proj_in.diff": (h, patch),
        "proj_in.diff_b": (h,),
        "audio_proj_in.diff_b": (h,),
        "proj_out.diff": (patch, h),
        "proj_out.diff_b": (patch,),
        "norm_out.norm.diff": (h,),
        "norm_out.linear.diff_b": (cfg.final_adaln_out_features,),
    }
    out = {}
    for key, shape in shapes.items():
        scale = 0.05 / shape[-1] ** 0.5 if len(shape) == 2 else 0.05
        fp32 = key.startswith(("proj_in.", "audio_proj_in.", "proj_out."))  # the fp32 islands' deltas
        out[key] = (torch.randn(shape, generator=g) * scale).to(torch.float32 if fp32 else torch.bfloat16)
    return out


def adapter_tensors(fmt: str, cfg: DiTConfig, *, rank: int = 4, seed: int = 0) -> tuple[dict, dict[str, str]]:
    """(tensors, default metadata) of a synthetic adapter in layout `fmt` (one of FORMATS)."""
    g = torch.Generator().manual_seed(seed)
    bf16 = torch.bfloat16
    if fmt == "lightx2v-diffusers":
        tensors = _pairs(
            diffusers_linears(cfg, rank, adaln=False), g, bf16, ".lora_A.default.weight", ".lora_B.default.weight"
        )
        return tensors, {"key_format": "minimax-h3-diffusers", "alpha": str(2 * rank)}
    if fmt == "comfyui-fused":
        # LightX2V's conversion: the fused QKV factor is q, k and v's stacked (rank x 3, alpha x 3), same scale.
        mods = (
            (n, i, o, 3 * r if n.endswith("qkv_proj") else r) for n, i, o, r in native_linears(cfg, rank, adaln=False)
        )
        return _pairs(mods, g, bf16, ".lora_A.weight", ".lora_B.weight", alpha=lambda r: r / 2), {}
    if fmt == "native":
        return _pairs(native_linears(cfg, rank, adaln=True), g, bf16, ".lora_A.weight", ".lora_B.weight"), {}
    if fmt == "ai-toolkit":
        extra = [
            ("condition_proj", cfg.text_dim, cfg.hidden_size, rank),
            ("final_layer.video_out", cfg.hidden_size, cfg.video_patch_dim, rank),
        ]
        mods = (("diffusion_model." + n, i, o, r) for n, i, o, r in [*native_linears(cfg, rank, adaln=False), *extra])
        return _pairs(mods, g, bf16, ".lora_A.weight", ".lora_B.weight", alpha=lambda r: 2 * r), {}
    if fmt == "musubi":
        extra = [("time_embedder.proj_in", cfg.timestep_input_dim, cfg.time_embed_hidden_size, rank)]
        mods = (
            ("lora_unet_" + n.replace(".", "_"), i, o, r)
            for n, i, o, r in [*native_linears(cfg, rank, adaln=True), *extra]
        )
        return _pairs(mods, g, bf16, ".lora_down.weight", ".lora_up.weight", alpha=lambda r: r / 4), {}
    if fmt == "diffsynth":  # fp32 factors, as DiffSynth-Studio writes them
        return _pairs(
            native_linears(cfg, rank, adaln=False), g, torch.float32, ".lora_A.default.weight", ".lora_B.default.weight"
        ), {}
    if fmt == "flashgen-native":
        mods = (("transformer." + n, i, o, rank) for n, i, o, _ in native_linears(cfg, rank, adaln=True))
        meta = {
            "key_format": "minimax-h3-native",
            "qkv_layout": "grouped",
            "lora_rank": str(rank),
            "lora_alpha": str(rank),
            "tasks": "t2va",
            "base_schedule": FLASHGEN_SCHEDULE,
        }
        return _pairs(mods, g, bf16, ".lora_A.default.weight", ".lora_B.default.weight"), meta
    if fmt == "fasth3":
        tensors = _pairs(diffusers_linears(cfg, rank, adaln=True), g, bf16, ".lora_A.weight", ".lora_B.weight")
        diffs = _fasth3_diffs(cfg, g)
        meta = {
            "format": "fastvideo-lora-v2",
            "finetuned_model": FASTH3_IDENTITY,
            "base_model": "MiniMaxAI/MiniMax-H3",
            "rank": str(rank),
            "low_rank_tensors": str(len(tensors)),
            "diff_tensors": str(len(diffs)),
            "set_weight_tensors": "0",
        }
        return tensors | diffs, meta
    if fmt == "pdd":  # a rank-64 trunk (bare .lora_down / .lora_up) plus 32 fp32 output heads per final projection
        tensors = _pairs(diffusers_linears(cfg, rank, adaln=True), g, bf16, ".lora_down", ".lora_up")
        for key, out in (("proj_out", cfg.video_patch_dim), ("audio_proj_out", cfg.audio_latents_dim)):
            tensors[f"{key}.weight"] = torch.randn(32, out, cfg.hidden_size, generator=g)
            tensors[f"{key}.bias"] = torch.randn(32, out, generator=g)
        meta = {"pdd_num_steps": "32", "pdd_block_size": "4", "lora_rank": str(rank), "lora_alpha": str(rank)}
        return tensors, meta | {"lora_targets": "to_q,to_k,to_v,to_out.0,ff.net.0.proj,ff.net.2,adaln_proj.linear"}
    raise ValueError(f"unknown adapter format {fmt!r}; one of {FORMATS}")


def write_adapter(
    path: Path,
    fmt: str,
    config: DiTConfig,
    *,
    rank: int = 4,
    seed: int = 0,
    metadata: Mapping[str, str | None] | None = None,
    tensors: Mapping[str, torch.Tensor | None] | None = None,
) -> Path:
    """Write a synthetic adapter of layout `fmt` for the DiT of `config` to `path` (a file, or a folder to write
    `{fmt}.safetensors` into). `metadata` / `tensors` entries add to or replace the defaults (None removes one)."""
    path = Path(path)
    if path.is_dir():
        path = path / f"{fmt}.safetensors"
    data, meta = adapter_tensors(fmt, config, rank=rank, seed=seed)
    for key, value in (tensors or {}).items():
        data.pop(key, None) if value is None else data.__setitem__(key, value)
    for key, value in (metadata or {}).items():
        meta.pop(key, None) if value is None else meta.__setitem__(key, value)
    save_file({k: v.contiguous() for k, v in data.items()}, path, metadata=meta or None)
    return path
