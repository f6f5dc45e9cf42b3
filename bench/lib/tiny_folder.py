"""A complete tiny H3 checkpoint in the diffusers layout, written by diffusers' and transformers' own `save_pretrained`
with deterministic random weights, for end-to-end parity runs of our engine against diffusers' modular pipeline (the
tests, through tests/e2e_fixtures.py) and for bench/start.py, which replaces its DiT with a wide one.

The shapes are the built-in tiny model's (`h3serve.model.tiny`): the DiT is `TINY_DIT` under its diffusers key names,
the VAEs keep the released geometry (1/16 spatial, 1/4 temporal, hop 800 at 32 kHz) at toy widths, and the text encoder
is the tiny Qwen3-VL with 51 decoder layers, because both pipelines read `hidden_states[50]`. The DiTs (`transformer/`
for t2va/fl2va and, on request, `transformer_ref/` for ref2va: same configuration, weights of their own) are stored as
the release stores them (bfloat16 with float32 islands), which our loader insists on; the VAEs and text encoder in
float32.
"""

from __future__ import annotations

import shutil
from dataclasses import asdict
from pathlib import Path

import torch

from h3serve.model.text_encoder import TEXT_ENCODER_LAYER
from h3serve.model.tiny import (
    TINY_AUDIO_VAE,
    TINY_DIT,
    TINY_VIDEO_VAE,
    asset_dir,
    randomize,
    tiny_text_encoder_config,
)
from lib.export import diffusers_config, is_diffusers_fp32

SEED = 20260412

# TINY_DIT under the diffusers `transformer/config.json` names.
TINY_DIT_DIFFUSERS = diffusers_config(TINY_DIT)

# Our VideoVAEConfig's fields are the diffusers keys, plus the original wrapper's tiling recipe, which diffusers
# hard-codes (256 px tiles, 64 px overlap) and so has no key for.
_VIDEO_RECIPE = ("tile_size", "tile_overlap_min", "encoder_tiling", "decoder_tiling")
TINY_VAE_DIFFUSERS = {k: v for k, v in asdict(TINY_VIDEO_VAE).items() if k not in _VIDEO_RECIPE}
TINY_AUDIO_VAE_DIFFUSERS = asdict(TINY_AUDIO_VAE)

# The released pipeline index. diffusers reads it as `modular_model_index.json`; in a local copy of the repository it
# loads every component whose files are present from the copy rather than from the Hub.
RELEASED_INDEX = Path(__file__).resolve().parents[2] / "tests" / "data" / "reference" / "model_index.json"


@torch.no_grad()
def write_tiny_checkpoint(root: Path, seed: int = SEED, *, ref2va: bool = False) -> Path:
    """Write the tiny checkpoint under `root` (diffusers layout) and return `root`; with `ref2va`, the Ref2VA DiT's
    `transformer_ref/` too (off by default: a folder with it is a both-partitions release, which some folder tests
    rewrite in part, e.g. `transformer/` alone as one original-names file, and then refuse as mixed)."""
    from diffusers import (
        AutoencoderKLMiniMaxH3,
        AutoencoderKLMiniMaxH3Audio,
        MiniMaxH3Scheduler,
        MiniMaxH3Transformer3DModel,
    )
    from transformers import Qwen3VLForConditionalGeneration

    root.mkdir(parents=True, exist_ok=True)

    # Random weights rounded to the dtype the release stores: bfloat16 except the float32 islands. The Ref2VA DiT
    # (`transformer_ref/`, the release's second partition) has the same configuration and weights of its own.
    for subfolder, dit_seed in (("transformer", seed), ("transformer_ref", seed + 4))[: 2 if ref2va else 1]:
        dit = randomize(MiniMaxH3Transformer3DModel(**TINY_DIT_DIFFUSERS), dit_seed)
        for name, p in dit.named_parameters():
            if not is_diffusers_fp32(name):
                p.data = p.data.to(torch.bfloat16)
        dit.save_pretrained(root / subfolder)

    randomize(AutoencoderKLMiniMaxH3(**TINY_VAE_DIFFUSERS), seed + 1).save_pretrained(root / "vae")
    # The audio VAE's Kaiser resampling filters and its zero key bias are fixed buffers, kept as constructed.
    audio_vae = randomize(
        AutoencoderKLMiniMaxH3Audio(**TINY_AUDIO_VAE_DIFFUSERS), seed + 2, keep=("filter", "zero_k_bias")
    )
    # At randomize's scale ~75% of the waveform lands on the [-1, 1] clamp, where any two decoders agree; a tenth of
    # the output gain leaves almost every sample inside it, so a comparison sees them.
    audio_vae.decoder.conv_post.weight_g.mul_(0.1)
    audio_vae.save_pretrained(root / "audio_vae")

    text = Qwen3VLForConditionalGeneration(tiny_text_encoder_config(TEXT_ENCODER_LAYER + 1))
    randomize(text, seed + 3).save_pretrained(root / "text_encoder")

    MiniMaxH3Scheduler(shift=12.0).save_pretrained(root / "scheduler")
    MiniMaxH3Scheduler(shift=3.0).save_pretrained(root / "audio_scheduler")
    for name in ("tokenizer", "processor"):
        shutil.copytree(asset_dir(name), root / name, dirs_exist_ok=True)
    shutil.copyfile(RELEASED_INDEX, root / "modular_model_index.json")
    return root
