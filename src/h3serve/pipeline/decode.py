"""Decode: the denoised packed rows -> uint8 video frames and a float stereo waveform.

    decode_video  generated video rows -> latents (de-normalised) -> video VAE -> (F, H, W, 3) uint8 RGB
    decode_audio  audio rows (L then R) -> latents (de-normalised) -> audio VAE -> (2, N) float32 in [-1, 1]

Both refuse non-finite values instead of writing them: a NaN would otherwise reach the MP4 as black pixels.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from h3serve.media.yuv import rgb_to_i420
from h3serve.model.audio_vae import AudioVAE
from h3serve.model.video_vae import VideoVAE
from h3serve.pipeline.layout import PackedLayout, audio_rows_to_latents, unpatchify_video
from h3serve.pipeline.video_decode import LOCAL_TILES, TileSource, decode


def check_finite(video_rows: torch.Tensor, audio_rows: torch.Tensor) -> None:
    """Fail closed on denoised latents holding NaN or inf, before any decode time is spent."""
    if not (torch.isfinite(video_rows).all() and torch.isfinite(audio_rows).all()):
        raise RuntimeError("the denoised latents are not finite (NaN or inf); nothing was decoded")


@torch.no_grad()
def decode_video(
    vae: VideoVAE,
    video_rows: torch.Tensor,
    layout: PackedLayout,
    autocast: torch.dtype | None = None,
    on_window: Callable[[int, int], None] | None = None,
    source: TileSource = LOCAL_TILES,
    on_frames: Callable[[np.ndarray], None] | None = None,
) -> np.ndarray | None:
    """video_rows: every video row of the layout, keyframe rows first (as the denoise loop returns them).

    autocast: the decoder's autocast dtype (float16 is the released recipe on the GPU), or None for pure float32.
    on_window(done, total): called after each temporal decode window; source: where the windows' tiles come from
    (`video_decode.decode`: decoded here, or dealt to the ranks of a split render). Returns (F, H, W, 3) uint8 RGB;
    with `on_frames`, hands it each decode window's final frames as they are made instead, already in the encoder's
    layout (packed yuv420p, (n, H * 3 // 2, W) uint8, in order; converted where they were decoded, `media.yuv`), and
    returns None: neither the device nor the host holds the whole video then. A non-finite pixel fails the decode in
    either case (streamed: at its window).
    """
    z = video_latents(vae, video_rows, layout)
    if on_frames is not None:
        host = HostFrames()

        def hand(pixels: torch.Tensor) -> None:
            _check_pixels(pixels)
            on_frames(host(rgb_to_i420(vae.output_to_rgb(pixels)[0])))

        decode(vae, z, autocast_dtype=autocast, source=source, on_window=on_window, on_frames=hand)
        return None
    pixels = decode(vae, z, autocast_dtype=autocast, source=source, on_window=on_window)  # (1, 3, F, H, W)
    _check_pixels(pixels)
    return vae.output_to_rgb(pixels)[0].cpu().numpy()


class HostFrames:
    """A decode's frames to host memory: on CUDA through one page-locked staging buffer, reused window after window
    (grown when a window is larger), then into pageable memory the encoder owns. The page-locked memory stays one
    window's whatever the encoder holds (the service's stream keeps a lagging job's frames unread)."""

    def __init__(self) -> None:
        self._staging: torch.Tensor | None = None

    def __call__(self, frames: torch.Tensor) -> np.ndarray:
        if frames.device.type != "cuda":
            return frames.cpu().numpy()
        n = frames.numel()
        if self._staging is None or self._staging.numel() < n or self._staging.dtype != frames.dtype:
            self._staging = torch.empty(n, dtype=frames.dtype, pin_memory=True)
        staging = self._staging[:n].view(frames.shape)
        staging.copy_(frames, non_blocking=True)
        torch.cuda.current_stream(frames.device).synchronize()
        return staging.numpy().copy()


def to_host(frames: torch.Tensor) -> np.ndarray:
    """One batch of frames to host memory (`HostFrames` for a run of them)."""
    return HostFrames()(frames)


def _check_pixels(pixels: torch.Tensor) -> None:
    if not torch.isfinite(pixels).all():
        raise RuntimeError("the video decoder produced non-finite pixels (NaN or inf)")


def video_latents(vae: VideoVAE, video_rows: torch.Tensor, layout: PackedLayout) -> torch.Tensor:
    """The generated video rows as the decoder's de-normalised latents (1, C, F, h, w)."""
    generated = video_rows[layout.num_condition_video_rows :]
    latents = unpatchify_video(generated, layout.geometry, layout.patch_size)  # normalised
    return vae.cfg.latent_stats.denormalize(latents)


@torch.no_grad()
def decode_audio(vae: AudioVAE, audio_rows: torch.Tensor, layout: PackedLayout) -> np.ndarray:
    """audio_rows: every audio row of the layout, reference rows first (as the denoise loop returns them); the
    generated ones are (channels * Na, C) channel-major. Returns (channels, Na * hop) float32 at the VAE's rate."""
    generated = audio_rows[layout.num_condition_audio_rows :]
    latents = audio_rows_to_latents(generated, layout.audio_channels)  # (2, C, Na), the mono VAE's batch
    wave = vae.decode(vae.cfg.latent_stats.denormalize(latents))  # (2, 1, Na * hop)
    return wave[:, 0].float().cpu().numpy()
