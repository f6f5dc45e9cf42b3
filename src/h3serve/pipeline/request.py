"""Validation of one render request, before anything runs.

Every violation is a `RequestError` (a ValueError, from `pipeline.rules`) whose message names the field and the
allowed values, and whose attributes name the field (and index) for front ends. Adjustments that the model
requires but the caller may not expect (frames snapped up to 17n+5, a duration outside the trained range, a
canvas chosen for the caller) are returned as notices and logged.

Canvas and frame limits are data (`RequestRules`, in `pipeline.rules`) whose defaults are the released model's, so
a tiny model can allow small canvases. The rules, the error and `resolve_canvas` are importable from here too.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from functools import cached_property

from PIL import Image

from h3serve.config import AUDIO_SHIFT, DEFAULT_STEPS, VIDEO_SHIFT
from h3serve.pipeline.references import DecodedReference, decode_references
from h3serve.pipeline.rules import (
    MAX_SEED,
    QUALITIES,
    RELEASED_RULES,
    CanvasRule,
    RequestError,
    RequestRules,
    decode_image,
    resolve_canvas,
)
from h3serve.pipeline.schedule import DualSchedule, check_positions
from h3serve.vocab import TASK_ANCHORS, Task

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RenderRequest:
    """A validated request. Keyframes are decoded RGB images at their own size, in packed order."""

    task: Task
    prompt: str
    width: int
    height: int
    num_frames: int
    steps: int
    seed: int
    video_shift: float
    audio_shift: float
    keyframes: tuple[Image.Image, ...] = ()
    references: tuple[DecodedReference, ...] = ()  # ref2va: decoded references, in request order
    quality: str | None = None  # step caching for this request: None (the server's), lossless or high
    preview_every: int = 0  # a preview after every this many forwards (`pipeline.preview`); 0: none
    notices: tuple[str, ...] = ()
    # The unshifted sigma positions of the grid, when not evenly spaced (a distilled adapter's own: FastH3's).
    positions: tuple[float, ...] | None = None
    # Run-time adapters applied to this render, by declared name, with their scales (`Admission.check_adapters`).
    adapters: tuple[tuple[str, float], ...] = ()

    @property
    def anchors(self) -> tuple[str, ...]:
        return TASK_ANCHORS.get(self.task, ())

    @cached_property
    def schedule(self) -> DualSchedule:
        """The video and audio sigma grids the request denoises along: `steps` points, the request's shifts."""
        return DualSchedule.build(self.steps, self.video_shift, self.audio_shift, self.positions)

    @property
    def forwards(self) -> int:
        """DiT forwards the request runs, one per timestep of its schedule: steps - 1, or fewer where the shifted
        grid collapses float32 collisions near sigma = 1 (`schedule.shifted_sigmas`)."""
        return self.schedule.num_steps

    @property
    def grid(self) -> str:
        """The schedule in words, for headers and logs: "50 grid points (49 DiT forwards)", "2 grid points (1 DiT
        forward)"."""
        n = self.forwards
        return f"{self.steps} grid points ({n} DiT forward{'' if n == 1 else 's'})"


def decode_keyframe(index: int, image: Image.Image | bytes | bytearray | memoryview) -> Image.Image:
    """An RGB image from a PIL image or encoded bytes (PNG, JPEG, WebP, ...), EXIF orientation applied. Raises
    RequestError("keyframes", index=index)."""
    return decode_image("keyframes", index, image)


def _number(name: str, value, kind: type) -> int | float:
    ok = isinstance(value, int) if kind is int else isinstance(value, int | float)
    if isinstance(value, bool) or not ok:
        raise RequestError(name, f"{name} must be {'an integer' if kind is int else 'a number'}, got {value!r}")
    return value


@dataclass(frozen=True)
class RequestFields:
    """A render request as a front end gives it, before the model's rules (`validate_request`). None leaves a value
    to its default: num_frames the rules', width and height the canvas from the aspect ratio (ref2va: 16:9, as the
    reference pipeline does), steps and shifts the engine's sampler (`Admission.sampler`; the released one here),
    preview_every none.

    references: ref2va's encoded files, each `bytes` or `(name, bytes)`, decoded by `validate_request`
    (`pipeline.references`); mute_references: positions of video references whose soundtrack is left out. quality:
    step caching for this request (`QUALITIES`), None for the server's setting. adapters: see the field.
    """

    prompt: str
    task: str = Task.T2VA
    width: int | None = None
    height: int | None = None
    num_frames: int | None = None
    steps: int | None = None
    seed: int = 0
    video_shift: float | None = None
    audio_shift: float | None = None
    keyframes: Sequence[Image.Image | bytes] = ()
    references: Sequence[bytes | tuple[str | None, bytes]] = ()
    mute_references: Collection[int] = ()
    quality: str | None = None
    preview_every: int | None = None
    # Run-time adapters by declared name, each with its scale (None: the one it was declared with); checked by the
    # engine's admission (`Admission.check_adapters`), which knows what the server declared.
    adapters: Sequence[tuple[str, float | None]] = ()


