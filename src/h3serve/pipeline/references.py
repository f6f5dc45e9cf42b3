"""Ref2VA inputs: reference files -> decoded, validated media on the model's grids, in request order.

    decode_references      encoded files (request order) -> `DecodedReference`s, or RequestError("references", index=i)
    reference_descriptors  decoded references -> the layout's `Reference` blocks (latent sizes)

What each kind becomes (the released model's preparation, as in docs/model.md §5 and diffusers' ref2va setup step):

* image: EXIF orientation applied, RGB, aspect ratio within 1:4..4:1, resized (LANCZOS, upscaling included, no area
  cap) so that its short edge is 2048, each side then rounded to a multiple of 32.
* video: frames decoded as RGB with the stream's display rotation undone, resized (LANCZOS) onto the canvas of their
  own aspect ratio (the target's canvas rule: short edge 768, area cap 768*1344, multiples of 32), put on the 24 fps
  grid by holding every frame until the slot of the next one (whole frames dropped or repeated, like ffmpeg's `fps`
  filter) and truncated to the generated frame count. The VAE later encodes the longest 17n+5 prefix. Its soundtrack,
  if kept, is prepared like an audio reference.
* audio: decoded at its own rate, truncated there to the generated duration, mono copied to both channels, then
  resampled to 32 kHz with a Hann-windowed sinc (the resampler torchaudio's `Resample` defaults to).

The kind comes from the content: the format from the file's magic bytes (`media.formats`: images PNG, JPEG, WebP, BMP,
TIFF; containers MP4/MOV, Matroska/WebM, AVI, Ogg, WAV, MP3, FLAC, AAC; anything else is refused), then a container
with a video stream (cover art does not count) is a video and one with only an audio stream is audio. Each file is
opened with its sniffed format's decoder alone, never by probing. Long media is truncated, not refused, as the
reference pipeline does; decoding stops once the generated duration is covered.

Hard limits, checked from the headers before anything is decoded: an image or a video frame of at most
`CanvasRule.max_input_pixels` (16 canvases), a video at a known frame rate of at most `MAX_REFERENCE_FPS`, audio at
a known sample rate of at most `MAX_REFERENCE_SAMPLE_RATE` that resamples to 32 kHz through a filter of at most
`MAX_RESAMPLE_KERNEL` taps, mono or stereo.
"""

from __future__ import annotations

import io
import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import av
import numpy as np
import torch
from PIL import Image

from h3serve.config import AUDIO_LATENTS_PER_SECOND, FPS, SAMPLE_RATE, SPATIAL_RATIO
from h3serve.media.formats import FormatError, FormatKind, MediaFormat, exception_text, sniff
from h3serve.pipeline.layout import MediaGeometry, Reference, validate_references
from h3serve.pipeline.rules import (
    RELEASED_RULES,
    CanvasRule,
    RequestError,
    RequestRules,
    check_reference_kinds,
    decode_image,
    resolve_canvas,
)
from h3serve.vocab import AUDIO_CHANNELS, MIN_FRAMES, ReferenceKind, snap_down

IMAGE, VIDEO, AUDIO = ReferenceKind.IMAGE, ReferenceKind.VIDEO, ReferenceKind.AUDIO
# The fewest frames a reference video may have on the 24 fps grid: the shortest clip the video VAE encodes (17n+5,
# n >= 1). diffusers has no such check (it would hand the VAE a shorter clip); this is our own refusal.
MIN_REFERENCE_VIDEO_FRAMES = MIN_FRAMES
AUDIO_HOP = SAMPLE_RATE // AUDIO_LATENTS_PER_SECOND  # audio VAE samples per latent (800)
# Hann-windowed sinc resampler: zero crossings per side and cutoff relative to the lower Nyquist frequency.
SINC_ZERO_CROSSINGS = 6
SINC_ROLLOFF = 0.99
# Header limits of a reference video and audio (ours; the reference pipeline has none). Decoding stops at the target
# duration, so the frame rate bounds the frames decoded (at most 10 per output frame) and the sample rate the samples.
MAX_REFERENCE_FPS = 240
MAX_REFERENCE_SAMPLE_RATE = 192_000
# Taps of the polyphase resampling filter (phases x taps per phase) for a rate -> 32 kHz. The filter has one phase per
# output sample of a block of gcd-reduced rates, so an odd rate costs quadratically: 44101 Hz would need 32000 x 44119
# float64 taps (11 GB). Every common rate is far below the bound (11025 Hz, the largest: 1280 x 455).
MAX_RESAMPLE_KERNEL = 1 << 20


