"""The models the benchmarks run: every component at the released configuration with random weights (no released
weights exist on the GPU machine), the tiny DiT of the CPU dry runs, and the released configurations themselves."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING

import torch
from transformers import Qwen3VLConfig

from h3serve.accel.profile import Profile
from h3serve.checkpoint.vae import original_video_vae_config
from h3serve.config import DiTConfig
from h3serve.model.audio_vae import AudioVAE, AudioVAEConfig
from h3serve.model.components import Components
from h3serve.model.dit import H3DiT, inv_freq, is_fp32_name
from h3serve.model.text_encoder import (
    TEXT_ENCODER_LAYER,
    TextEncoder,
    load_image_processor,
    load_tokenizer,
    materialize_buffers,
    truncated_qwen3vl,
)
from h3serve.model.tiny import TINY_DIT, asset_dir, randomize
from h3serve.model.video_vae import VideoVAE
from h3serve.pipeline.engine import Engine

if TYPE_CHECKING:
    from h3serve.parallel.workers import RankPlace, WorkerSpec

# The released checkpoint's configurations, tokenizer and prompt guide (no weights), kept with the tests' data.
REFERENCE = Path(__file__).resolve().parents[2] / "tests" / "data" / "reference" / "FL2VA"


@torch.no_grad()
def fill_random(module: torch.nn.Module, *, skip: tuple[str, ...] = ()) -> None:
    """Random weights drawn on the device (seconds for 33 B parameters): matrices ~ N(0, 1/fan_in), norms near 1."""
    for name, t in module.state_dict(keep_vars=True).items():
        if any(s in name for s in skip) or not t.is_floating_point():
            continue
        if t.ndim <= 1:
            leaf = name.rsplit(".", 1)[-1]
            t.normal_(1.0 if ("norm" in name or leaf in ("weight_g", "scale1", "scale2")) else 0.0, 0.02)
        else:
            t.normal_(0.0, t[0].numel() ** -0.5)


def released_dit_config() -> DiTConfig:
    """The released DiT's config (the reference checkpoint's transformer/config.json)."""
    return DiTConfig.from_json(REFERENCE / "transformer" / "config.json")


def released_configs() -> SimpleNamespace:
    """The released checkpoint's configurations as a resolved folder holds them (`dit`, `text_encoder` (its folder),
    `video_vae_config`, `audio_vae_config`): what `pipeline.budget.plan_budget` reads."""
    video = [json.loads((REFERENCE / "video_vae" / name).read_text()) for name in ("config.json", "source/config.json")]
    audio = [json.loads((REFERENCE / "audio_vae" / name).read_text()) for name in ("metadata.json", "config.json")]
    return SimpleNamespace(
        dit=released_dit_config(),
        text_encoder=REFERENCE / "text_encoder",
        video_vae_config=original_video_vae_config(*video),
        audio_vae_config=AudioVAEConfig.from_original(*audio),
    )


GIB = 2**30
NOT_SUMMED = ("per_block", "dit_rest")


def weights_bytes(blocks: int | None = None, dit_only: bool = False) -> dict[str, int]:
    """What `build` (or `build_dit`) puts on the device, per component, counted on meta models: the DiT with `blocks`
    main blocks (bf16, fp32 islands), the text encoder (bf16), the video VAE and the audio VAE (fp32); and, not part
    of the sum (`NOT_SUMMED`), `per_block` (one main block's bytes) and `dit_rest` (the DiT's bytes outside them)."""
    cfg = released_dit_config()
    with torch.device("meta"):
        dit = H3DiT(dataclasses.replace(cfg, num_layers=1))
        parts: dict[str, int] = {}
        per_block = sum(t.numel() * 2 for t in dit.blocks[0].state_dict().values())
        other = sum(t.numel() * (4 if is_fp32_name(n) else 2) for n, t in dit.state_dict().items()) - per_block
        parts["dit"] = other + per_block * (cfg.num_layers if blocks is None else blocks)
        if not dit_only:
            qwen = truncated_qwen3vl(Qwen3VLConfig.from_pretrained(str(REFERENCE / "text_encoder")), TEXT_ENCODER_LAYER,
                                     vision=True)  # fmt: skip
            parts["text_encoder"] = sum(t.numel() * 2 for t in qwen.parameters())
            released = released_configs()
            parts["video_vae"] = sum(t.numel() * 4 for t in VideoVAE(released.video_vae_config).state_dict().values())
            parts["audio_vae"] = sum(t.numel() * 4 for t in AudioVAE(released.audio_vae_config).state_dict().values())
    return parts | {"per_block": per_block, "dit_rest": other}


def check_room(device: torch.device, parts: dict[str, int], free: int | None = None) -> None:
    """Refuse at once, naming the memory, a build whose weights alone exceed what is free on `device` (before minutes
    of drawing random weights end in an out-of-memory error): how many main blocks would fit (`--blocks`)."""
    if device.type != "cuda" and free is None:
        return
    free = torch.cuda.mem_get_info(device)[0] if free is None else free
    need = sum(v for k, v in parts.items() if k not in NOT_SUMMED)
    if need <= free:
        return
    shown = ", ".join(f"{k.replace('_', ' ')} {v / GIB:.1f}" for k, v in parts.items() if k not in NOT_SUMMED)
    fits = (free - (need - parts["dit"]) - parts["dit_rest"]) // parts["per_block"]
    hint = f"at most --blocks {fits} (weights alone)" if fits > 0 else "not even one main block fits beside the rest"
    raise SystemExit(
        f"the full-size random model needs {need / GIB:.1f} GiB of weights on {device} ({shown} GiB; one DiT main "
        f"block {parts['per_block'] / GIB:.2f} GiB) and {free / GIB:.1f} GiB is free: {hint}"
    )


def build_dit(device: torch.device, blocks: int | None = None) -> H3DiT:
    """The DiT at the released configuration (`blocks` main blocks when given), bf16 with its fp32 islands, random
    weights. Refused at once where the weights alone do not fit (`check_room`)."""
    check_room(device, weights_bytes(blocks, dit_only=True))
    dit_cfg = released_dit_config()
    if blocks is not None:
        dit_cfg = dataclasses.replace(dit_cfg, num_layers=blocks)
    with torch.device("meta"):
        dit = H3DiT(dit_cfg)
    for name, t in dit.state_dict(keep_vars=True).items():  # dtypes set on meta: no fp32 copy of 33 B parameters
        t.data = t.data.to(torch.float32 if is_fp32_name(name) else torch.bfloat16)
    dit = dit.to_empty(device=device)
    fill_random(dit, skip=("rope.inv_freq",))
    dit.rope.inv_freq.copy_(inv_freq(dit_cfg.rope_inv_freq_len, dit_cfg.rope_theta))
    return dit.eval().requires_grad_(False)


def build(device: torch.device, blocks: int | None = None) -> Components:
    """Every component at the released configuration with random weights (the DiT with `blocks` main blocks when
    given: a smoke run's setting, which fits an 80 GB card beside the full-size text encoder). Refused at once where
    the weights alone do not fit (`check_room`)."""
    check_room(device, weights_bytes(blocks))
    dit = build_dit(device, blocks)

    qwen_cfg = Qwen3VLConfig.from_pretrained(str(REFERENCE / "text_encoder"))
    qwen = truncated_qwen3vl(qwen_cfg, TEXT_ENCODER_LAYER, vision=True)
    for p in qwen.parameters():
        p.data = p.data.to(torch.bfloat16)
    qwen = qwen.to_empty(device=device)
    materialize_buffers(qwen)  # the rotary tables, rebuilt in float32 on the CPU
    qwen.to(device)
    fill_random(qwen)
    text = TextEncoder(qwen, load_tokenizer(asset_dir("tokenizer")), load_image_processor(asset_dir("processor")))

    released = released_configs()
    with torch.device("meta"):
        video = VideoVAE(released.video_vae_config)
    video = video.to_empty(device=device)
    fill_random(video)
    audio = AudioVAE(released.audio_vae_config).to(device)  # keeps its Kaiser filters
    fill_random(audio, skip=("filter",))
    for part in (dit, text, video, audio):
        part.eval().requires_grad_(False)
    return Components(dit=dit, text_encoder=text, video_vae=video, audio_vae=audio, name="full-size random")


def seeded_engine(profile: Profile) -> Engine:
    """The full-size model with random weights from seed 0 on the profile's device: every process of a split builds
    its own (`seeded_rank_engine`), and all of them hold the same numbers as a one-GPU engine built the same way."""
    torch.manual_seed(0)
    return Engine(build(profile.torch_device), profile)


def seeded_rank_engine(spec: WorkerSpec, place: RankPlace) -> Engine:
    """`seeded_engine` as one rank of a split builds it (an `engine_factory` of `ParallelEngine`)."""
    torch.manual_seed(0)
    return Engine(build(place.profile.torch_device), place.profile, spread=place.spread,
                  keep_text_encoder=place.keep_text_encoder)  # fmt: skip


def t2va_prompt() -> str:
    guide = (REFERENCE.parent / "skills" / "h3-prompt-writing" / "references" / "base-en.txt").read_text()
    return dict(re.findall(r"### Case \d+: (\w+)\n.*?```text\n(.*?)```", guide, flags=re.S))["T2VA"].rstrip("\n")


def tiny_dit() -> H3DiT:
    """The built-in tiny DiT (`h3serve.model.tiny`) with random weights from seed 0, stored as the released DiT is
    (bfloat16 with its float32 islands): the CPU dry runs' model."""
    dit = randomize(H3DiT(TINY_DIT), seed=0, keep=("rope.inv_freq",))
    for name, t in dit.state_dict(keep_vars=True).items():
        if name != "rope.inv_freq":
            t.data = t.data.to(torch.float32 if is_fp32_name(name) else torch.bfloat16)
    return dit.eval().requires_grad_(False)
