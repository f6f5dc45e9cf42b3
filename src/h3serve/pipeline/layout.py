"""The packed sequence of one request: which row holds what, at which time and where in RoPE space.

H3 denoises a single sequence per request, in the row order

    [ text (Qwen rows) | keyframe rows (0, 1 or 2 frames) | audio L then R | target video ]

A task variant is data: T2VA, I2VA, L2VA and FL2VA differ only in the keyframe anchors they pack
(`vocab.TASK_ANCHORS`). Ref2VA packs reference blocks instead of keyframes (`Reference`, `build_ref2va_layout`):

    [ text | reference blocks in request order | audio L then R | target video ]

Everything here is plain tensors built on the CPU once per request; the denoise loop and the DiT read them and
never change them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from h3serve.config import AUDIO_LATENTS_PER_SECOND, FPS, PATCH_SIZE, SPATIAL_RATIO, Modality
from h3serve.pipeline.rules import check_reference_kinds
from h3serve.vocab import ANCHORS, AUDIO_CHANNELS, ReferenceKind, latent_frames
from h3serve.vocab import TASK_ANCHORS as TASK_ANCHORS  # its home is vocab; importable from here as before

# Conditioning rows are noised once to t = 0.999 and held there (or at t_video when that is cleaner).
CONDITION_TIMESTEP = 0.999

# One latent frame spans (5/3) * m RoPE time units, m following the VAE's 1, 4, 4, 4, 4 pixel-frame grouping:
# 40 units per second at 24 fps, the same clock as the 40 Hz audio latents (one unit each).
ROPE_FRAME_UNITS = 5.0 / 3.0
ROPE_FRAMES_PER_LATENT = (1, 4, 4, 4, 4)
ROPE_SPATIAL_SCALE = 32

# Reference audio rows (Ref2VA) are clean: the posterior mean of the audio VAE, held at t = 1.0.
REFERENCE_AUDIO_TIMESTEP = 1.0

# Which clock a row's timestep follows: the generated video (text rows ride along), the generated audio, the
# conditioning floor max(t_video, 0.999) (keyframe and reference video rows), or the clean reference audio (1.0).
CLOCK_VIDEO = 0
CLOCK_AUDIO = 1
CLOCK_CONDITION = 2
CLOCK_REFERENCE_AUDIO = 3
NUM_CLOCKS = 4


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
        frames = latent_frames(num_frames)  # ValueError off the grid
        if height % SPATIAL_RATIO or width % SPATIAL_RATIO:
            raise ValueError(f"height and width must be multiples of {SPATIAL_RATIO}, got {height}x{width}")
        return cls(
            latent_frames=frames,
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
class Reference:
    """One Ref2VA reference block, by its latent sizes (before patching), in the order the request lists it.

    image: one latent frame at its own latent size. video: its latent frames at its own latent size, plus
    `audio_latents` per channel of its soundtrack (0: no soundtrack). audio: `audio_latents` per channel only.
    Use the `image`, `video` and `audio` constructors; `validate_references` checks a list of them.
    """

    kind: ReferenceKind
    latent_frames: int = 0
    latent_height: int = 0
    latent_width: int = 0
    audio_latents: int = 0

    @classmethod
    def image(cls, latent_height: int, latent_width: int) -> Reference:
        return cls(ReferenceKind.IMAGE, 1, latent_height, latent_width, 0)

    @classmethod
    def video(cls, latent_frames: int, latent_height: int, latent_width: int, audio_latents: int = 0) -> Reference:
        return cls(ReferenceKind.VIDEO, latent_frames, latent_height, latent_width, audio_latents)

    @classmethod
    def audio(cls, audio_latents: int) -> Reference:
        return cls(ReferenceKind.AUDIO, 0, 0, 0, audio_latents)

    @property
    def has_video(self) -> bool:
        return self.kind in (ReferenceKind.IMAGE, ReferenceKind.VIDEO)

    @property
    def has_audio(self) -> bool:
        return self.audio_latents > 0

    def video_rows(self, patch_size: tuple[int, int, int] = PATCH_SIZE) -> int:
        _, ph, pw = patch_size
        return self.latent_frames * (self.latent_height // ph) * (self.latent_width // pw)

    def audio_rows(self, audio_channels: int = AUDIO_CHANNELS) -> int:
        return self.audio_latents * audio_channels


def validate_references(
    references: Sequence[Reference], patch_size: tuple[int, int, int] = PATCH_SIZE
) -> tuple[Reference, ...]:
    """Check a Ref2VA reference list: each block's shape (ValueError), then the per-request limits of docs/model.md §5
    (`rules.check_reference_kinds`: a RequestError, which is a ValueError)."""
    references = tuple(references)
    _, ph, pw = patch_size
    for i, ref in enumerate(references):
        where = f"references[{i}] ({getattr(ref, 'kind', None)!r})"
        if not isinstance(ref, Reference):
            raise ValueError(f"references[{i}] must be a Reference, got {type(ref).__name__}")
        if ref.kind not in tuple(ReferenceKind):
            raise ValueError(f"{where}: a reference is an 'image', a 'video' or an 'audio'")
        if ref.kind == ReferenceKind.AUDIO:
            if ref.audio_latents < 1 or ref.latent_frames or ref.latent_height or ref.latent_width:
                raise ValueError(f"{where}: an audio reference has >= 1 audio latent and no video latents, got {ref}")
            continue
        if ref.kind == ReferenceKind.IMAGE and (ref.latent_frames != 1 or ref.audio_latents):
            raise ValueError(f"{where}: an image reference is one latent frame without audio, got {ref}")
        if ref.latent_frames < 1 or ref.audio_latents < 0:
            raise ValueError(f"{where}: a video reference needs >= 1 latent frame and >= 0 audio latents, got {ref}")
        if ref.latent_height < ph or ref.latent_width < pw or ref.latent_height % ph or ref.latent_width % pw:
            raise ValueError(
                f"{where}: latent {ref.latent_height}x{ref.latent_width} is not divisible by the patch {patch_size}"
            )
    check_reference_kinds([ref.kind for ref in references])
    return references


@dataclass(frozen=True)
class PackedLayout:
    """Rows, tags, clocks, RoPE positions and scatter indices of one request's packed sequence.

    `video_indices` lists the keyframe (or reference video) rows first, then the target video rows; the DiT's video
    input and output follow that order, as do `audio_indices` for the audio rows (reference audio rows first, in
    request order, then the target's L then R).
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
    audio_indices: torch.Tensor  # (Nra + 2 * Na,) int64
    # Ref2VA only (empty / 0 for the four base modes): the reference blocks in request order and their row counts.
    references: tuple[Reference, ...] = ()
    num_reference_video_rows: int = 0
    num_reference_audio_rows: int = 0

    @property
    def num_condition_video_rows(self) -> int:
        """Leading rows of `video_indices` that are not generated: keyframe rows, or Ref2VA reference video rows."""
        return len(self.anchors) * self.rows_per_frame + self.num_reference_video_rows

    @property
    def num_condition_audio_rows(self) -> int:
        """Leading rows of `audio_indices` that are not generated: Ref2VA reference audio rows (clean, t = 1.0)."""
        return self.num_reference_audio_rows

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

        Text and target video rows take t_video, target audio rows t_audio, keyframe and reference video rows
        max(t_video, 0.999), reference audio rows 1.0. Values are float32 and sorted ascending, as the DiT's AdaLN
        table expects: ((M,) float32, (S,) int64). M <= 3 for the base modes, <= 4 for Ref2VA.
        """
        # max() on Python floats, then one rounding to float32, matches the reference's row-wise fill.
        per_clock = torch.tensor(
            [float(t_video), float(t_audio), max(float(t_video), CONDITION_TIMESTEP), REFERENCE_AUDIO_TIMESTEP],
            dtype=torch.float32,
        )
        present = torch.unique(self.row_clock)
        values, inverse = torch.unique(per_clock[present], sorted=True, return_inverse=True)
        lookup = torch.zeros(NUM_CLOCKS, dtype=torch.long)
        lookup[present] = inverse
        return values, lookup[self.row_clock]


def _check_patch(geometry: MediaGeometry, patch_size: tuple[int, int, int]) -> tuple[int, int, int]:
    patch_t, patch_h, patch_w = patch_size
    if patch_t != 1:
        # The temporal RoPE clock counts latent frames; a temporal patch would need its own clock.
        raise ValueError(f"only a temporal patch of 1 is supported, got patch_size={patch_size}")
    if geometry.latent_height % patch_h or geometry.latent_width % patch_w:
        raise ValueError(
            f"latent {geometry.latent_height}x{geometry.latent_width} is not divisible by the patch {patch_size}"
        )
    return patch_size


def build_layout(
    text_tags: Sequence[int] | torch.Tensor,
    geometry: MediaGeometry,
    anchors: Sequence[str] = (),
    *,
    patch_size: tuple[int, int, int] = PATCH_SIZE,
    audio_channels: int = AUDIO_CHANNELS,
) -> PackedLayout:
    """Build the `[text | keyframes | audio L, R | video]` layout.

    text_tags: the modality tag of every text-encoder row (TEXT, or VIDEO inside a keyframe's vision block).
    anchors: "first" and/or "last" per keyframe, in packed order (see `vocab.TASK_ANCHORS`).
    """
    text_tags = torch.as_tensor(text_tags, dtype=torch.long).reshape(-1)
    anchors = tuple(anchors)
    for anchor in anchors:
        if anchor not in ANCHORS:
            raise ValueError(f"keyframe anchor must be 'first' or 'last', got {anchor!r}")
    _, patch_h, patch_w = _check_patch(geometry, patch_size)
    g = geometry

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
    frame_hw, w_grid = _frame_grid(g.latent_height, g.latent_width, patch_h, patch_w)

    for k, anchor in enumerate(anchors):
        rows = slice(s.cond_start + k * s.rows_per_frame, s.cond_start + (k + 1) * s.rows_per_frame)
        pos[rows, 0] = origin if anchor == "first" else last_frame_time(g.latent_frames, origin)
        pos[rows, 1:] = frame_hw

    _fill_audio(pos, s.audio_start, g.audio_latents, audio_channels, origin, w_grid)
    _fill_video(pos, s.video_start, g.latent_frames, origin, frame_hw)
    return pos


def _frame_grid(latent_height: int, latent_width: int, patch_h: int, patch_w: int) -> tuple[np.ndarray, np.ndarray]:
    """The (h, w) positions of one latent frame's rows, row-major, (rows_per_frame, 2); and its w axis."""
    sqrt_area = np.sqrt(latent_height * latent_width)
    h_grid = spatial_grid(latent_height, patch_h, sqrt_area)
    w_grid = spatial_grid(latent_width, patch_w, sqrt_area)
    hh, ww = np.meshgrid(h_grid, w_grid, indexing="ij")
    return np.stack([hh.reshape(-1), ww.reshape(-1)], axis=-1), w_grid


def _fill_audio(
    pos: np.ndarray, start: int, audio_latents: int, channels: int, origin: float, w_grid: np.ndarray
) -> None:
    """One channel-major audio block: one time unit per latent, no height, L at the first w point, R at the last."""
    rows = slice(start, start + audio_latents * channels)
    pos[rows, 0] = np.tile(origin + np.arange(audio_latents, dtype=np.float64), channels)
    pos[rows, 2] = np.concatenate(
        [np.full(audio_latents, w_grid[0]), np.full(audio_latents * (channels - 1), w_grid[-1])]
    )


def _fill_video(pos: np.ndarray, start: int, latent_frames: int, origin: float, frame_hw: np.ndarray) -> None:
    """One frame-major video block starting at RoPE time `origin`."""
    rows = slice(start, start + latent_frames * frame_hw.shape[0])
    pos[rows, 0] = np.repeat(frame_times(latent_frames, origin), frame_hw.shape[0])
    pos[rows, 1:] = np.tile(frame_hw, (latent_frames, 1))


def video_time_span(num_latent_frames: int) -> float:
    """RoPE time a Ref2VA reference video occupies: (5/3) * (1 + 4 + 4 + 4 + 4 + 1 + ...), summed in order.

    A sequential float64 sum, as the reference advances its cursor; `last_frame_time`'s pairwise sum of the same
    series differs from it in the last ulp from 16 latent frames on.
    """
    span = 0.0
    for k in range(num_latent_frames):
        span += ROPE_FRAME_UNITS * ROPE_FRAMES_PER_LATENT[k % len(ROPE_FRAMES_PER_LATENT)]
    return span


def build_ref2va_layout(
    text_tags: Sequence[int] | torch.Tensor,
    references: Sequence[Reference],
    geometry: MediaGeometry,
    *,
    patch_size: tuple[int, int, int] = PATCH_SIZE,
    audio_channels: int = AUDIO_CHANNELS,
) -> PackedLayout:
    """Build the Ref2VA layout `[text | reference blocks in request order | audio L, R | target video]`.

    text_tags: the modality tag of every text-encoder row (TEXT, or VIDEO inside a reference's vision block).
    references: the reference blocks in request order (`Reference`); checked by `validate_references`.

    Each block sits at its own span of the shared RoPE clock, a cursor that starts where the text ends: an image at
    the cursor, then +1; an audio reference (target w grid) then +its latents; a video's soundtrack (the video's own
    w grid) then its frames, both at the cursor, then +max(audio latents, video span). The target audio and video
    start at the final cursor. Reference video rows follow the conditioning clock max(t_video, 0.999), reference
    audio rows are clean (t = 1.0).
    """
    text_tags = torch.as_tensor(text_tags, dtype=torch.long).reshape(-1)
    references = validate_references(references, patch_size)
    _, patch_h, patch_w = _check_patch(geometry, patch_size)
    g = geometry

    num_text = int(text_tags.shape[0])
    rows_per_frame = (g.latent_height // patch_h) * (g.latent_width // patch_w)
    ref_video_rows = sum(ref.video_rows(patch_size) for ref in references)
    ref_audio_rows = sum(ref.audio_rows(audio_channels) for ref in references)
    audio_start = num_text + ref_video_rows + ref_audio_rows
    video_start = audio_start + g.audio_latents * audio_channels
    seq = video_start + g.latent_frames * rows_per_frame

    pos = np.zeros((seq, 3), dtype=np.float64)
    pos[:num_text, 0] = np.arange(num_text, dtype=np.float64)
    target_hw, target_w = _frame_grid(g.latent_height, g.latent_width, patch_h, patch_w)
    row_clock = torch.full((seq,), CLOCK_VIDEO, dtype=torch.long)
    video_blocks: list[torch.Tensor] = []
    audio_blocks: list[torch.Tensor] = []

    row, cursor = num_text, float(num_text)  # next free row; the RoPE time cursor
    for ref in references:
        if ref.has_audio:  # an audio reference, or a video's soundtrack packed right before its frames
            n = ref.audio_rows(audio_channels)
            w_grid = target_w
            if ref.kind == ReferenceKind.VIDEO:
                w_grid = _frame_grid(ref.latent_height, ref.latent_width, patch_h, patch_w)[1]
            _fill_audio(pos, row, ref.audio_latents, audio_channels, cursor, w_grid)
            audio_blocks.append(torch.arange(row, row + n))
            row_clock[row : row + n] = CLOCK_REFERENCE_AUDIO
            row += n
        if ref.has_video:
            n = ref.video_rows(patch_size)
            frame_hw = _frame_grid(ref.latent_height, ref.latent_width, patch_h, patch_w)[0]
            _fill_video(pos, row, ref.latent_frames, cursor, frame_hw)
            video_blocks.append(torch.arange(row, row + n))
            row_clock[row : row + n] = CLOCK_CONDITION
            row += n
        if ref.kind == ReferenceKind.IMAGE:
            cursor += 1.0  # a single frame takes one integer slot, not a latent frame's 5/3
        elif ref.kind == ReferenceKind.AUDIO:
            cursor += float(ref.audio_latents)
        else:
            cursor += max(float(ref.audio_latents), video_time_span(ref.latent_frames))
    assert row == audio_start

    _fill_audio(pos, audio_start, g.audio_latents, audio_channels, cursor, target_w)
    _fill_video(pos, video_start, g.latent_frames, cursor, target_hw)
    row_clock[audio_start:video_start] = CLOCK_AUDIO

    text_indices = torch.arange(num_text)
    video_indices = torch.cat([*video_blocks, torch.arange(video_start, seq)])
    audio_indices = torch.cat([*audio_blocks, torch.arange(audio_start, video_start)])
    token_tags = torch.empty(seq, dtype=torch.long)
    token_tags[text_indices] = text_tags
    token_tags[video_indices] = Modality.VIDEO
    token_tags[audio_indices] = Modality.AUDIO

    return PackedLayout(
        anchors=(),
        geometry=g,
        patch_size=tuple(patch_size),
        audio_channels=audio_channels,
        num_text=num_text,
        rows_per_frame=rows_per_frame,
        token_tags=token_tags,
        row_clock=row_clock,
        position_ids=torch.from_numpy(pos),
        text_indices=text_indices,
        video_indices=video_indices,
        audio_indices=audio_indices,
        references=references,
        num_reference_video_rows=ref_video_rows,
        num_reference_audio_rows=ref_audio_rows,
    )


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


def audio_rows_to_latents(rows: torch.Tensor, channels: int = AUDIO_CHANNELS) -> torch.Tensor:
    """Channel-major rows (channels*Na, D) -> (channels, D, Na), the mono audio VAE's batch of stereo channels."""
    return rows.reshape(channels, -1, rows.shape[-1]).permute(0, 2, 1)
