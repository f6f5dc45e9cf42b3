"""Model configurations (frozen dataclasses keyed like the released `config.json` files, validated on construction)
and the released model's fixed facts: the numbers no config file states but the checkpoint was trained with.

Each fact has its home here and nowhere else; the pipeline, the CLI and the media writer import them.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from enum import IntEnum
from pathlib import Path
from typing import Any


class Modality(IntEnum):
    """The modality tag of a packed row. The value selects the row's AdaLN column block `[video | text | audio]`,
    so the numbering is a checkpoint contract. Vision-block rows inside the text stream are tagged VIDEO."""

    VIDEO = 0
    TEXT = 1
    AUDIO = 2


# The DiT keeps one AdaLN parameter set per (timestep, modality) pair.
NUM_MODALITIES = len(Modality)
# Six modulation vectors per block: shift/scale/gate before attention and before the MLP.
NUM_BLOCK_MODULATIONS = 6
# Distinct timesteps one forward can see (layout.timestep_plan): the video clock, the audio clock, the keyframes' or
# reference videos' max(t_video, 0.999), and Ref2VA's clean reference audio at 1.0.
MAX_TIMESTEPS = 4

# --- the released recipe --------------------------------------------------------------------------------------
FPS = 24  # video frame rate
SAMPLE_RATE = 32_000  # audio sample rate (Hz); stereo travels as two mono channels
AUDIO_LATENTS_PER_SECOND = 40  # audio VAE hop 800 at 32 kHz; also the RoPE time clock
VIDEO_SHIFT = 12.0  # schedule shift of the video sigmas
AUDIO_SHIFT = 3.0  # schedule shift of the audio sigmas
DEFAULT_STEPS = 50  # the released sampler's default grid (num_inference_steps): 49 DiT forwards
SPATIAL_RATIO = 16  # video VAE: pixels per latent, each side
TEMPORAL_RATIO = 4  # video VAE: pixel frames per latent frame
CLIP_FRAMES = 17  # video VAE: pixel frames per encoded clip (the frame grid these give: `vocab.snap_up`)
LATENTS_PER_CLIP = 5  # latent frames per clip (ceil(17 / 4))
TOKEN_DROP = 3  # video VAE: latent frames dropped from the end of an encoded video (its config's token_drop)
PATCH_SIZE = (1, 2, 2)  # DiT patch (t, h, w) over the video latents
# The H.264 encode (media.h264): here, not in media, so that reading the settings (`--help`, `check`, `ready`) does not
# import av. Every value but the workers is part of the file's bytes. Chosen from the table measured on the GPU
# machine's 16-core host (bench/encode.py; bench/results/README.md, "The MP4 as fast as the render", 2026-12-07): the
# fewest bytes among the settings at least 5x faster than the writer before (x264 medium, 4 threads, one stream) at
# an equal or better PSNR, on natural-looking content and on noise alike. Only ultrafast gets there at CRF 18; it
# spends more bytes (about 3.4x on the natural content, 1.35x on noise).
X264_PRESETS = ("ultrafast", "superfast", "veryfast", "faster", "fast", "medium", "slow", "slower", "veryslow")
ENCODER_PRESET = "ultrafast"
# x264 frame threads of each segment's encoder. Pinned, never 0 ("auto"): x264's output depends on its thread count.
ENCODER_THREADS = 8
MAX_ENCODER_THREADS = 64
# Frames per independently encoded segment (a closed group of pictures; 0: one stream): the default request's 124
# frames are two.
ENCODER_SEGMENT_FRAMES = 62

# diffusers' `transformer/config.json` names -> the original `FL2VA/transformer/config.json` names.
_DIFFUSERS_DIT_KEYS = {
    "num_refiner_layers": "token_refiner_num_layers",
    "ffn_dim": "ffn_hidden_size",
    "in_channels": "latents_dim",
    "audio_in_channels": "audio_latents_dim",
    "freq_dim": "timestep_input_dim",
    "time_embed_hidden_dim": "time_embed_hidden_size",
    "rope_freq_dim": "rope_inv_freq_len",
}


def from_diffusers_keys(cls: type, config: dict[str, Any], what: str, *, exclude: frozenset[str] = frozenset()):
    """Build a config dataclass whose fields are a diffusers `config.json`'s keys (metadata keys start with `_`).

    Unknown keys are an error, not ignored; `exclude` names fields the file must not set (recipe settings that the
    diffusers port hard-codes). The latent statistics are required.
    """
    known = {f.name for f in fields(cls)} - exclude
    values = {k: v for k, v in config.items() if not k.startswith("_")}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"unknown keys in diffusers {what} config: {unknown}; allowed: {sorted(known)}")
    if "latents_mean" not in values or "latents_std" not in values:
        raise ValueError(f"diffusers {what} config lacks latents_mean / latents_std")
    return cls(**values)


_FLOAT_FIELDS = frozenset({"norm_eps", "qk_norm_eps", "final_norm_eps", "rope_theta"})


@dataclass(frozen=True)
class DiTConfig:
    """The H3 DiT, with the field names of the released `FL2VA/transformer/config.json`.

    `rope_theta` is not in the original file (the original ships the `rope.inv_freq` buffer instead); it is in the
    diffusers file, and 10000 reproduces the shipped buffer.
    """

    hidden_size: int = 5376
    num_layers: int = 50
    token_refiner_num_layers: int = 2
    num_attention_heads: int = 56
    attention_head_dim: int = 128
    ffn_hidden_size: int = 14336
    latents_dim: int = 24
    audio_latents_dim: int = 32
    patch_size: tuple[int, int, int] = PATCH_SIZE
    text_dim: int = 5120
    timestep_input_dim: int = 256
    time_embed_hidden_size: int = 5376
    time_embed_dim: int = 2688
    adaln_out_features: int = 96768
    final_adaln_out_features: int = 10752
    rope_inv_freq_len: int = 16
    norm_eps: float = 1e-5
    qk_norm_eps: float = 1e-5
    final_norm_eps: float = 1e-5
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "patch_size", tuple(int(p) for p in self.patch_size))
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "patch_size":
                if len(value) != 3 or any(p < 1 for p in value):
                    raise ValueError(f"patch_size must be three positive ints (t, h, w), got {value}")
            elif isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise ValueError(f"{f.name} must be a positive number, got {value!r}")
        for f in fields(self):
            if f.name not in _FLOAT_FIELDS and f.name != "patch_size" and not isinstance(getattr(self, f.name), int):
                raise ValueError(f"{f.name} must be an int, got {getattr(self, f.name)!r}")
        if self.adaln_out_features != NUM_BLOCK_MODULATIONS * NUM_MODALITIES * self.hidden_size:
            raise ValueError(
                f"adaln_out_features must be 6 x 3 modalities x hidden_size = "
                f"{NUM_BLOCK_MODULATIONS * NUM_MODALITIES * self.hidden_size}, got {self.adaln_out_features}"
            )
        if self.final_adaln_out_features != 2 * self.hidden_size:
            raise ValueError(
                f"final_adaln_out_features must be 2 x hidden_size = {2 * self.hidden_size}, "
                f"got {self.final_adaln_out_features}"
            )
        if self.attention_head_dim % 2:
            raise ValueError(f"attention_head_dim must be even for rotate-half RoPE, got {self.attention_head_dim}")
        if self.rotary_dim > self.attention_head_dim:
            raise ValueError(
                f"the rotary dims (2 x 3 axes x rope_inv_freq_len = {self.rotary_dim}) must not exceed "
                f"attention_head_dim ({self.attention_head_dim})"
            )
        if self.timestep_input_dim % 2:
            raise ValueError(f"timestep_input_dim must be even (cos and sin halves), got {self.timestep_input_dim}")

    @property
    def inner_dim(self) -> int:
        """Attention width; larger than hidden_size in the released model (56 x 128 = 7168 > 5376)."""
        return self.num_attention_heads * self.attention_head_dim

    @property
    def rotary_dim(self) -> int:
        """Channels of each head that RoPE rotates: three axes of rope_inv_freq_len angles, duplicated."""
        return 2 * 3 * self.rope_inv_freq_len

    @property
    def video_patch_dim(self) -> int:
        return self.latents_dim * self.patch_size[0] * self.patch_size[1] * self.patch_size[2]

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DiTConfig:
        """Read either the original or the diffusers `config.json` (keys starting with `_` are metadata)."""
        values: dict[str, Any] = {}
        known = {f.name for f in fields(cls)}
        for key, value in data.items():
            if key.startswith("_"):
                continue
            name = _DIFFUSERS_DIT_KEYS.get(key, key)
            if name not in known:
                raise ValueError(f"unknown DiT config key {key!r}; allowed: {sorted(known | set(_DIFFUSERS_DIT_KEYS))}")
            if name in values:
                raise ValueError(f"DiT config key {name!r} given twice (as {key!r} and under its other name)")
            values[name] = tuple(value) if name == "patch_size" else value
        # The diffusers file derives the AdaLN widths instead of storing them.
        hidden = values.get("hidden_size", cls.hidden_size)
        values.setdefault("adaln_out_features", NUM_BLOCK_MODULATIONS * NUM_MODALITIES * hidden)
        values.setdefault("final_adaln_out_features", 2 * hidden)
        return cls(**values)

    @classmethod
    def from_json(cls, path: str | Path) -> DiTConfig:
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"cannot read DiT config {path}: {err}") from err
        try:
            return cls.from_dict(data)
        except (TypeError, ValueError) as err:
            raise ValueError(f"{path}: {err}") from err

    def to_dict(self) -> dict[str, Any]:
        """The original-layout `config.json` keys (plus rope_theta)."""
        out = asdict(self)
        out["patch_size"] = list(self.patch_size)
        return out


# The built-in tiny model's DiT (`model.tiny` builds it): here, beside the released config, so that the start-up
# checks (the split's heads, an adapter's shapes) read it without importing torch.
TINY_VIDEO_LATENT_CHANNELS = 8
TINY_AUDIO_LATENT_CHANNELS = 8
TINY_HIDDEN_SIZE = 48

TINY_DIT = DiTConfig(
    hidden_size=TINY_HIDDEN_SIZE,
    num_layers=2,
    token_refiner_num_layers=2,
    num_attention_heads=4,  # divides by 2 and 4: the split renders' tests run on this model
    attention_head_dim=16,  # attention width 64 != hidden 48
    ffn_hidden_size=80,
    latents_dim=TINY_VIDEO_LATENT_CHANNELS,
    audio_latents_dim=TINY_AUDIO_LATENT_CHANNELS,
    patch_size=(1, 2, 2),
    text_dim=32,  # the tiny Qwen3-VL's hidden size
    timestep_input_dim=32,
    time_embed_hidden_size=56,
    time_embed_dim=24,
    adaln_out_features=NUM_BLOCK_MODULATIONS * NUM_MODALITIES * TINY_HIDDEN_SIZE,
    final_adaln_out_features=2 * TINY_HIDDEN_SIZE,  # shift and scale of the final norm
    rope_inv_freq_len=2,  # 12 of 16 head dims rotate
)
