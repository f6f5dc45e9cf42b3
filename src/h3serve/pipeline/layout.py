"""The packed sequence of one request: which row holds what, at which time and where in RoPE space.

H3 denoises a single sequence per request, in the row order

    [ text (Qwen rows) | keyframe rows (0, 1 or 2 frames) | audio L then R | target video ]

A task variant is data: T2VA, I2VA, L2VA and FL2VA differ only in the keyframe anchors they pack
(`TASK_ANCHORS`). Everything here is plain tensors built on the CPU once per request; the denoise loop and
the DiT read them and never change them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from h3serve.config import (
    AUDIO_LATENTS_PER_SECOND,
    CLIP_FRAMES,
    FPS,
    LATENTS_PER_CLIP,
    PATCH_SIZE,
    SPATIAL_RATIO,
    Modality,
)

# Keyframe anchors per task, in packed order. Ref2VA is a different layout and is not built here.
TASK_ANCHORS: dict[str, tuple[str, ...]] = {
    "t2va": (),
    "i2va": ("first",),
    "l2va": ("last",),
    "fl2va": ("first", "last"),
}

# Conditioning rows are noised once to t = 0.999 and held there (or at t_video when that is cleaner).
CONDITION_TIMESTEP = 0.999

# One latent frame spans (5/3) * m RoPE time units, m following the VAE's 1, 4, 4, 4, 4 pixel-frame grouping:
# 40 units per second at 24 fps, the same clock as the 40 Hz audio latents (one unit each).
ROPE_FRAME_UNITS = 5.0 / 3.0
ROPE_FRAMES_PER_LATENT = (1, 4, 4, 4, 4)
ROPE_SPATIAL_SCALE = 32

# Which clock a row's timestep follows: the generated video (text rows ride along), the generated audio, or the
# conditioning floor max(t_video, 0.999).
CLOCK_VIDEO = 0
CLOCK_AUDIO = 1
CLOCK_CONDITION = 2


@dataclass(frozen=True)
class MediaGeometry:
    """Latent sizes of the generated media, before patching."""

    latent_frames: int  # F = 5n + 2 for 17n + 5 pixel frames
    latent_height: int  # H / 16
    latent_width: int  # W / 16
    audio_latents: int  # per stereo channel, 40 per second

    @classmethod
    def from_pixels(cls, height: int, width: int, num_frames: int) -> MediaGeometry:
        """The latent sizes of a canvas and a frame count on the 17n+5 grid."""
        if num_frames % CLIP_FRAMES != LATENTS_PER_CLIP:
            raise ValueError(f"num_frames must be of the form {CLIP_FRAMES}n+{LATENTS_PER_CLIP}, got {num_frames}")
        if height % SPATIAL_RATIO or width % SPATIAL_RATIO:
            raise ValueError(f"height and width must be multiples of {SPATIAL_RATIO}, got {height}x{width}")
        # Each 17-frame clip gives 5 latents and the encoder drops 3 at the end: 17n+5 frames -> 5n+2 latents.
        latent_frames = (num_frames - LATENTS_PER_CLIP) // CLIP_FRAMES * LATENTS_PER_CLIP + 2
        return cls(
            latent_frames=latent_frames,
            latent_height=height // SPATIAL_RATIO,
            latent_width=width // SPATIAL_RATIO,
            audio_latents=round(num_frames / FPS * AUDIO_LATENTS_PER_SECOND),
        )


def spatial_grid(dim: int, patch: int, sqrt_area: float) -> np.ndarray:
    """One aspect-normalised RoPE axis: `dim // patch` points, float64, centred near 16.

    numpy on purpose: `np.linspace(endpoint=False)` is `start + k * step` and `torch.linspace` differs from it by an
    ulp, which the released positions do not forgive. The stop is written `left + ratio`, as the reference does.
    """
    ratio = dim / sqrt_area
    left = (1.0 - ratio) / 2.0
    return np.linspace(left, left + ratio, dim // patch, endpoint=False) * ROPE_SPATIAL_SCALE


def frame_times(num_latent_frames: int, origin: float) -> np.ndarray:
    """RoPE time of every latent frame: origin, then steps of (5/3) * (1, 4, 4, 4, 4, 1, 4, ...), summed in order."""
    spans = np.array(
        [ROPE_FRAME_UNITS * ROPE_FRAMES_PER_LATENT[k % len(ROPE_FRAMES_PER_LATENT)] for k in range(num_latent_frames)],
        dtype=np.float64,
    )
    return origin + np.concatenate([np.zeros(1), np.cumsum(spans[:-1])])


def last_frame_time(num_latent_frames: int, origin: float) -> float:
    """RoPE time of a "last" keyframe: the time of the last *pixel* frame, origin + (5/3) * (num_frames - 1).

    Computed as the reference does, all spans summed with numpy's pairwise `sum`, minus one 5/3; a sequential
    sum of the same series differs in the last ulp from 16 latent frames on.
    """
    spans = np.ones(num_latent_frames, dtype=np.float64) * ROPE_FRAME_UNITS
    for offset, m in enumerate(ROPE_FRAMES_PER_LATENT):
        spans[offset :: len(ROPE_FRAMES_PER_LATENT)] *= m
    return float(origin) + float(spans.sum()) - ROPE_FRAME_UNITS


@dataclass(frozen=True)
class PackedLayout:
    """Rows, tags, clocks, RoPE positions and scatter indices of one request's packed sequence.

    `video_indices` lists the keyframe rows first, then the target video rows; the DiT's video input and output
    follow that order, as do `audio_indices` (L then R) for the audio rows.
    """

    anchors: tuple[str, ...]
    geometry: MediaGeometry
    patch_size: tuple[int, int, int]
    audio_channels: int
    num_text: int
    rows_per_frame: int
    token_tags: torch.Tensor  # (S,) int64 Modality values
    row_clock: torch.Tensor  # (S,) int64: CLOCK_VIDEO / CLOCK_AUDIO / CLOCK_CONDITION
    position_ids: torch.Tensor  # (S, 3) float64 (t, h, w)
    text_indices: torch.Tensor  # (L,) int64
    video_indices: torch.Tensor  # (Nc + Nv,) int64
    audio_indices: torch.Tensor  # (2 * Na,) int64

    @property
    def num_condition_video_rows(self) -> int:
        return len(self.anchors) * self.rows_per_frame

    @property
    def num_video_rows(self) -> int:
        """Generated video rows (the keyframe rows not counted)."""
        return self.geometry.latent_frames * self.rows_per_frame

    @property
    def num_audio_rows(self) -> int:
        return self.geometry.audio_latents * self.audio_channels

    def rope_positions(self) -> torch.Tensor:
        """(S, 3) float32: the float64 grid rounded once, which is what the DiT's RoPE consumes."""
        return self.position_ids.to(torch.float32)

    def timestep_plan(self, t_video: float, t_audio: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Distinct timesteps of one step and every row's index into them.

        Text and target video rows take t_video, target audio rows t_audio, keyframe rows max(t_video, 0.999).
        Values are float32 and sorted ascending, as the DiT's AdaLN table expects: ((M,) float32, (S,) int64).
        """
        # max() on Python floats, then one rounding to float32, matches the reference's row-wise fill.
        per_clock = torch.tensor(
            [float(t_video), float(t_audio), max(float(t_video), CONDITION_TIMESTEP)], dtype=torch.float32
        )
        present = torch.unique(self.row_clock)
        values, inverse = torch.unique(per_clock[present], sorted=True, return_inverse=True)
        lookup = torch.zeros(3, dtype=torch.long)
        lookup[present] = inverse
        return values, lookup[self.row_clock]


def build_layout(
    text_tags: Sequence[int] | torch.Tensor,
    geometry: MediaGeometry,
    anchors: Sequence[str] = (),
    *,
    patch_size: tuple[int, int, int] = PATCH_SIZE,
    audio_channels: int = 2,
) -> PackedLayout:
    """Build the `[text | keyframes | audio L, R | video]` layout.

    text_tags: the modality tag of every text-encoder row (TEXT, or VIDEO inside a keyframe's vision block).
    anchors: "first" and/or "last" per keyframe, in packed order (see `TASK_ANCHORS`).
    """
    text_tags = torch.as_tensor(text_tags, dtype=torch.long).reshape(-1)
    anchors = tuple(anchors)
    for anchor in anchors:
        if anchor not in ("first", "last"):
            raise ValueError(f"keyframe anchor must be 'first' or 'last', got {anchor!r}")
    patch_t, patch_h, patch_w = patch_size
    g = geometry
    if patch_t != 1:
        # The temporal RoPE clock counts latent frames; a temporal patch would need its own clock.
        raise ValueError(f"only a temporal patch of 1 is supported, got patch_size={patch_size}")
    if g.latent_height % patch_h or g.latent_width % patch_w:
        raise ValueError(f"latent {g.latent_height}x{g.latent_width} is not divisible by the patch {patch_size}")

    s = _Spans(
        num_text=int(text_tags.shape[0]),
        rows_per_frame=(g.latent_height // patch_h) * (g.latent_width // patch_w),
        num_anchors=len(anchors),
        num_audio=g.audio_latents * audio_channels,
        latent_frames=g.latent_frames,
    )
    text_indices = torch.arange(s.num_text)
    video_indices = torch.cat([torch.arange(s.cond_start, s.audio_start), torch.arange(s.video_start, s.seq)])
    audio_indices = torch.arange(s.audio_start, s.video_start)

    token_tags = torch.empty(s.seq, dtype=torch.long)
    token_tags[text_indices] = text_tags
    token_tags[video_indices] = Modality.VIDEO
    token_tags[audio_indices] = Modality.AUDIO

    row_clock = torch.full((s.seq,), CLOCK_VIDEO, dtype=torch.long)
    row_clock[s.cond_start : s.audio_start] = CLOCK_CONDITION
    row_clock[s.audio_start : s.video_start] = CLOCK_AUDIO

    return PackedLayout(
        anchors=anchors,
        geometry=g,
        patch_size=tuple(patch_size),
        audio_channels=audio_channels,
        num_text=s.num_text,
        rows_per_frame=s.rows_per_frame,
        token_tags=token_tags,
        row_clock=row_clock,
        position_ids=torch.from_numpy(_positions(s, g, anchors, patch_h, patch_w, audio_channels)),
        text_indices=text_indices,
        video_indices=video_indices,
        audio_indices=audio_indices,
    )


@dataclass(frozen=True)
class _Spans:
    """Where each block of rows starts in the packed sequence."""

    num_text: int
    rows_per_frame: int
    num_anchors: int
    num_audio: int
    latent_frames: int

    @property
    def cond_start(self) -> int:
        return self.num_text

    @property
    def audio_start(self) -> int:
        return self.cond_start + self.num_anchors * self.rows_per_frame

    @property
    def video_start(self) -> int:
        return self.audio_start + self.num_audio

    @property
    def seq(self) -> int:
        return self.video_start + self.latent_frames * self.rows_per_frame


def _positions(
    s: _Spans, g: MediaGeometry, anchors: tuple[str, ...], patch_h: int, patch_w: int, audio_channels: int
) -> np.ndarray:
    """(S, 3) float64 RoPE positions (t, h, w): text row i at (i, 0, 0); the media clock starts after the text."""
    pos = np.zeros((s.seq, 3), dtype=np.float64)
    pos[: s.num_text, 0] = np.arange(s.num_text, dtype=np.float64)
    origin = float(s.num_text)

    sqrt_area = np.sqrt(g.latent_height * g.latent_width)
    h_grid = spatial_grid(g.latent_height, patch_h, sqrt_area)
    w_grid = spatial_grid(g.latent_width, patch_w, sqrt_area)
    hh, ww = np.meshgrid(h_grid, w_grid, indexing="ij")
    frame_hw = np.stack([hh.reshape(-1), ww.reshape(-1)], axis=-1)  # (rows_per_frame, 2), row-major (h, w)

    for k, anchor in enumerate(anchors):
        rows = slice(s.cond_start + k * s.rows_per_frame, s.cond_start + (k + 1) * s.rows_per_frame)
        pos[rows, 0] = origin if anchor == "first" else last_frame_time(g.latent_frames, origin)
        pos[rows, 1:] = frame_hw

    # Audio: one time unit per latent on the shared clock, no height, L at the first w point and R at the last.
    audio = slice(s.audio_start, s.video_start)
    pos[audio, 0] = np.tile(origin + np.arange(g.audio_latents, dtype=np.float64), audio_channels)
    pos[audio, 2] = np.concatenate(
        [np.full(g.audio_latents, w_grid[0]), np.full(s.num_audio - g.audio_latents, w_grid[-1])]
    )

    pos[s.video_start :, 0] = np.repeat(frame_times(g.latent_frames, origin), s.rows_per_frame)
    pos[s.video_start :, 1:] = np.tile(frame_hw, (g.latent_frames, 1))
    return pos


# --- row <-> latent conversions ---------------------------------------------------------------------------------


def patchify_video(latents: torch.Tensor, patch_size: tuple[int, int, int] = PATCH_SIZE) -> torch.Tensor:
    """(1, C, F, H, W) -> (F*H/ph*W/pw, C*pt*ph*pw): frame-major, then row-major; features ordered (c, pt, ph, pw)."""
    pt, ph, pw = patch_size
    b, c, f, h, w = latents.shape
    if b != 1 or f % pt or h % ph or w % pw:
        raise ValueError(f"latents of shape {tuple(latents.shape)} do not patch into rows with {patch_size}")
    x = latents.reshape(c, f // pt, pt, h // ph, ph, w // pw, pw)
    return x.permute(1, 3, 5, 0, 2, 4, 6).reshape(-1, c * pt * ph * pw)


def unpatchify_video(rows: torch.Tensor, geometry: MediaGeometry, patch_size: tuple[int, int, int] = PATCH_SIZE):
    """Inverse of `patchify_video` for the generated rows: (Nv, C*pt*ph*pw) -> (1, C, F, H, W)."""
    pt, ph, pw = patch_size
    g = geometry
    f, h, w = g.latent_frames // pt, g.latent_height // ph, g.latent_width // pw
    c = rows.shape[-1] // (pt * ph * pw)
    x = rows.reshape(f, h, w, c, pt, ph, pw).permute(3, 0, 4, 1, 5, 2, 6)
    return x.reshape(1, c, g.latent_frames, g.latent_height, g.latent_width)


def audio_rows_to_latents(rows: torch.Tensor, channels: int = 2) -> torch.Tensor:
    """Channel-major rows (channels*Na, D) -> (channels, D, Na), the mono audio VAE's batch of stereo channels."""
    return rows.reshape(channels, -1, rows.shape[-1]).permute(0, 2, 1)