@dataclass(frozen=True, eq=False)
class DecodedReference:
    """One reference, decoded and put on the model's grids.

    image: `pixels` (H, W, 3) uint8 at the encode size. video: `pixels` (F, H, W, 3) uint8 at 24 fps on its own
    canvas, `audio` its soundtrack or None. audio: `audio` only. `audio` is float32 (2, N) at 32 kHz.
    The `source_*` fields describe the file as decoded (after rotation), before any resampling.
    """

    index: int  # position in the request
    kind: ReferenceKind
    pixels: np.ndarray | None = None
    audio: np.ndarray | None = None
    source_size: tuple[int, int] | None = None  # (width, height) of an image or a video
    source_fps: float | None = None  # video
    source_frames: int | None = None  # video frames decoded (decoding stops once the target duration is covered)
    source_sample_rate: int | None = None  # audio, or a video's soundtrack
    source_channels: int | None = None
    name: str | None = None

    @property
    def vae_frames(self) -> int:
        """Frames of a video the VAE encodes: the frame count snapped down to 17n+5 (1 for an image)."""
        if self.kind == IMAGE:
            return 1
        if self.kind != VIDEO:
            return 0
        return snap_down(self.pixels.shape[0])


def reference_image_size(
    width: int,
    height: int,
    short_edge: int = RELEASED_RULES.reference_short_edge,
    multiple: int = RELEASED_RULES.canvas.multiple,
):
    """(width, height) an image reference is encoded at: short edge `short_edge`, each side rounded to `multiple`."""
    scale = short_edge / min(width, height)
    return max(multiple, round(width * scale / multiple) * multiple), max(
        multiple, round(height * scale / multiple) * multiple
    )


def frame_slots(num_frames: int, fps: float, target_fps: float = FPS) -> np.ndarray:
    """How many times each of `num_frames` source frames at `fps` appears on the `target_fps` grid.

    Source frame i starts at slot round-half-up(i * target/fps) and is held until the next frame's slot; the last
    frame until the slot the stream's end falls on. Zero drops a frame.
    """
    scale = target_fps / fps
    starts = np.floor(np.arange(num_frames + 1) * scale + 0.5).astype(np.int64)
    return np.diff(starts)


def resample_frames(frames: np.ndarray, fps: float, num_frames: int, target_fps: float = FPS) -> np.ndarray:
    """(F, H, W, 3) frames at `fps` -> on the `target_fps` grid, at most `num_frames` of them."""
    if fps != target_fps:
        frames = np.repeat(frames, frame_slots(frames.shape[0], fps, target_fps), axis=0)
    return frames[:num_frames]


def resample_kernel_size(sample_rate: int, target_rate: int = SAMPLE_RATE) -> int:
    """Taps of the polyphase filter `resample_audio` builds for sample_rate -> target_rate (0: no resampling)."""
    if sample_rate == target_rate:
        return 0
    g = math.gcd(int(sample_rate), int(target_rate))
    orig, new = int(sample_rate) // g, int(target_rate) // g
    half = math.ceil(SINC_ZERO_CROSSINGS * orig / (min(orig, new) * SINC_ROLLOFF))
    return new * (2 * half + orig)


def _sinc_kernel(orig: int, new: int) -> tuple[torch.Tensor, int]:
    """Polyphase kernels (new, 1, taps) of a Hann-windowed sinc low-pass for orig -> new (reduced by their gcd)."""
    cutoff = min(orig, new) * SINC_ROLLOFF
    half = math.ceil(SINC_ZERO_CROSSINGS * orig / cutoff)
    taps = torch.arange(-half, half + orig, dtype=torch.float64) / orig
    # The phase offsets are float32 before they meet the float64 taps, as in torchaudio's kernel.
    phases = (torch.arange(0, -new, -1)[:, None] / new).to(torch.float64)
    x = ((phases + taps[None]) * cutoff).clamp(-SINC_ZERO_CROSSINGS, SINC_ZERO_CROSSINGS)
    window = torch.cos(x * math.pi / (2 * SINC_ZERO_CROSSINGS)) ** 2
    arg = x * math.pi
    safe = torch.where(arg == 0, torch.ones_like(arg), arg)
    sinc = torch.where(arg == 0, torch.ones_like(arg), torch.sin(safe) / safe)
    return (sinc * window * (cutoff / orig)).to(torch.float32)[:, None, :], half


