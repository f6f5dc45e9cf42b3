"""Validation of one render request, before anything runs.

Every violation is a ValueError that names the field and the allowed values. Adjustments that the model
requires but the caller may not expect (frames snapped up to 17n+5, a duration outside the trained range, a
canvas chosen for the caller) are returned as notices and logged.

Canvas and frame limits are data (`RequestRules`) whose defaults are the released model's, so a tiny model
can allow small canvases.

Frame rule: the video VAE decodes 17n+5 frames (n >= 1), so counts snap up to that grid. The released model
was trained on 5-15 s (124-362 frames at 24 fps); the hard limits are 22 (the shortest 17n+5 with n >= 1) to
362 frames, and 22-123 frames are accepted with a notice. That keeps the startup warmup (768x448, 56 frames)
valid, since the network runs short clips correctly, while anything longer than trained is refused.
"""

from __future__ import annotations

import io
import logging
import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from PIL import Image, ImageOps

from h3serve.config import AUDIO_SHIFT, CLIP_FRAMES, FPS, LATENTS_PER_CLIP, VIDEO_SHIFT
from h3serve.model.folder import REF2VA
from h3serve.pipeline.layout import TASK_ANCHORS
from h3serve.pipeline.schedule import DualSchedule

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from h3serve.pipeline.references import DecodedReference

TASKS = (*TASK_ANCHORS, REF2VA)  # the four base modes run the FL2VA DiT; ref2va runs the Ref2VA DiT
MAX_SEED = 2**63 - 1
# Per-request step caching (vLLM-Omni's `quality`): None follows the server, lossless runs without the cache, high
# with the conservative profile (`accel.stepcache.HIGH_QUALITY`) on a server started with one.
QUALITIES = ("lossless", "high")


class RequestError(ValueError):
    """A request value the model's rules refuse. `field` names it in the engine's terms (task, prompt, keyframes,
    width, height, num_frames, steps, seed, video_shift, audio_shift), so a front end can map it to its own name."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class CanvasRule:
    """Which (width, height) a model accepts, and which it picks when the caller gives none."""

    multiple: int = 32  # VAE /16 times the DiT's 2x2 patch
    max_pixels: int = 768 * 1344  # area cap, before rounding each side to `multiple`
    default_short_edge: int = 768  # the only short edge the released model was verified at
    min_aspect: float = 1 / 4
    max_aspect: float = 4.0

    def check(self, width: int, height: int) -> None:
        """Raise ValueError unless (width, height) is a canvas of this rule.

        Sides are positive multiples of `multiple`, the aspect ratio is within bounds, and the area rounds from
        within `max_pixels`: half a multiple per side is removed before comparing, the most that rounding adds,
        because `resolve_canvas` itself lands slightly above the cap for some aspect ratios.
        """
        m = self.multiple
        for name, value in (("width", width), ("height", height)):
            if value > self.max_pixels // m:  # over the area cap whatever the other side; also keeps the ratio finite
                raise RequestError(name, f"{name} {value} is above the canvas area cap of {self.max_pixels} pixels")
            if value < m or value % m:
                raise RequestError(name, f"{name} must be a positive multiple of {m}, got {value}")
        if not self.min_aspect <= width / height <= self.max_aspect:
            raise RequestError(
                "width",
                f"width/height: the aspect ratio of {width}x{height} ({width / height:.3g}) must be within "
                f"[{self.min_aspect:g}, {self.max_aspect:g}]",
            )
        if (width - m / 2) * (height - m / 2) > self.max_pixels:
            largest = "x".join(map(str, resolve_canvas(16, 9, self)))
            raise RequestError(
                "width",
                f"width/height: {width}x{height} is above the canvas area cap of {self.max_pixels} pixels "
                f"(the 16:9 canvas is {largest})",
            )

    def fits(self, width: int, height: int) -> bool:
        try:
            self.check(width, height)
        except ValueError:
            return False
        return True


@dataclass(frozen=True)
class FrameRule:
    """Which frame counts a model accepts on the VAE's 17n+5 grid (at the released 24 fps), and its default."""

    min_frames: int = 22
    max_frames: int = 362
    trained_min_frames: int = 124  # 5 s; below it a notice, not an error
    default_frames: int = 124

    def snap(self, num_frames: int) -> int:
        """The smallest frame count on the grid that is >= num_frames."""
        return num_frames + (LATENTS_PER_CLIP - num_frames) % CLIP_FRAMES

    def check(self, requested: int) -> tuple[int, list[str]]:
        """The frame count a request gets (snapped up to the grid) and the notices to give; ValueError if outside."""
        notices = []
        if requested < 1:
            raise RequestError("num_frames", f"num_frames must be >= {self.min_frames}, got {requested}")
        num_frames = self.snap(requested)
        if not self.min_frames <= num_frames <= self.max_frames:
            raise RequestError(
                "num_frames",
                f"num_frames must be {self.min_frames}..{self.max_frames} after snapping up to "
                f"{CLIP_FRAMES}n+{LATENTS_PER_CLIP} ({self.min_frames / FPS:.2f}-{self.max_frames / FPS:.2f} s at "
                f"{FPS} fps), got {requested}" + (f" (snapped to {num_frames})" if num_frames != requested else ""),
            )
        if num_frames != requested:
            notices.append(f"num_frames {requested} snapped up to {num_frames} ({CLIP_FRAMES}n+{LATENTS_PER_CLIP})")
        if num_frames < self.trained_min_frames:
            notices.append(
                f"{num_frames} frames ({num_frames / FPS:.2f} s) is shorter than the trained "
                f"{self.trained_min_frames / FPS:.2f}-{self.max_frames / FPS:.2f} s range"
            )
        return num_frames, notices


