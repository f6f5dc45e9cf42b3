"""Model folders for the folder tests: the diffusers layout's config files without weights, and a complete tiny
checkpoint with its DiT rewritten in another released layout."""

from __future__ import annotations

import json
import shutil
import sys
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors.torch import save_file

from h3serve.model.tiny import TINY_AUDIO_VAE, TINY_DIT, TINY_VIDEO_VAE, tiny_text_encoder_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # lib.export: our DiT as checkpoints hold it

# A sharded DiT's index and shard names, by key naming (`FL2VA/transformer` and diffusers `transformer/`).
DIT_INDEX = {
    "original": ("model.safetensors.index.json", "model-{:05d}-of-{:05d}.safetensors"),
    "diffusers": (
        "diffusion_pytorch_model.safetensors.index.json",
        "diffusion_pytorch_model-{:05d}-of-{:05d}.safetensors",
    ),
}
SINGLE_FILE = "minimax_h3_fl2va_bf16.safetensors"  # the community single file's name

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


def write_sharded(folder: Path, state: dict[str, torch.Tensor], naming: str, shards: int = 3) -> Path:
    """`state` as a sharded DiT with `naming`'s index and shard names (keys dealt round-robin over the shards)."""
    folder.mkdir(parents=True, exist_ok=True)
    index_name, shard_name = DIT_INDEX[naming]
    keys = sorted(state)
    weight_map = {}
    for i in range(shards):
        name = shard_name.format(i + 1, shards)
        part = {k: state[k] for k in keys[i::shards]}
        save_file(part, folder / name)
        weight_map.update(dict.fromkeys(part, name))
    total = sum(t.numel() * t.element_size() for t in state.values())
    (folder / index_name).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return folder


def with_dit_layout(checkpoint: Path, root: Path, layout: str) -> Path:
    """A copy of the (diffusers-layout) `checkpoint` at `root` with the same DiT weights in another released layout:

    "original": `FL2VA/transformer`, 13 shards under an index, original names, QKV rows interleaved per head, and
    the original `config.json`;
    "stacked" / "interleaved": one community single file, original names, QKV stacked `[q; k; v]` (what the
    published single files hold) or interleaved (a file merged from the original shards by hand), beside the
    diffusers `config.json` (the single files ship none; a model folder needs one).

    The other components stay as they are: only the DiT's layout differs, so every layout must render the same bytes.
    """
    from lib.export import export_state_dict

    from h3serve.checkpoint.dit import load_dit

    if layout not in ("original", "stacked", "interleaved"):
        raise ValueError(f"unknown DiT layout {layout!r}")
    shutil.copytree(checkpoint, root)
    dit = load_dit(checkpoint / "transformer", dtype=torch.float32)  # bf16 -> fp32 is exact, and back
    folder = root / "transformer"
    for f in folder.glob("*.safetensors*"):
        f.unlink()
    if layout == "original":
        write_sharded(folder, export_state_dict(dit, "interleaved"), "original", shards=13)
        config = {"_class_name": "MiniMaxH3DiTModel", **dit.config.to_dict()}
        (folder / "config.json").write_text(json.dumps(config))
    else:
        save_file(export_state_dict(dit, layout), folder / SINGLE_FILE)
    return root