def resample_audio(waveform: np.ndarray, sample_rate: int, target_rate: int = SAMPLE_RATE) -> np.ndarray:
    """(C, N) float32 at `sample_rate` -> (C, ceil(N * target / rate)) float32 at `target_rate`."""
    waveform = np.ascontiguousarray(waveform, dtype=np.float32)
    if sample_rate == target_rate:
        return waveform
    g = math.gcd(int(sample_rate), int(target_rate))
    orig, new = int(sample_rate) // g, int(target_rate) // g
    kernel, half = _sinc_kernel(orig, new)
    channels, length = waveform.shape
    x = torch.nn.functional.pad(torch.from_numpy(waveform), (half, half + orig))
    out = torch.nn.functional.conv1d(x[:, None], kernel, stride=orig)  # (C, new, blocks)
    out = out.transpose(1, 2).reshape(channels, -1)
    return out[:, : math.ceil(new * length / orig)].contiguous().numpy()


def prepare_audio(waveform: np.ndarray, sample_rate: int, max_seconds: float) -> np.ndarray:
    """A (C, N) soundtrack -> float32 (2, M) at 32 kHz: truncated at its own rate, mono doubled, resampled."""
    waveform = np.asarray(waveform, dtype=np.float32)[:, : int(max_seconds * sample_rate)]
    if waveform.shape[0] == 1:
        waveform = np.repeat(waveform, AUDIO_CHANNELS, axis=0)
    return resample_audio(waveform, sample_rate)


