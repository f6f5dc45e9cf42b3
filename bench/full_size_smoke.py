"""Full-size smoke run on one GPU: every component at the released configuration, random weights, through `Engine`.

No released weights exist on the GPU machine, so this checks what can be checked without them: that the released
shapes run end to end through our own code (tokenizer and 50-layer Qwen3-VL text encoder with its vision tower,
layout, 33 B-parameter DiT, tiled video VAE decode, BigVGAN audio decode), that everything fits in the GPU's memory
at once, and how long each stage takes with plain eager PyTorch. Not a benchmark: no peer runs here.

    PYTHONPATH=src python bench/full_size_smoke.py --out bench/results/full_size_smoke.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import time
from pathlib import Path

import numpy as np
import torch
from benchlib import run_header
from PIL import Image
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
from h3serve.model.tiny import asset_dir
from h3serve.model.video_vae import VideoVAE
from h3serve.pipeline.engine import Engine

REFERENCE = Path(__file__).resolve().parents[1] / "tests" / "data" / "reference" / "FL2VA"


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


def build_dit(device: torch.device, blocks: int | None = None) -> H3DiT:
    """The DiT at the released configuration (`blocks` main blocks when given), bf16 with its fp32 islands, random
    weights."""
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


def build(device: torch.device) -> Components:
    dit = build_dit(device)

    qwen_cfg = Qwen3VLConfig.from_pretrained(str(REFERENCE / "text_encoder"))
    qwen = truncated_qwen3vl(qwen_cfg, TEXT_ENCODER_LAYER, vision=True)
    for p in qwen.parameters():
        p.data = p.data.to(torch.bfloat16)
    qwen = qwen.to_empty(device=device)
    materialize_buffers(qwen)  # the rotary tables, rebuilt in float32 on the CPU
    qwen.to(device)
    fill_random(qwen)
    text = TextEncoder(qwen, load_tokenizer(asset_dir("tokenizer")), load_image_processor(asset_dir("processor")))

    wrapper = json.loads((REFERENCE / "video_vae" / "config.json").read_text())
    source = json.loads((REFERENCE / "video_vae" / "source" / "config.json").read_text())
    with torch.device("meta"):
        video = VideoVAE(original_video_vae_config(wrapper, source))
    video = video.to_empty(device=device)
    fill_random(video)
    metadata = json.loads((REFERENCE / "audio_vae" / "metadata.json").read_text())
    audio_wrapper = json.loads((REFERENCE / "audio_vae" / "config.json").read_text())
    audio = AudioVAE(AudioVAEConfig.from_original(metadata, audio_wrapper)).to(device)  # keeps its Kaiser filters
    fill_random(audio, skip=("filter",))
    for part in (dit, text, video, audio):
        part.eval().requires_grad_(False)
    return Components(dit=dit, text_encoder=text, video_vae=video, audio_vae=audio, name="full-size random")


def seeded_engine(profile: Profile) -> Engine:
    """The full-size model with random weights from seed 0 on the profile's device: every process of a split builds
    its own (a `WorkerSpec.build`), and all of them hold the same numbers as a one-GPU engine built the same way."""
    torch.manual_seed(0)
    return Engine(build(profile.torch_device), profile)


def t2va_prompt() -> str:
    guide = (REFERENCE.parent / "skills" / "h3-prompt-writing" / "references" / "base-en.txt").read_text()
    return dict(re.findall(r"### Case \d+: (\w+)\n.*?```text\n(.*?)```", guide, flags=re.S))["T2VA"].rstrip("\n")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    device = torch.device("cuda")
    start = time.perf_counter()
    components = build(device)
    torch.cuda.synchronize()
    build_s = time.perf_counter() - start
    weights_gib = torch.cuda.memory_allocated() / 2**30
    engine = Engine(components, Profile.for_device("cuda"))
    rng = np.random.default_rng(0)
    keyframe = Image.fromarray(rng.integers(0, 255, (448, 768, 3), dtype=np.uint8))
    runs = {}
    for task, keyframes in (("t2va", []), ("t2va", []), ("i2va", [keyframe])):
        request = engine.validate(
            t2va_prompt(),
            task=task,
            width=768,
            height=448,
            num_frames=56,
            steps=args.steps,
            seed=42,
            keyframes=keyframes,
        )
        torch.cuda.reset_peak_memory_stats()
        result = engine.render(request)
        key = task if task not in runs else f"{task}_again"
        runs[key] = {
            "frames": list(result.frames.shape),
            "audio": list(result.audio.shape),
            "frames_finite_and_varied": bool(result.frames.std() > 0),
            "audio_finite": bool(np.isfinite(result.audio).all()),
            "timings_s": {k: round(v, 3) for k, v in result.timings.items()},
            "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
            "_frames": result.frames,
            "_audio": result.audio,
        }
    runs["t2va_again"]["identical_to_first"] = bool(
        np.array_equal(runs["t2va"]["_frames"], runs["t2va_again"]["_frames"])
        and np.array_equal(runs["t2va"]["_audio"], runs["t2va_again"]["_audio"])
    )
    for run in runs.values():
        run.pop("_frames"), run.pop("_audio")
    record = {
        **run_header(),
        "request": "768x448, 56 frames, seed 42, the guide's T2VA case prompt; i2va adds one 768x448 keyframe",
        "steps_grid_points": args.steps,
        "build_s": round(build_s, 1),
        "weights_gib": round(weights_gib, 2),
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2))
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
