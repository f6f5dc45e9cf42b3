"""The packed sequence of one request: which row holds what, at which time and where in RoPE space.

H3 denoises a single sequence per request, in the row order

    [ text (Qwen rows) | keyframe rows (0, 1 or 2 frames) | audio L then R | target video ]

A task variant is data: T2VA, I2VA, L2VA and FL2VA differ only in the keyframe anchors they pack
(`vocab.TASK_ANCHORS`). Ref2VA packs reference blocks instead of keyframes (`Reference`, `build_ref2va_layout`):

    [ text | reference blocks in request order | audio L then R | target video ]

Both are one builder over a list of condition blocks (`_Block`): a keyframe is a block that leaves the RoPE cursor
where it is, a reference one that moves it on. The clock arithmetic itself is `rope.py`'s.

Everything here is plain tensors built on the CPU once per request; the denoise loop and the DiT read them and
never change them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from h3serve.config import AUDIO_LATENTS_PER_SECOND, FPS, PATCH_SIZE, SPATIAL_RATIO, Modality
from h3serve.pipeline.rope import frame_grid, frame_times, last_frame_time, video_time_span
from h3serve.pipeline.rope import spatial_grid as spatial_grid  # its home is rope; importable from here as before
from h3serve.pipeline.rules import check_reference_kinds
from h3serve.vocab import ANCHORS, AUDIO_CHANNELS, ReferenceKind, latent_frames
from h3serve.vocab import TASK_ANCHORS as TASK_ANCHORS  # its home is vocab; importable from here as before

# Conditioning rows are noised once to t = 0.999 and held there (or at t_video when that is cleaner).
CONDITION_TIMESTEP = 0.999

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
        used_clocks = torch.unique(self.row_clock)
        values, inverse = torch.unique(per_clock[used_clocks], sorted=True, return_inverse=True)
        lookup = torch.zeros(NUM_CLOCKS, dtype=torch.long)
        lookup[used_clocks] = inverse
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

    A keyframe is one frame of the target's grid on the conditioning clock. It leaves the RoPE cursor where the text
    ends: a "first" keyframe sits there, with the target's first frame; a "last" one at the target's last pixel frame.
    """
    anchors = tuple(anchors)
    for anchor in anchors:
        if anchor not in ANCHORS:
            raise ValueError(f"keyframe anchor must be 'first' or 'last', got {anchor!r}")
    _, patch_h, patch_w = _check_patch(geometry, patch_size)
    target = frame_grid(geometry.latent_height, geometry.latent_width, patch_h, patch_w)
    blocks = [_Block(frames=1, frame_hw=target[0], at_last_frame=anchor == "last") for anchor in anchors]
    return _pack(text_tags, geometry, blocks, target, patch_size, audio_channels, anchors=anchors)


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
    references = validate_references(references, patch_size)
    _, patch_h, patch_w = _check_patch(geometry, patch_size)
    target = frame_grid(geometry.latent_height, geometry.latent_width, patch_h, patch_w)
    blocks = [_reference_block(ref, target[1], patch_h, patch_w) for ref in references]
    return _pack(text_tags, geometry, blocks, target, patch_size, audio_channels, references=references)


@dataclass(frozen=True, eq=False)
class _Block:
    """One condition block: its audio rows (channel-major), then its video rows (frame-major), at one RoPE time.

    The time is the cursor's, or for `at_last_frame` (a "last" keyframe) the target's last pixel frame; `advance` is
    how far the block moves the cursor on: 0 for a keyframe, a reference's span for a reference.
    """

    frames: int = 0  # latent frames of video rows
    frame_hw: np.ndarray | None = None  # (rows_per_frame, 2): the (h, w) positions of one frame's rows
    audio_latents: int = 0  # per channel
    audio_w: np.ndarray | None = None  # the w axis whose first point holds L and whose last holds R
    advance: float = 0.0
    at_last_frame: bool = False

    def audio_rows(self, audio_channels: int) -> int:
        return self.audio_latents * audio_channels

    @property
    def video_rows(self) -> int:
        return 0 if self.frame_hw is None else self.frames * self.frame_hw.shape[0]