def reference_descriptors(references: Sequence[DecodedReference]) -> tuple[Reference, ...]:
    """Decoded references -> the layout's `Reference` blocks, in order.

    image: one latent frame at (H/16, W/16) of its encode size. video: the latent frames of its 17n+5 prefix
    (5n+2) at its canvas / 16, plus its soundtrack's latents. Audio latents: ceil(samples / 800), because the audio
    VAE right-pads a waveform to a multiple of its hop.
    """
    blocks = []
    for ref in references:
        audio_latents = 0 if ref.audio is None else math.ceil(ref.audio.shape[1] / AUDIO_HOP)
        if ref.kind == IMAGE:
            h, w = ref.pixels.shape[:2]
            blocks.append(Reference.image(h // SPATIAL_RATIO, w // SPATIAL_RATIO))
        elif ref.kind == VIDEO:
            _, h, w, _ = ref.pixels.shape
            geometry = MediaGeometry.from_pixels(h, w, ref.vae_frames)
            blocks.append(
                Reference.video(geometry.latent_frames, geometry.latent_height, geometry.latent_width, audio_latents)
            )
        else:
            blocks.append(Reference.audio(audio_latents))
    return validate_references(blocks)


def decode_references(
    items: Sequence[bytes | tuple[str | None, bytes]],
    *,
    num_frames: int | None = None,
    mute: Collection[int] = (),
    rules: RequestRules = RELEASED_RULES,
) -> tuple[DecodedReference, ...]:
    """Decode and validate a Ref2VA request's reference files, in request order.

    items: encoded files, each `bytes` or `(name, bytes)` (the name only appears in messages). num_frames: the
    request's generated frame count on the 17n+5 grid (None: the longest the model allows); videos and soundtracks
    are truncated to it. mute: positions of video references whose soundtrack is dropped. rules: the model's canvas
    rule (a video's canvas) and reference image short edge.
    Raises RequestError("references", index=i) for reference i, ("references") for an empty list, and
    ("mute_references", index=i) for a muted reference i that is not a video.
    """
    if num_frames is None:
        num_frames = rules.frames.max_frames
    if not isinstance(num_frames, int) or isinstance(num_frames, bool) or num_frames < 1:
        raise RequestError("num_frames", f"num_frames must be a positive integer, got {num_frames!r}")
    named = [_split(i, item) for i, item in enumerate(items)]
    probed = [_probe(i, name, data, rules.canvas) for i, (name, data) in enumerate(named)]
    kinds = [kind for kind, _ in probed]
    check_reference_kinds(kinds, [name for name, _ in named])
    for i in sorted(mute):
        if not (0 <= i < len(kinds)) or kinds[i] != VIDEO:
            raise RequestError("mute_references", "is not a video reference", i, of="references")
    max_seconds = num_frames / FPS
    decoded = []
    for i, ((name, data), (kind, fmt)) in enumerate(zip(named, probed, strict=True)):
        if kind == IMAGE:
            decoded.append(_decode_image(i, name, data, rules))
        elif kind == VIDEO:
            decoded.append(_decode_video(i, name, data, fmt, num_frames, rules.canvas, keep_sound=i not in mute))
        else:
            decoded.append(_decode_audio(i, name, data, fmt, max_seconds, rules.canvas))
    return tuple(decoded)


def _refused(i: int, name: str | None, message: str) -> RequestError:
    """Reference i refused: `message` says what is wrong with it (the error puts "references[i] (name)" in front)."""
    return RequestError("references", message, i, name=name)


def _split(i: int, item) -> tuple[str | None, bytes]:
    if isinstance(item, tuple) and len(item) == 2:
        name, data = item
    else:
        name, data = None, item
    if not isinstance(data, bytes | bytearray | memoryview):
        raise _refused(i, None, f"must be file bytes, got {type(data).__name__}")
    if name is not None and not isinstance(name, str):
        raise _refused(i, None, f"must have a string for its name, got {name!r}")
    data = bytes(data)
    if not data:
        raise _refused(i, name, "is empty (0 bytes)")
    return name, data


def _video_streams(container) -> list:
    """Real video streams: cover art (an attached picture, e.g. in an MP3) is not a video."""
    return [s for s in container.streams.video if not s.disposition & av.stream.Disposition.attached_pic]


def _refuse_nested_open(url: str, flags: int, options: dict) -> None:
    """PyAV's `io_open` hook: a demuxer that asks for another file or URL (a playlist's entry, a MOV data reference)
    gets an error. The allow-listed demuxers open none by default; this keeps it so whatever their options."""
    raise PermissionError("a reference file may not open other files")


def _open_container(data: bytes, fmt: MediaFormat, rule: CanvasRule):
    """`data` opened with the sniffed demuxer alone. `max_pixels` bounds every frame the decoders allocate, including
    those `avformat_find_stream_info` decodes while opening, so a frame larger than its header says fails too."""
    return av.open(
        io.BytesIO(data),
        mode="r",
        format=fmt.demuxer,
        options={"max_pixels": str(rule.max_input_pixels)},
        io_open=_refuse_nested_open,
    )


def _probe(i: int, name: str | None, data: bytes, rule: CanvasRule) -> tuple[ReferenceKind, MediaFormat]:
    """The reference's kind and format: the format from its magic bytes; a container's kind from its streams."""
    try:
        fmt = sniff(data)
    except FormatError as e:
        raise _refused(i, name, f"could not be decoded as an image, a video or an audio file: {e}") from None
    if fmt.kind == FormatKind.IMAGE:
        return IMAGE, fmt
    try:
        with _open_container(data, fmt, rule) as container:
            if fmt.video and _video_streams(container):
                return VIDEO, fmt
            if container.streams.audio:
                return AUDIO, fmt
    except Exception as e:  # FFmpeg raises many types (InvalidDataError, ValueError, ...)
        raise _refused(
            i, name, f"could not be decoded as a video or an audio file ({fmt.name}: {exception_text(e)})"
        ) from e
    raise _refused(i, name, f"is a {fmt.name} file with neither a video nor an audio stream")


def _check_video_stream(i: int, name: str | None, stream, rule: CanvasRule) -> float:
    """The stream's frame rate, once its header's frame size and rate are within the limits; nothing decoded yet."""
    context = stream.codec_context
    if context is None:
        raise _refused(i, name, "has a video stream in a codec this server cannot decode")
    width, height = context.width, context.height
    if width < 1 or height < 1:  # also where `max_pixels` stopped FFmpeg's probe decode and it gave up the size
        raise _refused(
            i,
            name,
            "has a video stream without a usable frame size (none in its header, or above the "
            f"{rule.max_input_pixels / 1e6:.1f} MP limit for an input video frame)",
        )
    try:
        rule.check_input_size(width, height, video=True)
    except ValueError as e:
        raise _refused(i, name, str(e)) from None
    rate = stream.average_rate or stream.guessed_rate
    fps = float(rate) if rate else 0.0
    if not (math.isfinite(fps) and fps > 0):
        raise _refused(i, name, "has a video stream without a frame rate")
    if fps > MAX_REFERENCE_FPS:
        raise _refused(
            i, name, f"has a video stream at {fps:g} fps; the limit for a reference video is {MAX_REFERENCE_FPS} fps"
        )
    return fps


def _check_audio_stream(i: int, name: str | None, stream, what: str) -> None:
    """A reference's audio stream (`what`: "audio", "a soundtrack"): a known sample rate within the limit and one that
    resamples within `MAX_RESAMPLE_KERNEL`, one or two channels; from its header, before any sample is decoded."""
    if stream.codec_context is None:
        raise _refused(i, name, f"has {what} in a codec this server cannot decode")
    rate_hz = int(stream.codec_context.sample_rate or 0)
    if rate_hz <= 0:
        raise _refused(i, name, f"has {what} without a sample rate")
    if rate_hz > MAX_REFERENCE_SAMPLE_RATE:
        raise _refused(
            i, name, f"has {what} at {rate_hz} Hz; the limit for reference audio is {MAX_REFERENCE_SAMPLE_RATE} Hz"
        )
    if resample_kernel_size(rate_hz) > MAX_RESAMPLE_KERNEL:
        raise _refused(
            i,
            name,
            f"has {what} at {rate_hz} Hz, a rate that resamples to {SAMPLE_RATE} Hz only through a filter of "
            f"{resample_kernel_size(rate_hz)} taps (the limit is {MAX_RESAMPLE_KERNEL}); convert it to a common rate "
            "such as 48000 or 44100 Hz",
        )
    # The decoded channels follow the stream's layout (`_read_audio` converts to it), so this is the check
    # `_prepare_checked` makes after decoding, made before it.
    channels = stream.layout.nb_channels
    if channels > AUDIO_CHANNELS:
        raise _refused(i, name, f"has {what} of {channels} channels; mono or stereo is accepted")


def _decode_image(i: int, name: str | None, data: bytes, rules: RequestRules) -> DecodedReference:
    # EXIF orientation and RGB, as keyframes are decoded; the format allow-list and the pixel limit with them.
    image = decode_image("references", i, data, name=name, rule=rules.canvas)
    width, height = image.size
    ratio = width / height
    canvas = rules.canvas
    if not canvas.min_aspect <= ratio <= canvas.max_aspect:
        raise _refused(
            i,
            name,
            f"is an image whose aspect ratio {width}x{height} ({ratio:.3g}) is outside "
            f"[{canvas.min_aspect:g}, {canvas.max_aspect:g}]",
        )
    size = reference_image_size(width, height, rules.reference_short_edge, canvas.multiple)
    if image.size != size:
        image = image.resize(size, Image.Resampling.LANCZOS)
    return DecodedReference(
        index=i, kind=IMAGE, pixels=np.asarray(image, dtype=np.uint8), source_size=(width, height), name=name
    )


def _slot(frame: int, scale: float) -> int:
    """The 24 fps slot source frame `frame` starts at, `scale` = 24 / its fps: round half up, as `frame_slots`."""
    return math.floor(frame * scale + 0.5)


def _upright_rgb(frame, turns: int, canvas: tuple[int, int]) -> np.ndarray:
    """A decoded video frame as (H, W, 3) uint8 RGB, turned upright by its `turns` quarter turns and resized to the
    (width, height) `canvas` when it differs."""
    rgb = frame.to_ndarray(format="rgb24")
    if turns:
        rgb = np.ascontiguousarray(np.rot90(rgb, k=-turns))
    if rgb.shape[1::-1] != canvas:
        rgb = np.asarray(Image.fromarray(rgb).resize(canvas, Image.Resampling.LANCZOS))
    return rgb


def _decode_video(
    i: int,
    name: str | None,
    data: bytes,
    fmt: MediaFormat,
    num_frames: int,
    rule: CanvasRule,
    keep_sound: bool,
) -> DecodedReference:
    try:
        with _open_container(data, fmt, rule) as container:
            stream = _video_streams(container)[0]
            fps = _check_video_stream(i, name, stream, rule)
            stream.codec_context.options = {"max_pixels": str(rule.max_input_pixels)}
            kept, held, decoded, canvas, turns, source_size = [], [], 0, None, 0, None
            scale = FPS / fps
            for frame in container.decode(stream):
                try:  # a frame larger than the stream's header said (`max_pixels` stops most decoders before)
                    rule.check_input_size(frame.width, frame.height, video=True)
                except ValueError as e:
                    raise _refused(i, name, str(e)) from None
                if canvas is None:
                    turns = round(frame.rotation / 90.0) % 4
                    width, height = (frame.height, frame.width) if turns % 2 else (frame.width, frame.height)
                    source_size = (width, height)
                    try:
                        canvas = resolve_canvas(width, height, rule)
                    except ValueError as e:
                        raise _refused(i, name, f"is a video whose {e}") from e
                # How often this frame appears on the 24 fps grid (`frame_slots`); a frame it drops (above 24 fps)
                # is neither converted nor kept, so memory follows the frames generated, not the source's rate.
                slots = _slot(decoded + 1, scale) - _slot(decoded, scale)
                decoded += 1
                if slots:
                    kept.append(_upright_rgb(frame, turns, canvas))
                    held.append(slots)
                # One frame past the target duration fixes how long the last kept frame is held; stop there.
                if _slot(decoded - 1, scale) >= num_frames:
                    break
            sound = None
            if keep_sound and container.streams.audio:
                _check_audio_stream(i, name, container.streams.audio[0], "a soundtrack")
                container.seek(0)
                sound = _read_audio(container, container.streams.audio[0], num_frames / FPS)
    except RequestError:
        raise
    except Exception as e:
        raise _refused(i, name, f"could not be decoded as a video ({fmt.name}: {exception_text(e)})") from e
    if not decoded:
        raise _refused(i, name, "has a video stream without decodable frames")
    count = min(sum(held), num_frames)
    if count < MIN_REFERENCE_VIDEO_FRAMES:
        raise _refused(
            i,
            name,
            f"is a video of {count} frames at {FPS} fps, too short: at least {MIN_REFERENCE_VIDEO_FRAMES} "
            f"({MIN_REFERENCE_VIDEO_FRAMES / FPS:.2f} s) are needed",
        )
    # The same frames as `resample_frames` over every decoded frame: the dropped ones were never kept.
    pixels = np.repeat(np.stack(kept), held, axis=0)[:num_frames]
    audio = rate_hz = channels = None
    if sound is not None:
        waveform, rate_hz = sound
        channels = waveform.shape[0]
        audio = _prepare_checked(i, name, waveform, rate_hz, num_frames / FPS, "a soundtrack")
    return DecodedReference(
        index=i,
        kind=VIDEO,
        pixels=pixels,
        audio=audio,
        source_size=source_size,
        source_fps=fps,
        source_frames=decoded,
        source_sample_rate=rate_hz,
        source_channels=channels,
        name=name,
    )


def _decode_audio(
    i: int, name: str | None, data: bytes, fmt: MediaFormat, max_seconds: float, rule: CanvasRule
) -> DecodedReference:
    try:
        with _open_container(data, fmt, rule) as container:
            stream = container.streams.audio[0]
            _check_audio_stream(i, name, stream, "audio")
            waveform, rate_hz = _read_audio(container, stream, max_seconds)
    except RequestError:
        raise
    except Exception as e:
        raise _refused(i, name, f"could not be decoded as audio ({fmt.name}: {exception_text(e)})") from e
    audio = _prepare_checked(i, name, waveform, rate_hz, max_seconds, "audio")
    return DecodedReference(
        index=i,
        kind=AUDIO,
        audio=audio,
        source_sample_rate=rate_hz,
        source_channels=waveform.shape[0],
        name=name,
    )


def _read_audio(container, stream, max_seconds: float) -> tuple[np.ndarray, int]:
    """(C, N) float32 at the stream's own rate and layout; stops once `max_seconds` are decoded."""
    rate_hz = int(stream.codec_context.sample_rate)
    if rate_hz <= 0:
        raise ValueError("the audio stream has no sample rate")
    converter = av.AudioResampler(format="fltp", layout=stream.layout, rate=rate_hz)  # a format change only
    needed = int(max_seconds * rate_hz)
    chunks, have = [], 0
    for frame in container.decode(stream):
        for out in converter.resample(frame):
            chunks.append(out.to_ndarray())
            have += chunks[-1].shape[1]
        if have >= needed:
            break
    else:
        chunks += [out.to_ndarray() for out in converter.resample(None)]
    channels = stream.layout.nb_channels
    if not chunks:
        return np.zeros((channels, 0), np.float32), rate_hz
    return np.concatenate(chunks, axis=1).astype(np.float32, copy=False), rate_hz


def _prepare_checked(i: int, name: str | None, waveform: np.ndarray, rate_hz: int, max_seconds: float, what: str):
    if waveform.shape[0] not in (1, AUDIO_CHANNELS):
        raise _refused(i, name, f"has {what} of {waveform.shape[0]} channels; mono or stereo is accepted")
    if waveform.shape[1] == 0:
        raise _refused(i, name, f"has {what} with no decodable samples")
    if not np.isfinite(waveform).all():
        raise _refused(i, name, f"has {what} with NaN or infinite samples")
    return prepare_audio(waveform, rate_hz, max_seconds)
