"""Load the video and audio VAEs from either published layout.

Video VAE:
* ``original``: `FL2VA/video_vae/` — `config.json` (clip geometry, tiling, latent statistics) and `source/` with
  `config.json` (architecture) and `model.safetensors`. Our parameter names; loads as is.
* ``diffusers``: `vae/` — `config.json` and weights (one file or an index with shards). Renamed keys, `to_qkv` split
  into `to_q/k/v`, `ff.w1` halves swapped to `[up; gate]`, no `decoder.mask_token`; all fixed here, at load.

Audio VAE: `FL2VA/audio_vae/` (`metadata.json` + `config.json` + `model.safetensors`) or `audio_vae/`
(`config.json` + weights). The key names are the same in both; only the config files differ.

Both VAEs are float32 in the release and stay float32 here (the video decode uses fp16 autocast, not fp16 weights).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from h3serve.model.audio_vae import AudioVAE, AudioVAEConfig
from h3serve.model.loading import (
    Checkpoint,
    CheckpointError,
    Source,
    assign_from_checkpoint,
    naming_by_marker,
    open_checkpoint,
)
from h3serve.model.video_vae import VideoVAE, VideoVAEConfig

log = logging.getLogger(__name__)

VIDEO_VAE_LAYOUTS = ("original", "diffusers")


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise CheckpointError(f"{path}: config file is missing")
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path}: not a readable JSON config: {err}") from err


# ----------------------------------------------------------------------------------------------- video VAE
def read_video_vae_config(path: Path) -> tuple[VideoVAEConfig, Path]:
    """Config and weights location for a `video_vae/`, `video_vae/source/` or diffusers `vae/` folder."""
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a video VAE folder")
    config = _read_json(path / "config.json")
    try:
        if config.get("_class_name") == "AutoencoderKLMiniMaxH3":
            return VideoVAEConfig.from_diffusers(config), path
        if "source_path" in config:  # the original wrapper: `video_vae/`
            source_dir = path / config["source_path"]
            source = _read_json(source_dir / "config.json")
            weights = source_dir / config.get("source_safetensors_path", "model.safetensors")
            return VideoVAEConfig.from_original(config, source), weights
        if "ch_mult" in config:  # the original architecture config: `video_vae/source/`
            wrapper = _read_json(path.parent / "config.json")
            weights = path / wrapper.get("source_safetensors_path", "model.safetensors")
            return VideoVAEConfig.from_original(wrapper, config), weights
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointError(f"{path / 'config.json'}: invalid video VAE config: {err!r}") from err
    raise CheckpointError(f"{path / 'config.json'}: neither an original nor a diffusers H3 video VAE config")


def detect_video_vae_layout(ckpt: Checkpoint) -> str:
    markers = {"original": "decoder.x_embedder.weight", "diffusers": "decoder.proj_in.weight"}
    return naming_by_marker(ckpt, "video VAE", markers)


_VIDEO_RENAMES = (  # our (original) name pattern -> diffusers name
    (
        re.compile(r"^encoder\.down\.(\d+)\.block\.(\d+)\.nin_shortcut\."),
        r"encoder.down_blocks.\1.resnets.\2.conv_shortcut.",
    ),
    (re.compile(r"^encoder\.down\.(\d+)\.block\.(\d+)\."), r"encoder.down_blocks.\1.resnets.\2."),
    (re.compile(r"^encoder\.down\.(\d+)\.downsample\."), r"encoder.down_blocks.\1.downsamplers.0."),
    (re.compile(r"^decoder\.x_embedder\."), "decoder.proj_in."),
    (re.compile(r"\.attn\.to_out\."), ".attn.to_out.0."),
    (re.compile(r"\.ff\.w1\."), ".ff.net.0.proj."),
    (re.compile(r"\.ff\.w2\."), ".ff.net.2."),
)


def _diffusers_video_name(name: str) -> str:
    for pattern, repl in _VIDEO_RENAMES:
        name = pattern.sub(repl, name)
    return name


def _interleave_qkv(heads: int, head_dim: int) -> Callable[[list[torch.Tensor]], torch.Tensor]:
    def build(ts: list[torch.Tensor]) -> torch.Tensor:
        # to_q, to_k, to_v (H*D, ...) each -> (3*H*D, ...) as [h0: q k v, h1: q k v, ...]
        per_head = [t.reshape(heads, head_dim, *t.shape[1:]) for t in ts]
        return torch.cat(per_head, dim=1).reshape(3 * heads * head_dim, *ts[0].shape[1:])

    return build


def _up_gate_to_gate_up(ts: list[torch.Tensor]) -> torch.Tensor:
    up, gate = ts[0].chunk(2, dim=0)  # diffusers SwiGLU reads [up; gate], the original stores [gate; up]
    return torch.cat((gate, up), dim=0)


def video_vae_plan(model: VideoVAE, layout: str) -> dict[str, Source]:
    """Module name -> Source for one video VAE layout."""
    if layout not in VIDEO_VAE_LAYOUTS:
        raise ValueError(f"unknown video VAE layout {layout!r}; allowed: {list(VIDEO_VAE_LAYOUTS)}")
    cfg = model.cfg
    plan: dict[str, Source] = {}
    for name, tensor in model.state_dict().items():
        if layout == "original":
            plan[name] = Source((name,))
        elif name == "decoder.mask_token":
            shape = tuple(tensor.shape)  # diffusers drops this unused all-zero buffer
            plan[name] = Source((), lambda _, shape=shape: torch.zeros(shape))
        elif ".attn.to_qkv." in name:
            stem, suffix = name.split(".attn.to_qkv.")
            keys = tuple(f"{stem}.attn.to_{p}.{suffix}" for p in "qkv")
            plan[name] = Source(keys, _interleave_qkv(cfg.decoder_num_attention_heads, cfg.decoder_attention_head_dim))
        elif ".ff.w1." in name:
            plan[name] = Source((_diffusers_video_name(name),), _up_gate_to_gate_up)
        else:
            plan[name] = Source((_diffusers_video_name(name),))
    return plan


def load_video_vae(
    path: str | Path,
    *,
    device: torch.device | str = "cpu",
    config: VideoVAEConfig | None = None,
    layout: str | None = None,
    dtype_of: Callable[[str], torch.dtype] | None = None,
) -> VideoVAE:
    """Load the video VAE from `FL2VA/video_vae/`, `FL2VA/video_vae/source/` or diffusers `vae/`.

    The key layout is detected from the weights; `config` overrides the config files. Weights must be float32.
    `dtype_of`: each tensor's dtype as it is read (float32 unless told; the CUDA profile stores the decoder's linears
    and convolutions in float16 as read: `accel.vae.decoder_cast_names`).
    """
    path = Path(path)
    found, weights = read_video_vae_config(path)
    config = config or found
    ckpt = open_checkpoint(weights)
    layout = layout or detect_video_vae_layout(ckpt)
    with torch.device("meta"):
        model = VideoVAE(config)
    assign_from_checkpoint(
        model,
        ckpt,
        video_vae_plan(model, layout),
        device=device,
        dtype_of=dtype_of or (lambda _: torch.float32),
        ckpt_dtype_of=lambda _: torch.float32,
    )
    log.info("loaded H3 video VAE from %s (layout %s, %s)", path, layout, device)
    return model.eval().requires_grad_(False)


# ----------------------------------------------------------------------------------------------- audio VAE
def read_audio_vae_config(path: Path) -> tuple[AudioVAEConfig, Path]:
    if not path.is_dir():
        raise CheckpointError(f"{path}: not an audio VAE folder")
    config = _read_json(path / "config.json")
    try:
        if config.get("_class_name") == "AutoencoderKLMiniMaxH3Audio":
            return AudioVAEConfig.from_diffusers(config), path
        if "source_metadata_path" in config or (path / "metadata.json").is_file():
            metadata = _read_json(path / config.get("source_metadata_path", "metadata.json"))
            weights = path / config.get("source_safetensors_path", "model.safetensors")
            return AudioVAEConfig.from_original(metadata, config), weights
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointError(f"{path}: invalid audio VAE config: {err!r}") from err
    raise CheckpointError(f"{path / 'config.json'}: neither an original nor a diffusers H3 audio VAE config")


def load_audio_vae(
    path: str | Path, *, device: torch.device | str = "cpu", config: AudioVAEConfig | None = None
) -> AudioVAE:
    """Load the audio VAE from `FL2VA/audio_vae/` or diffusers `audio_vae/`; the key names are shared."""
    path = Path(path)
    found, weights = read_audio_vae_config(path)
    config = config or found
    ckpt = open_checkpoint(weights)
    with torch.device("meta"):
        model = AudioVAE(config)
    assign_from_checkpoint(
        model,
        ckpt,
        {name: Source((name,)) for name in model.state_dict()},
        device=device,
        dtype_of=lambda _: torch.float32,
        ckpt_dtype_of=lambda _: torch.float32,
    )
    log.info("loaded H3 audio VAE from %s (%s)", path, device)
    return model.eval().requires_grad_(False)