def _reference_block(ref: Reference, target_w: np.ndarray, patch_h: int, patch_w: int) -> _Block:
    """A Ref2VA reference as a block at the cursor, with its advance."""
    if ref.kind == ReferenceKind.AUDIO:
        return _Block(audio_latents=ref.audio_latents, audio_w=target_w, advance=float(ref.audio_latents))
    frame_hw, own_w = frame_grid(ref.latent_height, ref.latent_width, patch_h, patch_w)
    if ref.kind == ReferenceKind.IMAGE:
        # A single frame takes one integer slot, not a latent frame's 5/3.
        return _Block(frames=1, frame_hw=frame_hw, advance=1.0)
    span = max(float(ref.audio_latents), video_time_span(ref.latent_frames))
    return _Block(
        frames=ref.latent_frames, frame_hw=frame_hw, audio_latents=ref.audio_latents, audio_w=own_w, advance=span
    )


@dataclass(frozen=True)
class _Spans:
    """Where each run of rows starts in the packed sequence `[text | condition blocks | audio L, R | video]`."""

    num_text: int
    num_condition: int  # keyframe or reference rows, video and audio
    num_audio: int  # generated audio rows, every channel
    num_video: int  # generated video rows

    @property
    def cond_start(self) -> int:
        return self.num_text

    @property
    def audio_start(self) -> int:
        return self.cond_start + self.num_condition

    @property
    def video_start(self) -> int:
        return self.audio_start + self.num_audio

    @property
    def seq(self) -> int:
        return self.video_start + self.num_video


