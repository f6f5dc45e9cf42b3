"""A model folder in the diffusers layout holding the tiny model's config files and no weights."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from h3serve.model.tiny import TINY_AUDIO_VAE, TINY_DIT, TINY_VIDEO_VAE, tiny_text_encoder_config

RECIPE = ("tile_size", "tile_overlap_min", "encoder_tiling", "decoder_tiling")


def write_config_folder(root: Path, *, dit=TINY_DIT, video=TINY_VIDEO_VAE, audio=TINY_AUDIO_VAE, text_layers=51):
    """The diffusers layout's folders with their config files and no weights."""
    for name in ("transformer", "text_encoder", "tokenizer", "processor", "vae", "audio_vae"):
        (root / name).mkdir(parents=True, exist_ok=True)
    (root / "transformer" / "config.json").write_text(json.dumps(dit.to_dict()))
    tiny_text_encoder_config(text_layers).save_pretrained(root / "text_encoder")
    video_keys = {k: v for k, v in asdict(video).items() if k not in RECIPE}
    (root / "vae" / "config.json").write_text(json.dumps({"_class_name": "AutoencoderKLMiniMaxH3", **video_keys}))
    audio_keys = {"_class_name": "AutoencoderKLMiniMaxH3Audio", **asdict(audio)}
    (root / "audio_vae" / "config.json").write_text(json.dumps(audio_keys))
    return root