@dataclass(frozen=True)
class RequestRules:
    canvas: CanvasRule = field(default_factory=CanvasRule)
    frames: FrameRule = field(default_factory=FrameRule)
    min_steps: int = 2  # grid points, terminal included: 2 gives one forward
    max_steps: int = 1000
    # The startup warmup's shape: the production request's canvas and frame count (None: the rules' defaults).
    warmup_size: tuple[int, int] | None = (768, 448)
    warmup_frames: int | None = 56
    # Ref2VA: a reference image is resized so that its short edge is this (diffusers' `reference_image_short_edge`);
    # a reference video goes onto `canvas` at its own aspect ratio.
    reference_short_edge: int = 2048


RELEASED_RULES = RequestRules()
# The built-in tiny model accepts small canvases (its default is 224x128) and defaults to the shortest clip, so that
# a render takes seconds on a CPU.
TINY_RULES = RequestRules(
    canvas=CanvasRule(max_pixels=512 * 512, default_short_edge=128),
    frames=FrameRule(default_frames=22),
    warmup_size=None,
    warmup_frames=None,
    reference_short_edge=128,
)


@dataclass(frozen=True)
class RenderRequest:
    """A validated request. Keyframes are decoded RGB images at their own size, in packed order."""

    task: str
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
    notices: tuple[str, ...] = ()

    @property
    def anchors(self) -> tuple[str, ...]:
        return TASK_ANCHORS.get(self.task, ())


def resolve_canvas(aspect_width: float, aspect_height: float, rule: CanvasRule = CanvasRule()) -> tuple[int, int]:
    """(width, height) for an aspect ratio: short edge `default_short_edge`, area capped, sides rounded to the
    multiple. This is the released model's own rounding (Python's round-half-even), not a generic resize rule."""
    if not (aspect_width > 0 and aspect_height > 0):
        raise ValueError(f"aspect ratio must be positive, got {aspect_width}:{aspect_height}")
    ratio = aspect_width / aspect_height
    if not rule.min_aspect <= ratio <= rule.max_aspect:
        raise ValueError(
            f"aspect ratio {aspect_width}:{aspect_height} is outside [{rule.min_aspect:g}, {rule.max_aspect:g}]"
        )
    short = float(rule.default_short_edge)
    width, height = (short * ratio, short) if ratio >= 1.0 else (short, short / ratio)
    if width * height > rule.max_pixels:
        scale = (rule.max_pixels / (width * height)) ** 0.5
        width, height = width * scale, height * scale
    m = rule.multiple
    return max(m, round(width / m) * m), max(m, round(height / m) * m)


