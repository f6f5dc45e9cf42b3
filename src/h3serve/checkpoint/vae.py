"""The video and audio VAEs' published layouts, read into `model.video_vae.VideoVAE` and `model.audio_vae.AudioVAE`.

Video VAE:
* ``original``: `FL2VA/video_vae/` — `config.json` (clip geometry, tiling, latent statistics) and `source/` with
  `config.json` (architecture) and `model.safetensors`. Our parameter names; loads as is. Its two configs map to
  one `VideoVAEConfig` here (`original_video_vae_config`), with the switches the release fixes checked.
* ``diffusers``: `vae/` — `config.json` and weights (one file or an index with shards). Renamed keys, `to_qkv` split
  into `to_q/k/v`, `ff.w1` halves swapped to `[up; gate]`, no `decoder.mask_token`; all fixed here, at load.

Audio VAE: `FL2VA/audio_vae/` (`metadata.json` + `config.json` + `model.safetensors`) or `audio_vae/`
(`config.json` + weights). The key names are the same in both; only the config files differ.

Both VAEs are float32 in the release and stay float32 here (the video decode uses fp16 autocast, not fp16 weights).
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from h3serve.checkpoint.reader import CheckpointError
from h3serve.checkpoint.rows import interleave_qkv, swap_halves
from h3serve.checkpoint.safetensors import Checkpoint, Source, assign_from_checkpoint, naming_by_marker, open_checkpoint
from h3serve.model.audio_vae import AudioVAE, AudioVAEConfig
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
            return original_video_vae_config(config, source), weights
        if "ch_mult" in config:  # the original architecture config: `video_vae/source/`
            wrapper = _read_json(path.parent / "config.json")
            weights = path / wrapper.get("source_safetensors_path", "model.safetensors")
            return original_video_vae_config(wrapper, config), weights
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointError(f"{path / 'config.json'}: invalid video VAE config: {err!r}") from err
    raise CheckpointError(f"{path / 'config.json'}: neither an original nor a diffusers H3 video VAE config")


def original_video_vae_config(wrapper: Mapping[str, Any], source: Mapping[str, Any]) -> VideoVAEConfig:
    """The config of the original `video_vae/config.json` (wrapper) and `video_vae/source/config.json` (source).

    Both files carry switches that only ever take one value in the release; anything else would need code
    `model.video_vae` does not have, so it is refused rather than silently computed the released way.
    """
    _check_original_source(source)
    _check_original_wrapper(wrapper, source["embed_dim"])
    vit = source.get("vit_decoder_kwargs", {})
    return VideoVAEConfig(
        in_channels=source["in_channels"],
        out_channels=source["out_ch"],
        latent_channels=source["embed_dim"],
        block_out_channels=tuple(source["ch"] * m for m in source["ch_mult"]),
        layers_per_block=source["num_res_blocks"],
        spatial_downsample_factors=source["space_down"],
        temporal_downsample_factors=source["time_down"],
        spatial_padding_mode=source["padding_mode"],
        decoder_num_layers=vit["num_layers"],
        decoder_num_attention_heads=vit["heads"],
        decoder_attention_head_dim=vit["dim_head"],
        decoder_rope_theta=float(vit["rope_theta"]),
        decoder_rope_dim_ratio=float(vit["rope_dim_ratio"]),
        clip_length=wrapper["vae_clip_length"],
        token_drop=wrapper["vae_token_drop"],
        latents_mean=wrapper["latents_mean"],
        latents_std=wrapper["latents_std"],
        tile_size=int(wrapper.get("vae_tile_size", 256)),
        tile_overlap_min=int(wrapper.get("vae_tile_overlap_min", 64)),
        encoder_tiling=bool(wrapper.get("vae_encoder_tiling", 1)),
        decoder_tiling=bool(wrapper.get("vae_decoder_tiling", 1)),
    )


# The original source config's switches and the only values the release (and `model.video_vae`) has.
_SOURCE_FIXED = {
    "causal_encoder": True,
    "causal_decoder": False,
    "use_3d_conv": True,
    "use_vit_decoder": True,
    "use_t_isolated_gn": True,
    "pixel_norm_type": "imagenet",  # the pixel convention `VideoVAE.rgb_to_input` / `output_to_rgb` implement
    "scaling_factor": 1.0,
    "shift_factor": 0.0,
    "zq_ch_encoder": None,
    "zq_ch_decoder": None,
    "num_res_blocks_decoder": None,
    "padding_mode_t": None,
}
_VIT_FIXED = {
    "ffn_activation_fn": "silu",
    "ffn_use_gated": True,
    "norm_type": "rms_norm",
    "norm_affine": True,
    "qk_norm_type": "rms_norm",
    "qk_norm_affine": False,
}
# Wrapper keys: the ones `original_video_vae_config` reads, metadata, and settings the release fixes (multi-GPU and
# chunking switches of the original code). Anything else, or another value of a fixed one, is refused.
_WRAPPER_READ = frozenset(
    {"vae_clip_length", "vae_token_drop", "latents_mean", "latents_std", "latent_channels", "vae_tile_size"}
    | {"vae_tile_overlap_min", "vae_encoder_tiling", "vae_decoder_tiling", "source_path", "source_safetensors_path"}
)
_WRAPPER_METADATA = frozenset({"_class_name", "_diffusers_version", "auto_map", "source_class_name"})
_WRAPPER_FIXED = {
    "mode": "standalone",
    "vae_parallel_tiling": 1,
    "vae_encoder_parallel": 0,
    "vae_decoder_parallel": 0,
    "vae_chunk_dim": -1,
}


def _check_original_source(source: Mapping[str, Any]) -> None:
    for key, expected in _SOURCE_FIXED.items():
        if source.get(key, expected) != expected:
            raise ValueError(
                f"video_vae/source/config.json: {key}={source[key]!r} is not supported (only {expected!r})"
            )
    vit = source.get("vit_decoder_kwargs", {})
    for key, expected in _VIT_FIXED.items():
        if vit.get(key, expected) != expected:
            raise ValueError(f"vit_decoder_kwargs.{key}={vit[key]!r} is not supported (only {expected!r})")
    if source["z_channels"] != source["embed_dim"]:
        raise ValueError("z_channels and embed_dim differ; the released VAE has them equal")
    ratio_s, ratio_t = math.prod(source["space_down"]), math.prod(source["time_down"])
    if source.get("vae_ratio", ratio_s) != ratio_s or source.get("vae_ratio_t", ratio_t) != ratio_t:
        raise ValueError("vae_ratio / vae_ratio_t disagree with space_down / time_down")


def _check_original_wrapper(wrapper: Mapping[str, Any], embed_dim: int) -> None:
    unknown = sorted(set(wrapper) - _WRAPPER_READ - _WRAPPER_METADATA - set(_WRAPPER_FIXED))
    if unknown:
        raise ValueError(f"video_vae/config.json: unknown keys {unknown}")
    for key, expected in _WRAPPER_FIXED.items():
        if wrapper.get(key, expected) != expected:
            raise ValueError(f"video_vae/config.json: {key}={wrapper[key]!r} is not supported (only {expected!r})")
    if wrapper.get("latent_channels", embed_dim) != embed_dim:
        raise ValueError("video_vae/config.json latent_channels disagrees with source embed_dim")


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


def _interleaved_qkv(heads: int) -> Callable[[list[torch.Tensor]], torch.Tensor]:
    def build(ts: list[torch.Tensor]) -> torch.Tensor:
        # to_q, to_k, to_v (H*D, ...) each -> (3*H*D, ...) as [h0: q k v, h1: q k v, ...]
        return interleave_qkv(torch.cat(ts, dim=0), heads)

    return build


def _gate_up(ts: list[torch.Tensor]) -> torch.Tensor:
    return swap_halves(ts[0])  # diffusers' SwiGLU reads [up; gate], the original stores [gate; up]


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
            plan[name] = Source(keys, _interleaved_qkv(cfg.decoder_num_attention_heads))
        elif ".ff.w1." in name:
            plan[name] = Source((_diffusers_video_name(name),), _gate_up)
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
