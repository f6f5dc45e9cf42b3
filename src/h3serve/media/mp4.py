"""MP4 output: encode frames and stereo PCM to H.264 + AAC-LC, and decode them back for verification.

The writer is the last stage of the data flow. What it produces is fixed by the output contract:
H.264 (yuv420p, BT.709 limited range, 24 fps; the profile is the preset's: Constrained Baseline at the default
ultrafast, High from superfast on), AAC-LC stereo at the model's 32 kHz, MP4 with `moov` before `mdat` (faststart) so
a browser can play the file while it downloads.

Frames come as RGB (converted here, `media.yuv`) or already as packed yuv420p (a render converts them on its GPU):
the same conversion either way, so the same bytes. The video is encoded as `media.h264` says (segments on the
host's cores by default); the audio is encoded before the first frame arrives and interleaved by time as the video's
packets come, so neither waits on the other.

Determinism: two encodes of the same input with the same `Encoding` are byte-identical on the same av/FFmpeg build,
on any host (media.h264 says why); across av versions only the decoded frames are promised identical
(docs/model.md §7).

The decode helpers exist for verification (tests and the acceptance command) and assume files written
here: they convert with the same BT.709 limited-range matrix the writer uses.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import queue
import shutil
import sys
import tempfile
import threading
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import av
import numpy as np

from h3serve.config import FPS, SAMPLE_RATE
from h3serve.media.encoding import Encoding, EncodingError, is_int
from h3serve.media.h264 import Segments, codec_name, configure, encode_frames

if TYPE_CHECKING:  # torch is not imported for this module's sake: `h3serve ready` and the settings load without it
    import torch

DEFAULT_ENCODING = Encoding()
AUDIO_BIT_RATE = 128_000
# The native AAC encoder consumes fixed 1024-sample frames (only the last may be shorter).
AAC_FRAME_SAMPLES = 1024
# Sample rates the AAC-LC standard defines (ISO/IEC 14496-3 sampling frequency index).
AAC_SAMPLE_RATES = (8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000, 64000, 88200, 96000)

# One colour convention for both directions: BT.709 matrix, limited (MPEG) range, tagged in the stream so
# players do not guess (untagged HD is usually read as BT.709, SD as BT.601, which would shift colours).
_COLORSPACE = "ITU709"
_YUV_RANGE = "MPEG"


# ---------------------------------------------------------------------------------------------------------
# Encode
# ---------------------------------------------------------------------------------------------------------


def write_mp4(
    path: str | os.PathLike[str],
    frames: np.ndarray | torch.Tensor | FrameStream,
    audio: np.ndarray | torch.Tensor,
    *,
    fps: int = FPS,
    sample_rate: int = SAMPLE_RATE,
    encoding: Encoding = DEFAULT_ENCODING,
    check: Callable[[], None] | None = None,
) -> Path:
    """Encode `frames` (F, H, W, 3) uint8 RGB and `audio` (2, N) float32 in [-1, 1] to an MP4 at `path`.
    `frames` may be a `FrameStream` (the frames in chunks as they are made): the same bytes as the whole array.

    The file is written under a temporary name in the destination folder and renamed over `path` only when
    complete, so a reader never sees a partial file; on any error (a full disk, a file-size limit, a cancel) the
    temporary file is removed and an existing file at `path` is left as it was. Returns the destination path.
    `check` is called between frames; whatever it raises stops the encode (a service's cancel).
    """
    dest = Path(path)
    check_settings(fps, sample_rate, encoding)
    video = frames if isinstance(frames, FrameStream) else FrameStream.of(_check_frames(frames))
    pcm = _check_audio(audio)  # (2, N) float32
    _check_destination(dest)

    tmp = dest.with_name(f".{dest.name}.{uuid.uuid4().hex}.tmp")
    try:
        # Exclusive create through Python rather than av.open(path): FFmpeg parses a "name:" prefix in a path
        # as a protocol. '+' (read access) in case the faststart rewrite reads back through the handle.
        with open(tmp, "xb+") as fh:
            _encode(fh, video, pcm, fps=fps, sample_rate=sample_rate, encoding=encoding, check=check)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, dest)
    except PermissionError as err:
        tmp.unlink(missing_ok=True)
        raise PermissionError(f"cannot write an MP4 into folder {dest.parent}: {err.strerror}") from err
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return dest


def encode_mp4(
    fh: BinaryIO,
    frames: np.ndarray | torch.Tensor | FrameStream,
    audio: np.ndarray | torch.Tensor,
    *,
    fps: int = FPS,
    sample_rate: int = SAMPLE_RATE,
    encoding: Encoding = DEFAULT_ENCODING,
    check: Callable[[], None] | None = None,
) -> None:
    """Encode to a writable binary file object (a file, a BytesIO, a socket's file), with the same checks, settings
    and `check` as `write_mp4`. The object receives a complete MP4 or, on an error, nothing.

    The encode goes through a temporary file first: FFmpeg's faststart pass re-opens its output by name to move
    `moov` to the front, which an in-memory object does not have.
    """
    check_settings(fps, sample_rate, encoding)
    video = frames if isinstance(frames, FrameStream) else FrameStream.of(_check_frames(frames))
    pcm = _check_audio(audio)
    with tempfile.TemporaryDirectory(prefix="h3serve-mp4-") as folder:
        tmp = Path(folder) / "out.mp4"
        with open(tmp, "xb+") as out:
            _encode(out, video, pcm, fps=fps, sample_rate=sample_rate, encoding=encoding, check=check)
        with open(tmp, "rb") as done:
            shutil.copyfileobj(done, fh)


def _encode(
    fh: BinaryIO,
    video: FrameStream,
    pcm: np.ndarray,
    *,
    fps: int,
    sample_rate: int,
    encoding: Encoding,
    check: Callable[[], None] | None = None,
) -> None:
    container = av.open(fh, mode="w", format="mp4", options={"movflags": "+faststart"})
    try:
        vstream = _add_video_stream(container, video.width, video.height, fps, encoding)
        astream = _add_audio_stream(container, sample_rate)
        # The audio is whole before the first frame: encoded now, off the video's path, and muxed by time below.
        audio = deque(_encoded_audio(astream, pcm, sample_rate))
        # The container's own video encoder only makes the parameter sets (the MP4's avcC); the segments' encoders,
        # with the same settings, must reproduce them.
        container.start_encoding()
        header = bytes(vstream.codec_context.extradata or b"")
        segments = Segments(encoding, video.width, video.height, fps, header)

        def mux(packet: av.Packet) -> None:
            # Both streams in time order: a player streaming the file reads them side by side. (Left to the muxer,
            # audio far behind the video is written in long unmixed runs after its 10 s interleave window.)
            at = Fraction(packet.dts, fps)
            while audio and Fraction(audio[0].dts, sample_rate) <= at:
                container.mux_one(audio.popleft())
            packet.stream = vstream
            container.mux_one(packet)

        encode_frames(_video_frames(video, fps, check), segments, mux)
        while audio:
            container.mux_one(audio.popleft())
    except BaseException:
        # Release FFmpeg's handles; the caller removes the file. A second error here would only hide the first.
        with contextlib.suppress(Exception):
            container.close()
        raise
    container.close()  # writes the trailer and moves `moov` to the front


def _add_video_stream(
    container: av.container.OutputContainer, width: int, height: int, fps: int, encoding: Encoding
) -> av.video.stream.VideoStream:
    stream = container.add_stream(codec_name(encoding), rate=Fraction(fps, 1))
    stream.width = width
    stream.height = height
    stream.pix_fmt = "yuv420p"
    configure(stream.codec_context, encoding)
    return stream


def _add_audio_stream(container: av.container.OutputContainer, sample_rate: int) -> av.audio.stream.AudioStream:
    stream = container.add_stream("aac", rate=sample_rate)
    stream.layout = "stereo"
    stream.format = "fltp"  # the native encoder's only input format: no resampler in between
    stream.bit_rate = AUDIO_BIT_RATE
    return stream


def _encoded_audio(stream: av.audio.stream.AudioStream, pcm: np.ndarray, sample_rate: int) -> Iterator[av.Packet]:
    # Cut into the encoder's frame size ourselves: PyAV would otherwise insert its own FIFO and resampler,
    # whose behaviour is one more thing that can change between versions.
    for start in range(0, pcm.shape[1], AAC_FRAME_SAMPLES):
        chunk = np.ascontiguousarray(pcm[:, start : start + AAC_FRAME_SAMPLES])  # (2, <=1024)
        frame = av.AudioFrame.from_ndarray(chunk, format="fltp", layout="stereo")
        frame.sample_rate = sample_rate
        frame.pts = start
        frame.time_base = Fraction(1, sample_rate)
        yield from stream.encode(frame)
    yield from stream.encode(None)


def _video_frames(video: FrameStream, fps: int, check: Callable[[], None] | None) -> Iterator[av.VideoFrame]:
    i = 0
    for chunk in video:
        for planes in _as_i420(chunk):  # (H * 3 // 2, W)
            if check is not None:
                check()
            frame = av.VideoFrame.from_ndarray(planes, format="yuv420p")
            frame.pts = i
            frame.time_base = Fraction(1, fps)
            i += 1
            yield frame


def _as_i420(chunk: np.ndarray) -> np.ndarray:
    """A chunk as packed yuv420p: RGB chunks converted (`media.yuv`, the conversion a render does on its GPU)."""
    if chunk.ndim == 3:
        return chunk
    import torch

    from h3serve.media.yuv import rgb_to_i420

    return rgb_to_i420(torch.from_numpy(chunk)).numpy()


class FrameStream:
    """Frames of one size arriving in chunks from another thread, in order, each chunk (n, H, W, 3) uint8 RGB or
    (n, H * 3 // 2, W) uint8 packed yuv420p (`media.yuv.rgb_to_i420`, what a render hands on): `put` each,
    then `close` (or `fail`, which makes the reader raise). Iterating yields the chunks, waiting for each; `put` waits
    while `depth` chunks are unread, so a slow encoder holds the producer back instead of the host filling up (depth
    0: it never waits, the unread chunks stay in memory: the service's, whose GPU must not wait on its encoder).
    `of(frames)`: a whole array as one closed chunk."""

    def __init__(self, width: int, height: int, depth: int = 2):
        if not (is_int(width) and is_int(height)) or height < 2 or width < 2 or height % 2 or width % 2:
            raise ValueError(f"frames height and width must be even and >= 2 for yuv420p, got H={height} W={width}")
        self.width, self.height = width, height
        self._chunks: queue.Queue = queue.Queue(maxsize=depth)
        self.frames = 0  # put so far

    @classmethod
    def of(cls, frames: np.ndarray) -> FrameStream:
        stream = cls(frames.shape[2], frames.shape[1], depth=2)  # the chunk and the end
        stream.put(frames)
        stream.close()
        return stream

    def put(self, chunk: np.ndarray, timeout: float | None = None) -> None:
        """Queue a chunk, waiting while `depth` are unread (queue.Full after `timeout` seconds, if given)."""
        rgb, i420 = (self.height, self.width, 3), (self.height * 3 // 2, self.width)
        if chunk.dtype != np.uint8 or chunk.ndim not in (3, 4) or chunk.shape[1:] != (rgb if chunk.ndim == 4 else i420):
            raise ValueError(f"a chunk of frames must be uint8 (n, {self.height}, {self.width}, 3) RGB or (n, "
                             f"{i420[0]}, {self.width}) yuv420p, got {chunk.dtype} {tuple(chunk.shape)}")  # fmt: skip
        self._chunks.put(chunk, timeout=timeout)
        self.frames += len(chunk)

    def close(self, timeout: float | None = None) -> None:
        """The last chunk was put (queue.Full after `timeout` seconds while `depth` are unread, if given)."""
        self._chunks.put(_END, timeout=timeout)

    def fail(self, error: BaseException) -> None:
        """End the stream with `error`, raised in the reader at its next chunk (the encode stops and its file is
        removed). Never waits: the unread chunks are dropped first, so the reader meets the error next."""
        while True:
            self.drop()
            try:
                self._chunks.put_nowait(_Failed(error))
                return
            except queue.Full:  # a chunk put meanwhile: drop again
                continue

    def drop(self) -> None:
        """Drop the unread chunks (their reader is gone, or is to meet an error next); their memory goes."""
        while True:
            try:
                self._chunks.get_nowait()
            except queue.Empty:
                return

    def __iter__(self) -> Iterator[np.ndarray]:
        seen = 0
        while True:
            chunk = self._chunks.get()
            if chunk is _END:
                if seen == 0:
                    raise ValueError("frames is empty: need at least 1 frame, got shape (0, ...)")
                return
            if isinstance(chunk, _Failed):
                raise chunk.error
            seen += len(chunk)
            yield chunk


_END = object()


class Mp4Writer:
    """`write_mp4` on a thread of its own, fed frames while they are made (a render's `FrameSink`): `begin` with the
    audio and the frame size starts the encode, `put` hands it each chunk of frames in order (waiting while the
    encoder is two chunks behind), `finish` waits for the complete file; `abort` stops it and removes the partial
    file. The bytes are those of `write_mp4` over the whole array. The settings and the destination are checked when
    it is made, before anything renders."""

    def __init__(self, path: str | os.PathLike[str], *, encoding: Encoding = DEFAULT_ENCODING):
        check_settings(FPS, SAMPLE_RATE, encoding)
        self.path = Path(path)
        _check_destination(self.path)
        self.encoding = encoding
        self._stream: FrameStream | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def frames(self) -> int:
        return 0 if self._stream is None else self._stream.frames

    def begin(self, audio: np.ndarray, sample_rate: int, fps: int, width: int, height: int) -> None:
        if self._thread is not None:
            raise RuntimeError("this writer has begun already")
        check_settings(fps, sample_rate, self.encoding)
        pcm = _check_audio(audio)
        self._stream = stream = FrameStream(width, height)
        kwargs = {"fps": fps, "sample_rate": sample_rate, "encoding": self.encoding}

        def run() -> None:
            try:
                write_mp4(self.path, stream, pcm, **kwargs)
            except BaseException as err:  # handed to the render's thread at its next put or at finish
                self._error = err

        self._thread = threading.Thread(target=run, name="h3serve-mp4", daemon=True)
        self._thread.start()

    def put(self, frames: np.ndarray) -> None:
        if self._stream is None:
            raise RuntimeError("begin the writer before putting frames")
        while True:
            if self._error is not None:
                raise self._error
            try:
                self._stream.put(frames, timeout=0.1)
                return
            except queue.Full:
                continue

    def finish(self) -> Path:
        """Wait for the encode to end; its error, if it failed. Returns the path."""
        if self._stream is None or self._thread is None:
            raise RuntimeError("the writer never began: no frames were rendered")
        while self._thread.is_alive():  # an encoder that died leaves its chunks unread: do not wait on them
            try:
                self._stream.close(timeout=0.1)
                break
            except queue.Full:
                continue
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self.path

    def abort(self, error: BaseException) -> None:
        """Stop the encode (the partial file is removed, an existing file at the path kept)."""
        if self._stream is not None and self._thread is not None:
            self._stream.fail(error)
            self._thread.join()


@dataclass(frozen=True)
class _Failed:
    error: BaseException


# ---------------------------------------------------------------------------------------------------------
# Input validation: every message names what is wrong and what is allowed.
# ---------------------------------------------------------------------------------------------------------


def check_settings(fps: int, sample_rate: int, encoding: Encoding) -> None:
    """Validate the encoder settings alone (callers check them before rendering anything); an `Encoding` refused
    raises its `EncodingError` (a ValueError naming the field)."""
    if not is_int(fps) or not 1 <= fps <= 240:
        raise ValueError(f"fps must be an integer in 1..240, got {fps!r}")
    if not is_int(sample_rate) or sample_rate not in AAC_SAMPLE_RATES:
        raise ValueError(f"sample_rate must be one of the AAC rates {AAC_SAMPLE_RATES}, got {sample_rate!r}")
    if not isinstance(encoding, Encoding):
        raise EncodingError("encoding", f"encoding must be a media.encoding.Encoding, got {type(encoding).__name__}")
    encoding.check()


def _as_numpy(x: np.ndarray | torch.Tensor, name: str) -> np.ndarray:
    loaded = sys.modules.get("torch")  # a tensor exists only if torch is imported; this module does not import it
    if loaded is not None and isinstance(x, loaded.Tensor):
        return x.detach().cpu().numpy()
    if isinstance(x, np.ndarray):
        return x
    raise TypeError(f"{name} must be a numpy array or a torch tensor, got {type(x).__name__}")


def _check_frames(frames: np.ndarray | torch.Tensor) -> np.ndarray:
    video = _as_numpy(frames, "frames")
    if video.dtype != np.uint8:
        raise ValueError(f"frames must have dtype uint8 (RGB 0..255), got {video.dtype}")
    if video.ndim != 4 or video.shape[3] != 3:
        raise ValueError(f"frames must have shape (F, H, W, 3) (RGB, channels last), got {tuple(video.shape)}")
    f, h, w, _ = video.shape
    if f == 0:
        raise ValueError("frames is empty: need at least 1 frame, got shape (0, ...)")
    if h < 2 or w < 2 or h % 2 or w % 2:
        raise ValueError(f"frames height and width must be even and >= 2 for yuv420p, got H={h} W={w}")
    return video


def _check_audio(audio: np.ndarray | torch.Tensor) -> np.ndarray:
    pcm = _as_numpy(audio, "audio")
    if pcm.dtype != np.float32:
        raise ValueError(f"audio must have dtype float32, got {pcm.dtype}")
    if pcm.ndim != 2 or pcm.shape[0] != 2:
        raise ValueError(f"audio must have shape (2, N) (stereo: 2 channels, channels first), got {tuple(pcm.shape)}")
    if pcm.shape[1] == 0:
        raise ValueError("audio is empty: need at least 1 sample per channel, got shape (2, 0)")
    if not np.isfinite(pcm).all():
        raise ValueError("audio contains NaN or infinite samples; allowed: finite values in [-1, 1]")
    peak = float(np.abs(pcm).max())
    # Fail closed rather than clip silently: an overshoot is the caller's decision (clamp it upstream).
    if peak > 1.0:
        raise ValueError(f"audio samples must lie in [-1, 1], got a peak of {peak:.4f}; clamp before writing")
    return pcm


def _check_destination(dest: Path) -> None:
    folder = dest.parent
    if not folder.exists():
        raise FileNotFoundError(f"folder {folder} for the MP4 does not exist; create it first")
    if not folder.is_dir():
        raise NotADirectoryError(f"{folder} is not a folder; the MP4 path must be inside an existing folder")
    if dest.is_dir():
        raise IsADirectoryError(f"{dest} is a folder; give a file path such as {dest / 'out.mp4'}")
    # os.access is only advisory (root passes it); creating the temporary file is the real test.
    if not os.access(folder, os.W_OK | os.X_OK):
        raise PermissionError(f"cannot write an MP4 into folder {folder}: no write permission")


# ---------------------------------------------------------------------------------------------------------
# Decode and verification helpers
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StreamInfo:
    """Facts about an MP4's first video and first audio stream, as the container and codecs report them."""

    video_codec: str  # "h264"
    video_profile: str | None  # "Constrained Baseline" (ultrafast), "High" (superfast and slower)
    pixel_format: str | None  # "yuv420p"
    width: int
    height: int
    frame_count: int
    fps: float
    audio_codec: str  # "aac"
    audio_profile: str | None  # "LC"
    channels: int
    sample_rate: int
    video_duration_s: float
    audio_duration_s: float


Source = str | os.PathLike[str] | BinaryIO


def _open(source: Source) -> av.container.InputContainer:
    if isinstance(source, str | os.PathLike):
        return av.open(os.fspath(source))
    source.seek(0)
    return av.open(source, mode="r")


def probe_mp4(path: Source) -> StreamInfo:
    """Read the stream facts of `path` (a file path or a seekable binary file object) without decoding; the frame
    count comes from the MP4 index."""
    with _open(path) as container:
        video, audio = _streams(container, path)
        vctx, actx = video.codec_context, audio.codec_context
        return StreamInfo(
            video_codec=vctx.name,
            video_profile=vctx.profile,
            pixel_format=vctx.pix_fmt,
            width=vctx.width,
            height=vctx.height,
            frame_count=video.frames or _count_packets(path, video.index),
            fps=float(video.average_rate),  # av 19 returns an AVRational here: float() works for both
            audio_codec=actx.name,
            audio_profile=actx.profile,
            channels=actx.layout.nb_channels,
            sample_rate=actx.sample_rate,
            video_duration_s=_duration_s(video, path),
            audio_duration_s=_duration_s(audio, path),
        )


def decode_frames(path: Source) -> np.ndarray:
    """Decode every video frame of `path` to RGB. Returns (F, H, W, 3) uint8."""
    with _open(path) as container:
        _streams(container, path)
        frames = [
            frame.to_ndarray(
                format="rgb24", src_colorspace=_COLORSPACE, dst_colorspace=_COLORSPACE, src_color_range=_YUV_RANGE
            )
            for frame in container.decode(video=0)
        ]
    if not frames:
        raise ValueError(f"{path} has a video stream but no decodable frames")
    return np.stack(frames)  # (F, H, W, 3)


def decode_audio(path: Source) -> np.ndarray:
    """Decode the first audio stream of `path`. Returns (channels, N) float32.

    N is what the decoder yields: the encoder's priming is skipped via the MP4 edit list, but the padding of
    the last AAC frame is not, so N can exceed the written length by up to 1024 samples, and it differs by up
    to 1024 between av versions. Compare with `audio_psnr`, which aligns to the shorter length.
    """
    with _open(path) as container:
        _streams(container, path)
        chunks = [_frame_to_fltp(frame) for frame in container.decode(audio=0)]
    if not chunks:
        raise ValueError(f"{path} has an audio stream but no decodable samples")
    return np.concatenate(chunks, axis=1)  # (C, N)


def _frame_to_fltp(frame: av.AudioFrame) -> np.ndarray:
    # The native AAC decoder emits planar float already; anything else is converted, not reinterpreted.
    if frame.format.name != "fltp":
        frame = av.AudioResampler(format="fltp", layout=frame.layout, rate=frame.sample_rate).resample(frame)[0]
    return frame.to_ndarray().astype(np.float32, copy=False)  # (C, n)


def frame_hashes(frames: np.ndarray) -> list[str]:
    """sha256 hex digest of each frame's bytes; `frames` is (F, H, W, 3) uint8 as `decode_frames` returns."""
    if not isinstance(frames, np.ndarray) or frames.ndim != 4 or frames.dtype != np.uint8:
        got = f"{type(frames).__name__} {getattr(frames, 'dtype', '')} {getattr(frames, 'shape', '')}"
        raise ValueError(f"frames must be a uint8 numpy array of shape (F, H, W, 3), got {got}")
    return [hashlib.sha256(np.ascontiguousarray(frame).tobytes()).hexdigest() for frame in frames]


def audio_psnr(a: np.ndarray, b: np.ndarray, *, peak: float = 1.0) -> float:
    """PSNR in dB between two PCM arrays (channels, N), over the first min(N_a, N_b) samples.

    The peak is 1.0, full scale for float PCM in [-1, 1]. Returns inf when the aligned samples are identical.
    Lengths may differ because decoders pad the last AAC frame differently (see `decode_audio`).
    """
    if a.ndim != 2 or b.ndim != 2:
        raise ValueError(f"audio_psnr needs two (channels, N) arrays, got shapes {a.shape} and {b.shape}")
    if a.shape[0] != b.shape[0]:
        raise ValueError(f"audio_psnr needs equal channel counts, got {a.shape[0]} and {b.shape[0]}")
    n = min(a.shape[1], b.shape[1])
    if n == 0:
        raise ValueError(f"audio_psnr needs at least 1 sample in each array, got shapes {a.shape} and {b.shape}")
    # float64: the difference of two nearly equal float32 signals must not round to zero.
    diff = a[:, :n].astype(np.float64) - b[:, :n].astype(np.float64)
    mse = float(np.mean(diff * diff))
    if mse == 0.0:
        return math.inf
    return 10.0 * math.log10(peak * peak / mse)


def _streams(
    container: av.container.InputContainer, path: Source
) -> tuple[av.video.stream.VideoStream, av.audio.stream.AudioStream]:
    if not container.streams.video:
        raise ValueError(f"{path} has no video stream")
    if not container.streams.audio:
        raise ValueError(f"{path} has no audio stream")
    return container.streams.video[0], container.streams.audio[0]


def _duration_s(stream: av.stream.Stream, path: Source) -> float:
    if stream.duration is None or stream.time_base is None:
        raise ValueError(f"{path}: the {stream.type} stream does not declare a duration")
    return float(stream.duration * stream.time_base)


def _count_packets(path: Source, index: int) -> int:
    # Fallback for containers that do not index their frames; an MP4 always does.
    with _open(path) as container:
        return sum(1 for packet in container.demux(container.streams[index]) if packet.size)


def verify_mp4(
    source: Source,
    *,
    width: int,
    height: int,
    num_frames: int,
    fps: int = FPS,
    sample_rate: int = SAMPLE_RATE,
) -> StreamInfo:
    """Check that `source` is the output contract's MP4: H.264 yuv420p of the given size and frame count at `fps`,
    AAC-LC stereo at `sample_rate`, and that every frame decodes. Raises ValueError listing every mismatch."""
    try:
        info = probe_mp4(source)
        decoded = decode_frames(source).shape[0]
    except (av.FFmpegError, ValueError) as err:
        raise ValueError(f"not a readable MP4 with video and audio ({err})") from err
    expected = {
        "video_codec": "h264",
        "pixel_format": "yuv420p",
        "width": width,
        "height": height,
        "frame_count": num_frames,
        "audio_codec": "aac",
        "audio_profile": "LC",
        "channels": 2,
        "sample_rate": sample_rate,
    }
    wrong = [f"{k} {getattr(info, k)!r} (expected {v!r})" for k, v in expected.items() if getattr(info, k) != v]
    if abs(info.fps - fps) > 1e-6:
        wrong.append(f"fps {info.fps:g} (expected {fps})")
    if decoded != num_frames:
        wrong.append(f"{decoded} decodable frames (expected {num_frames})")
    if wrong:
        raise ValueError("the MP4 does not match the output contract: " + "; ".join(wrong))
    return info
