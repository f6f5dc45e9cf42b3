"""Every loaded model a render needs, as one value (`Components`), and the rules by which they fit each other.

The pipeline receives loaded `Components` and knows no folder names: `checkpoint.folder.load_components` reads them
from a released checkpoint, `model.tiny.tiny_components` builds the tiny one.
"""

from __future__ import annotations

from dataclasses import dataclass

from h3serve.config import AUDIO_LATENTS_PER_SECOND, CLIP_FRAMES, PATCH_SIZE, SPATIAL_RATIO, TEMPORAL_RATIO, DiTConfig
from h3serve.model.audio_vae import AudioVAE, AudioVAEConfig
from h3serve.model.dit import H3DiT
from h3serve.model.text_encoder import TextEncoder
from h3serve.model.video_vae import VideoVAE, VideoVAEConfig
from h3serve.vocab import TASK_TYPES, DiTKind


@dataclass
class Components:
    """Every loaded model a render needs; the engine runs them. `dit` is the FL2VA DiT, `ref_dit` the Ref2VA DiT;
    either may be absent (not loaded), never both."""

    dit: H3DiT | None
    text_encoder: TextEncoder
    video_vae: VideoVAE
    audio_vae: AudioVAE
    name: str
    ref_dit: H3DiT | None = None
    adaln_mapped: bool = False  # the DiTs' block AdaLN weights are views of their checkpoint files, unread (`mapped`)

    @property
    def dits(self) -> dict[str, H3DiT]:
        """The loaded DiTs by kind (`DiTKind`)."""
        loaded = ((DiTKind.FL2VA, self.dit), (DiTKind.REF2VA, self.ref_dit))
        return {kind: dit for kind, dit in loaded if dit is not None}

    @property
    def task_type(self) -> str:
        """fl2va, ref2va or both: which DiTs are loaded."""
        kinds = tuple(self.dits)
        return next(name for name, loaded in TASK_TYPES.items() if loaded == kinds)

    @property
    def dit_config(self) -> DiTConfig:
        """The (shared) architecture of the loaded DiTs."""
        return next(iter(self.dits.values())).config

    def check(self) -> None:
        """The components must fit each other (see `check_compatible`), and the two DiTs share one architecture."""
        if not self.dits:
            raise ValueError("no DiT is loaded: load the FL2VA DiT, the Ref2VA DiT or both")
        if self.dit is not None and self.ref_dit is not None and self.dit.config != self.ref_dit.config:
            raise ValueError("the Ref2VA DiT's configuration differs from the FL2VA DiT's")
        text_hidden = self.text_encoder.model.config.text_config.hidden_size
        check_compatible(self.dit_config, self.video_vae.cfg, self.audio_vae.cfg, text_hidden)


def check_compatible(dit: DiTConfig, video: VideoVAEConfig, audio: AudioVAEConfig, text_hidden_size: int) -> None:
    """The components must fit each other and the pipeline's fixed geometry (1/16 spatial and 1/4 temporal video
    latents on 17-frame clips, 40 audio latents per second); the message names both sides of a mismatch."""
    pairs = [
        ("transformer text_dim", dit.text_dim, "text encoder hidden_size", text_hidden_size),
        ("transformer latents_dim", dit.latents_dim, "video VAE latent_channels", video.latent_channels),
        ("transformer audio_latents_dim", dit.audio_latents_dim, "audio VAE latent_channels", audio.latent_channels),
        ("transformer patch_size", dit.patch_size, "the pipeline's", PATCH_SIZE),
        ("video VAE spatial ratio", video.spatial_ratio, "the pipeline's", SPATIAL_RATIO),
        ("video VAE temporal ratio", video.temporal_ratio, "the pipeline's", TEMPORAL_RATIO),
        ("video VAE clip_length", video.clip_length, "the pipeline's", CLIP_FRAMES),
        (
            "audio VAE latents per second",
            audio.sampling_rate / audio.hop_length,
            "the pipeline's",
            AUDIO_LATENTS_PER_SECOND,
        ),
    ]
    for left, a, right, b in pairs:
        if a != b:
            raise ValueError(f"incompatible model components: {left} is {_fmt(a)} but {right} is {_fmt(b)}")


def _fmt(value: object) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)