def _pack(
    text_tags: Sequence[int] | torch.Tensor,
    geometry: MediaGeometry,
    blocks: Sequence[_Block],
    target: tuple[np.ndarray, np.ndarray],
    patch_size: tuple[int, int, int],
    audio_channels: int,
    *,
    anchors: tuple[str, ...] = (),
    references: tuple[Reference, ...] = (),
) -> PackedLayout:
    """Lay out `[text | blocks | audio L, R | video]`: text row i at RoPE (i, 0, 0), the blocks from the cursor where
    the text ends, the target's audio and video at the final cursor. target: the target frame's `frame_grid`."""
    text_tags = torch.as_tensor(text_tags, dtype=torch.long).reshape(-1)
    target_hw, target_w = target
    _, patch_h, patch_w = patch_size
    rows_per_frame = (geometry.latent_height // patch_h) * (geometry.latent_width // patch_w)
    condition_video = sum(block.video_rows for block in blocks)
    condition_audio = sum(block.audio_rows(audio_channels) for block in blocks)
    spans = _Spans(
        num_text=int(text_tags.shape[0]),
        num_condition=condition_video + condition_audio,
        num_audio=geometry.audio_latents * audio_channels,
        num_video=geometry.latent_frames * rows_per_frame,
    )

    pos = np.zeros((spans.seq, 3), dtype=np.float64)  # (S, 3) float64 (t, h, w)
    pos[: spans.num_text, 0] = np.arange(spans.num_text, dtype=np.float64)
    row_clock = torch.full((spans.seq,), CLOCK_VIDEO, dtype=torch.long)
    video_blocks, audio_blocks, cursor = _place_blocks(pos, row_clock, blocks, spans, geometry, audio_channels)
    _fill_audio(pos, spans.audio_start, geometry.audio_latents, audio_channels, cursor, target_w)
    _fill_video(pos, spans.video_start, geometry.latent_frames, cursor, target_hw)
    row_clock[spans.audio_start : spans.video_start] = CLOCK_AUDIO

    text_indices = torch.arange(spans.num_text)
    video_indices = torch.cat([*video_blocks, torch.arange(spans.video_start, spans.seq)])
    audio_indices = torch.cat([*audio_blocks, torch.arange(spans.audio_start, spans.video_start)])
    token_tags = torch.empty(spans.seq, dtype=torch.long)
    token_tags[text_indices] = text_tags
    token_tags[video_indices] = Modality.VIDEO
    token_tags[audio_indices] = Modality.AUDIO

    return PackedLayout(
        anchors=anchors,
        geometry=geometry,
        patch_size=tuple(patch_size),
        audio_channels=audio_channels,
        num_text=spans.num_text,
        rows_per_frame=rows_per_frame,
        token_tags=token_tags,
        row_clock=row_clock,
        position_ids=torch.from_numpy(pos),
        text_indices=text_indices,
        video_indices=video_indices,
        audio_indices=audio_indices,
        references=references,
        # Keyframe rows are counted by `anchors` (PackedLayout.num_condition_video_rows), reference rows here.
        num_reference_video_rows=condition_video if references else 0,
        num_reference_audio_rows=condition_audio if references else 0,
    )


def _place_blocks(
    pos: np.ndarray,
    row_clock: torch.Tensor,
    blocks: Sequence[_Block],
    spans: _Spans,
    geometry: MediaGeometry,
    audio_channels: int,
) -> tuple[list[torch.Tensor], list[torch.Tensor], float]:
    """Write the condition blocks' positions and clocks in request order; return their video and audio row indices
    and the RoPE cursor after the last of them, where the target starts."""
    video_blocks: list[torch.Tensor] = []
    audio_blocks: list[torch.Tensor] = []
    row, cursor = spans.cond_start, float(spans.num_text)  # next free row; the RoPE time cursor
    for block in blocks:
        time = last_frame_time(geometry.latent_frames, cursor) if block.at_last_frame else cursor
        if block.audio_latents:
            n = block.audio_rows(audio_channels)
            _fill_audio(pos, row, block.audio_latents, audio_channels, time, block.audio_w)
            audio_blocks.append(torch.arange(row, row + n))
            row_clock[row : row + n] = CLOCK_REFERENCE_AUDIO
            row += n
        if block.video_rows:
            n = block.video_rows
            _fill_video(pos, row, block.frames, time, block.frame_hw)
            video_blocks.append(torch.arange(row, row + n))
            row_clock[row : row + n] = CLOCK_CONDITION
            row += n
        cursor += block.advance
    assert row == spans.audio_start
    return video_blocks, audio_blocks, cursor


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


# --- row <-> latent conversions ---------------------------------------------------------------------------------


def patchify_video(latents: torch.Tensor, patch_size: tuple[int, int, int] = PATCH_SIZE) -> torch.Tensor:
    """(1, C, F, H, W) -> (F*H/ph*W/pw, C*pt*ph*pw): frame-major, then row-major; features ordered (c, pt, ph, pw)."""
    pt, ph, pw = patch_size
    batch, channels, frames, height, width = latents.shape
    if batch != 1 or frames % pt or height % ph or width % pw:
        raise ValueError(f"latents of shape {tuple(latents.shape)} do not patch into rows with {patch_size}")
    x = latents.reshape(channels, frames // pt, pt, height // ph, ph, width // pw, pw)
    return x.permute(1, 3, 5, 0, 2, 4, 6).reshape(-1, channels * pt * ph * pw)


def unpatchify_video(rows: torch.Tensor, geometry: MediaGeometry, patch_size: tuple[int, int, int] = PATCH_SIZE):
    """Inverse of `patchify_video` for the generated rows: (Nv, C*pt*ph*pw) -> (1, C, F, H, W)."""
    pt, ph, pw = patch_size
    frames, height, width = geometry.latent_frames, geometry.latent_height, geometry.latent_width
    channels = rows.shape[-1] // (pt * ph * pw)
    x = rows.reshape(frames // pt, height // ph, width // pw, channels, pt, ph, pw).permute(3, 0, 4, 1, 5, 2, 6)
    return x.reshape(1, channels, frames, height, width)


def audio_rows_to_latents(rows: torch.Tensor, channels: int = AUDIO_CHANNELS) -> torch.Tensor:
    """Channel-major rows (channels*Na, D) -> (channels, D, Na), the mono audio VAE's batch of stereo channels."""
    return rows.reshape(channels, -1, rows.shape[-1]).permute(0, 2, 1)