def decode_keyframe(index: int, image: Image.Image | bytes | bytearray | memoryview) -> Image.Image:
    """An RGB image from a PIL image or encoded bytes (PNG, JPEG, WebP, ...). Raises RequestError("keyframes")."""
    name = f"keyframes[{index}]"
    if isinstance(image, Image.Image):
        decoded = image
    elif isinstance(image, bytes | bytearray | memoryview):
        try:
            decoded = Image.open(io.BytesIO(bytes(image)))
            decoded.load()
        except Exception as e:  # PIL raises many types (UnidentifiedImageError, OSError, DecompressionBombError)
            raise RequestError("keyframes", f"{name} could not be decoded as an image ({type(e).__name__}: {e})") from e
    else:
        raise RequestError("keyframes", f"{name} must be image bytes or a PIL image, got {type(image).__name__}")
    # Camera JPEGs store their rotation as EXIF; apply it, as the reference's image loading does.
    decoded = ImageOps.exif_transpose(decoded)
    if decoded.width < 1 or decoded.height < 1:
        raise RequestError("keyframes", f"{name} has no pixels ({decoded.width}x{decoded.height})")
    return decoded.convert("RGB")


def _number(name: str, value, kind: type) -> int | float:
    ok = isinstance(value, int) if kind is int else isinstance(value, int | float)
    if isinstance(value, bool) or not ok:
        raise RequestError(name, f"{name} must be {'an integer' if kind is int else 'a number'}, got {value!r}")
    return value


def validate_request(
    prompt: str,
    *,
    task: str = "t2va",
    width: int | None = None,
    height: int | None = None,
    num_frames: int | None = None,
    steps: int,
    seed: int = 0,
    video_shift: float = VIDEO_SHIFT,
    audio_shift: float = AUDIO_SHIFT,
    keyframes: Sequence[Image.Image | bytes] = (),
    references: Sequence[bytes | tuple[str | None, bytes]] = (),
    mute_references: Collection[int] = (),
    quality: str | None = None,
    rules: RequestRules = RELEASED_RULES,
) -> RenderRequest:
    """Check a request against the model's rules; return it normalised, with notices for any adjustment.

    num_frames None takes the rules' default; width and height None take the canvas from the aspect ratio (ref2va:
    16:9, as the reference pipeline does). references: ref2va's encoded files, each `bytes` or `(name, bytes)`,
    decoded here (`pipeline.references`); mute_references: positions of video references whose soundtrack is left
    out. quality: step caching for this request (`QUALITIES`), None for the server's setting.
    """
    if task not in TASKS:
        raise RequestError("task", f"task must be one of {', '.join(TASKS)}, got {task!r}")
    if task != REF2VA and (references or mute_references):
        raise RequestError("references", f"references: only task ref2va takes references, got task {task}")
    if not isinstance(prompt, str) or not prompt.strip():
        raise RequestError("prompt", "prompt must be a non-empty string")
    images = _check_keyframes(task, keyframes)
    width, height, notices = _check_canvas(width, height, images, rules.canvas)
    requested = rules.frames.default_frames if num_frames is None else _number("num_frames", num_frames, int)
    num_frames, frame_notices = rules.frames.check(requested)
    notices += frame_notices
    steps, seed = _check_sampling(steps, seed, video_shift, audio_shift, rules)
    if quality is not None and quality not in QUALITIES:
        raise RequestError("quality", f"quality must be one of {', '.join(QUALITIES)}, got {quality!r}")
    decoded = ()
    if task == REF2VA:
        from h3serve.pipeline.references import decode_references  # it builds on this module

        if not references:
            raise RequestError("references", "references: task ref2va needs at least one reference file")
        decoded = decode_references(references, num_frames=num_frames, mute=mute_references, rules=rules)

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
        quality=quality,
        notices=tuple(notices),
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
    if (width is None) != (height is None):
        raise RequestError("width", "width and height must be given together, or both left out")
    if width is None:
        aspect = images[0].size if images else (16, 9)
        try:
            width, height = resolve_canvas(*aspect, canvas)
        except ValueError as e:
            raise RequestError("keyframes", f"keyframes[0]: {e}; give width and height explicitly") from e
        if not images:
            source = "the default 16:9"
        else:
            source = "the keyframe's aspect ratio" if len(images) == 1 else "the first keyframe's aspect ratio"
        notices.append(f"canvas {width}x{height} chosen from {source}")
    width, height = _number("width", width, int), _number("height", height, int)
    canvas.check(width, height)
    return width, height, notices


def _check_sampling(
    steps: int, seed: int, video_shift: float, audio_shift: float, rules: RequestRules
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
        DualSchedule.build(steps, float(video_shift), float(audio_shift))
    except ValueError as e:
        raise RequestError("steps", str(e)) from e
    return steps, seed
