"""What a render request may be: the model's limits as data, and the error that says which value broke them.

    RequestError           a refused value: its field (and, for one item of a list, its index) as attributes
    RequestRules           canvas, frame, step and reference-size limits; `RELEASED_RULES`, `TINY_RULES`
    resolve_canvas         the released model's canvas for an aspect ratio
    decode_image           one image input (a keyframe or a reference image) -> RGB, EXIF orientation applied; only
                           the allow-listed formats (`media.formats`), at most `CanvasRule.max_input_pixels`
    check_reference_kinds  the per-request Ref2VA limits, which depend on the kinds alone

`request.validate_request` applies these to a whole request and `references.decode_references` to Ref2VA's files;
both build on this module, and it on neither.

Frame rule: the video VAE decodes 17n+5 frames (n >= 1), so counts snap up to that grid. The released model
was trained on 5-15 s (124-362 frames at 24 fps); the hard limits are 22 (the shortest 17n+5 with n >= 1) to
362 frames, and 22-123 frames are accepted with a notice. That keeps the startup warmup (768x448, 56 frames)
valid, since the network runs short clips correctly, while anything longer than trained is refused.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from PIL import Image, ImageOps

from h3serve.config import CLIP_FRAMES, FPS, LATENTS_PER_CLIP, PATCH_SIZE, SPATIAL_RATIO
from h3serve.media.formats import FormatError, FormatKind, exception_text, sniff
from h3serve.vocab import MIN_FRAMES, SMOKE_REQUEST, ReferenceKind, snap_up

MAX_SEED = 2**63 - 1
# Per-request step caching (vLLM-Omni's `quality`): None follows the server, lossless runs without the cache, high
# with the conservative profile (`accel.stepcache.HIGH_QUALITY`) on a server started with one.
QUALITIES = ("lossless", "high")

# Ref2VA reference limits per request (docs/model.md §5); audio references need an image or video beside them.
MAX_REFERENCE_IMAGES = 9
MAX_REFERENCE_VIDEOS = 3
MAX_REFERENCE_AUDIOS = 3
MAX_REFERENCES = 12
# A decoded input image or video frame may have this many times a canvas's area, at most. Inputs are resized down
# (LANCZOS) to a canvas or a reference's encode size, so anything far larger only costs decode time and memory: PIL
# holds 3 bytes a pixel and the resize reads each one.
INPUT_PIXELS_PER_CANVAS = 16
_KIND_LIMITS = {
    ReferenceKind.IMAGE: MAX_REFERENCE_IMAGES,
    ReferenceKind.VIDEO: MAX_REFERENCE_VIDEOS,
    ReferenceKind.AUDIO: MAX_REFERENCE_AUDIOS,
}


class RequestError(ValueError):
    """A request value the model's rules refuse. What was refused, and where, are attributes, so that a front end
    names it in its own terms without reading the message.

    field: the value in the engine's terms: task, prompt, keyframes, references, mute_references, width, height,
        num_frames, steps, seed, video_shift, audio_shift or quality.
    index: for one item of a list, its position in the list `of` (`field` unless told): keyframes[i] in packed order,
        references[i] in request order; a mute_references refusal points at the reference it names. None otherwise.
    name: the item's file name, where the request gave one.

    A message about a whole field names the field itself ("width must be a positive multiple of 32, got 770"). A
    message about an item says what is wrong with it ("could not be decoded as an image (...)") and the error puts
    the item in front, "references[2] (notes.txt) could not be decoded as ..."; `describe(names)` writes the same
    with a front end's names for the fields.
    """

    def __init__(
        self, field: str, message: str, index: int | None = None, *, name: str | None = None, of: str | None = None
    ):
        self.field = field
        self.message = message
        self.index = index
        self.name = name
        self.of = field if of is None else of
        super().__init__(self.describe())

    def describe(self, names: Mapping[str, str] | None = None) -> str:
        """The message with the fields named by `names` (engine name -> a front end's name; a field it leaves out
        keeps the engine's name). A whole-field message is returned as it is: the front end puts its name in front."""
        if self.index is None:
            return self.message
        names = names or {}
        item = f"{names.get(self.of, self.of)}[{self.index}]" + (f" ({self.name})" if self.name else "")
        if self.of == self.field:
            return f"{item} {self.message}"
        return f"{names.get(self.field, self.field)}: {item} {self.message}"


@dataclass(frozen=True)
class CanvasRule:
    """Which (width, height) a model accepts, and which it picks when the caller gives none."""

    multiple: int = SPATIAL_RATIO * PATCH_SIZE[1]  # 32: the VAE's 16 times the DiT's 2x2 patch
    max_pixels: int = 768 * 1344  # area cap, before rounding each side to `multiple`
    default_short_edge: int = 768  # the only short edge the released model was verified at
    min_aspect: float = 1 / 4
    max_aspect: float = 4.0

    @property
    def max_input_pixels(self) -> int:
        """The most pixels a decoded input image or video frame may have: `INPUT_PIXELS_PER_CANVAS` canvases."""
        return INPUT_PIXELS_PER_CANVAS * self.max_pixels

    def check_input_size(self, width: int, height: int, video: bool = False) -> None:
        """ValueError unless an input image (or a video's frames) of width x height is within `max_input_pixels`; its
        message reads after the input's name: "is a 13000x13000 image (169.0 MP); the limit ..."."""
        if width * height <= self.max_input_pixels:
            return
        size, megapixels = f"{width}x{height}", width * height / 1e6
        what, limited = (f"video of {size} frames", "video frame") if video else (f"{size} image", "image")
        raise ValueError(
            f"is a {what} ({megapixels:.1f} MP); the limit for an input {limited} "
            f"is {self.max_input_pixels / 1e6:.1f} MP ({INPUT_PIXELS_PER_CANVAS}x the largest canvas); scale it down"
        )

    def check_side(self, name: str, value: int) -> None:
        """RequestError(name) unless `value` can be a side of a canvas: a positive multiple of `multiple`, not over
        the area cap whatever the other side is (which also keeps the ratio finite). Checked on its own, so that a
        side given without the other is told what is wrong with it."""
        if value > self.max_pixels // self.multiple:
            raise RequestError(name, f"{name} {value} is above the canvas area cap of {self.max_pixels} pixels")
        if value < self.multiple or value % self.multiple:
            raise RequestError(name, f"{name} must be a positive multiple of {self.multiple}, got {value}")

    def check(self, width: int, height: int) -> None:
        """Raise RequestError unless (width, height) is a canvas of this rule.

        Sides are positive multiples of `multiple`, the aspect ratio is within bounds, and the area rounds from
        within `max_pixels`: half a multiple per side is removed before comparing, the most that rounding adds,
        because `resolve_canvas` itself lands slightly above the cap for some aspect ratios.
        """
        m = self.multiple
        for name, value in (("width", width), ("height", height)):
            self.check_side(name, value)
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


@dataclass(frozen=True)
class FrameRule:
    """Which frame counts a model accepts on the VAE's 17n+5 grid (at the released 24 fps), and its default."""

    min_frames: int = MIN_FRAMES
    max_frames: int = 362
    trained_min_frames: int = 124  # 5 s; below it a notice, not an error
    default_frames: int = 124

    def check(self, requested: int) -> tuple[int, list[str]]:
        """The frame count a request gets (snapped up to the grid) and the notices to give; RequestError if outside."""
        notices = []
        if requested < 1:
            raise RequestError("num_frames", f"num_frames must be >= {self.min_frames}, got {requested}")
        num_frames = snap_up(requested)
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
    warmup_size: tuple[int, int] | None = (SMOKE_REQUEST.width, SMOKE_REQUEST.height)
    warmup_frames: int | None = SMOKE_REQUEST.num_frames
    # Ref2VA: a reference image is resized so that its short edge is this (diffusers' `reference_image_short_edge`);
    # a reference video goes onto `canvas` at its own aspect ratio.
    reference_short_edge: int = 2048


RELEASED_RULES = RequestRules()
# The built-in tiny model accepts small canvases (its default is 224x128) and defaults to the shortest clip, so that
# a render takes seconds on a CPU.
TINY_RULES = RequestRules(
    canvas=CanvasRule(max_pixels=512 * 512, default_short_edge=128),
    frames=FrameRule(default_frames=MIN_FRAMES),
    warmup_size=None,
    warmup_frames=None,
    reference_short_edge=128,
)


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


def decode_image(
    field: str,
    index: int,
    image: Image.Image | bytes | bytearray | memoryview,
    *,
    name: str | None = None,
    rule: CanvasRule = CanvasRule(),
) -> Image.Image:
    """An RGB image from a PIL image or encoded bytes (PNG, JPEG, WebP, BMP or TIFF, told by their magic bytes), with
    its EXIF orientation applied, as the reference's image loading does. Its size is checked against
    `rule.max_input_pixels` from the header, before any pixel is decoded. `field`, `index` and `name` say which input
    it is, for the RequestError."""

    def refused(message: str) -> RequestError:
        return RequestError(field, message, index, name=name)

    if isinstance(image, Image.Image):
        decoded = image
        _check_image_size(decoded, rule, refused)
    elif isinstance(image, bytes | bytearray | memoryview):
        data = bytes(image)
        if not data:
            raise refused("is empty (0 bytes)")
        try:
            fmt = sniff(data, (FormatKind.IMAGE,))
        except FormatError as e:
            raise refused(f"could not be decoded as an image: {e}") from None
        try:
            # Lazy: reads the header only. Only the sniffed format's plugin is tried.
            decoded = Image.open(io.BytesIO(data), formats=[fmt.pil_format])
        except Image.DecompressionBombError as e:  # PIL's own bound (2 * MAX_IMAGE_PIXELS) is far above ours
            raise refused(
                f"is a {fmt.name} image of more than {2 * (Image.MAX_IMAGE_PIXELS or 0) / 1e6:.1f} MP; the limit for "
                f"an input image is {rule.max_input_pixels / 1e6:.1f} MP ({INPUT_PIXELS_PER_CANVAS}x the largest "
                "canvas); scale it down"
            ) from e
        except Exception as e:  # PIL raises many types (UnidentifiedImageError, OSError, SyntaxError, ...)
            raise refused(f"could not be decoded as an image ({fmt.name}: {exception_text(e)})") from e
        _check_image_size(decoded, rule, refused)
        try:
            decoded.load()
        except Exception as e:
            raise refused(f"could not be decoded as an image ({fmt.name}: {exception_text(e)})") from e
    else:
        raise refused(f"must be image bytes or a PIL image, got {type(image).__name__}")
    # Camera JPEGs store their rotation as EXIF; apply it, as the reference's image loading does.
    decoded = ImageOps.exif_transpose(decoded)
    if decoded.width < 1 or decoded.height < 1:
        raise refused(f"has no pixels ({decoded.width}x{decoded.height})")
    return decoded.convert("RGB")


def _check_image_size(image: Image.Image, rule: CanvasRule, refused: Callable[[str], RequestError]) -> None:
    try:
        rule.check_input_size(*image.size)
    except ValueError as e:
        raise refused(str(e)) from None


def check_reference_kinds(kinds: Sequence[str], names: Sequence[str | None] | None = None) -> None:
    """The per-request Ref2VA limits, which depend on the kinds alone: at least one reference, at most 9 images,
    3 videos and 3 audio references and 12 in all, and audio never alone. RequestError("references") naming the
    first reference over a limit by its index (and its name from `names`, in request order, where given)."""
    kinds = list(kinds)
    names = list(names) if names is not None else [None] * len(kinds)
    if not kinds:
        raise RequestError(
            "references", "references: ref2va needs at least one reference (a text-only request is t2va)"
        )
    for i, kind in enumerate(kinds):
        if kind not in _KIND_LIMITS:
            raise RequestError(
                "references", f"is not an image, a video or an audio reference (kind {kind!r})", i, name=names[i]
            )
    for kind, limit in _KIND_LIMITS.items():
        positions = [i for i, k in enumerate(kinds) if k == kind]
        if len(positions) > limit:
            i = positions[limit]
            raise RequestError(
                "references",
                f"is one {kind} reference too many: at most {limit} {kind} references per request, "
                f"got {len(positions)}",
                i,
                name=names[i],
            )
    if len(kinds) > MAX_REFERENCES:
        raise RequestError(
            "references",
            f"is one reference too many: at most {MAX_REFERENCES} references in total, got {len(kinds)}",
            MAX_REFERENCES,
            name=names[MAX_REFERENCES],
        )
    if set(kinds) == {ReferenceKind.AUDIO}:
        raise RequestError(
            "references",
            "is audio, which needs at least one image or video reference beside it; audio cannot be the only reference",
            0,
            name=names[0],
        )