def validate_request(
    fields: RequestFields, rules: RequestRules = RELEASED_RULES, positions: Sequence[float] | None = None
) -> RenderRequest:
    """Check a request against the model's rules; return it normalised, with notices for any adjustment.

    positions: the grid's unshifted sigma positions (`steps` of them, from near 1 down to 0) instead of an even
    spacing (a distilled adapter's own grid).
    """
    if fields.task not in tuple(Task):
        raise RequestError("task", f"task must be one of {', '.join(Task)}, got {fields.task!r}")
    task = Task(fields.task)
    if task != Task.REF2VA and (fields.references or fields.mute_references):
        raise RequestError("references", f"references: only task ref2va takes references, got task {task}")
    prompt = fields.prompt
    if not isinstance(prompt, str) or not prompt.strip():
        raise RequestError("prompt", "prompt must be a non-empty string")
    images = _check_keyframes(task, fields.keyframes)
    width, height, notices = _check_canvas(fields.width, fields.height, images, rules.canvas)
    num_frames = fields.num_frames
    requested = rules.frames.default_frames if num_frames is None else _number("num_frames", num_frames, int)
    num_frames, frame_notices = rules.frames.check(requested)
    notices += frame_notices
    steps = DEFAULT_STEPS if fields.steps is None else fields.steps
    if positions is not None:
        positions = tuple(float(p) for p in positions)
        try:
            check_positions(positions)
        except ValueError as e:
            raise RequestError("positions", str(e)) from e
        if len(positions) != steps:
            raise RequestError("steps", f"steps must be {len(positions)}, the grid's sigma positions, got {steps}")
    video_shift = VIDEO_SHIFT if fields.video_shift is None else fields.video_shift
    audio_shift = AUDIO_SHIFT if fields.audio_shift is None else fields.audio_shift
    steps, seed = _check_sampling(steps, fields.seed, video_shift, audio_shift, rules, positions)
    preview_every = 0 if fields.preview_every is None else _number("preview_every", fields.preview_every, int)
    most = max(steps - 2, 0)  # a preview comes before the last of the steps - 1 forwards
    if not 0 <= preview_every <= most:
        allowed = f"0 (none) or 1..{most}" if most else "0: its one forward leaves nothing to preview before it"
        raise RequestError("preview_every", f"preview_every must be {allowed} for {steps} steps, got {preview_every}")
    if fields.quality is not None and fields.quality not in QUALITIES:
        raise RequestError("quality", f"quality must be one of {', '.join(QUALITIES)}, got {fields.quality!r}")
    decoded = ()
    if task == Task.REF2VA:
        if not fields.references:
            raise RequestError("references", "references: task ref2va needs at least one reference file")
        decoded = decode_references(fields.references, num_frames=num_frames, mute=fields.mute_references, rules=rules)

    for notice in notices:
        log.info("request: %s", notice)
    return RenderRequest(
        task=task,
        prompt=prompt,
        width=width,
        height=height,
        num_frames=num_frames,
        steps=steps,
        seed=seed,
        video_shift=float(video_shift),
        audio_shift=float(audio_shift),
        keyframes=images,
        references=decoded,
        quality=fields.quality,
        preview_every=preview_every,
        notices=tuple(notices),
        positions=positions,
    )


def _check_keyframes(task: str, keyframes: Sequence[Image.Image | bytes]) -> tuple[Image.Image, ...]:
    """As many keyframes as the task packs, each decoded to RGB."""
    expected = len(TASK_ANCHORS.get(task, ()))
    keyframes = tuple(keyframes or ())
    if len(keyframes) != expected:
        raise RequestError(
            "keyframes",
            f"keyframes: task {task} takes {expected} keyframe(s) ({', '.join(TASK_ANCHORS.get(task, ())) or 'none'}), "
            f"got {len(keyframes)}",
        )
    return tuple(decode_keyframe(i, k) for i, k in enumerate(keyframes))


def _check_canvas(
    width: int | None, height: int | None, images: Sequence[Image.Image], canvas: CanvasRule
) -> tuple[int, int, list[str]]:
    """The canvas given, or the one chosen from the (first) keyframe's aspect ratio (else 16:9), checked."""
    notices = []
    for name, side in (("width", width), ("height", height)):
        if side is not None:  # a side given alone is told what is wrong with it, before it is told to come in a pair
            canvas.check_side(name, _number(name, side, int))
    if (width is None) != (height is None):
        raise RequestError("width", "width and height must be given together, or both left out")
    if width is None:
        aspect = images[0].size if images else (16, 9)
        try:
            width, height = resolve_canvas(*aspect, canvas)
        except ValueError as e:
            raise RequestError("keyframes", f"sets the canvas, but its {e}; give width and height explicitly", 0) from e
        if not images:
            source = "the default 16:9"
        else:
            source = "the keyframe's aspect ratio" if len(images) == 1 else "the first keyframe's aspect ratio"
        notices.append(f"canvas {width}x{height} chosen from {source}")
    width, height = _number("width", width, int), _number("height", height, int)
    canvas.check(width, height)
    return width, height, notices


def _check_sampling(
    steps: int,
    seed: int,
    video_shift: float,
    audio_shift: float,
    rules: RequestRules,
    positions: tuple[float, ...] | None = None,
) -> tuple[int, int]:
    steps = _number("steps", steps, int)
    if not rules.min_steps <= steps <= rules.max_steps:
        raise RequestError(
            "steps",
            f"steps must be {rules.min_steps}..{rules.max_steps} (grid points, including the final one), got {steps}",
        )
    seed = _number("seed", seed, int)
    if not 0 <= seed <= MAX_SEED:
        raise RequestError("seed", f"seed must be 0..{MAX_SEED}, got {seed}")
    for name, value in (("video_shift", video_shift), ("audio_shift", audio_shift)):
        value = _number(name, value, float)
        if not (math.isfinite(value) and value > 0):
            raise RequestError(name, f"{name} must be a finite number > 0, got {value!r}")
    # Both schedules must keep one point per step, or video and audio would step out of sync: refuse it here,
    # before anything loads, rather than in the middle of a render.
    try:
        DualSchedule.build(steps, float(video_shift), float(audio_shift), positions)
    except ValueError as e:
        raise RequestError("steps", str(e)) from e
    return steps, seed
