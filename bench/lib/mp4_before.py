"""The MP4 writer as it was before issue 55 (main at 53e8fc5, 2026-12-07): the row bench/encode.py holds the new one
to. Frames came as RGB and were converted one at a time by FFmpeg's swscale on the encoder's thread, x264 preset
medium with 4 frame threads encoded one stream, and the audio was encoded in step with the video."""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator
from fractions import Fraction
from pathlib import Path

import av
import numpy as np

PRESET, THREADS, CRF = "medium", 4, 18
_AVCOL_BT709, _AVCOL_RANGE_MPEG = 1, 1


def write_mp4_before(path: Path, chunks: Iterable[np.ndarray], audio: np.ndarray, width: int, height: int,
                     fps: int = 24, sample_rate: int = 32000):  # fmt: skip
    """Chunks of (n, H, W, 3) uint8 RGB (a whole array as one, or a `media.mp4.FrameStream` read as it comes) and
    (2, N) float32 -> an MP4 at `path`, as the writer of 53e8fc5 made it."""
    with open(path, "xb+") as fh:
        container = av.open(fh, mode="w", format="mp4", options={"movflags": "+faststart"})
        video = container.add_stream("libx264", rate=Fraction(fps, 1))
        video.width, video.height, video.pix_fmt = width, height, "yuv420p"
        video.options = {"crf": str(CRF), "preset": PRESET, "x264-params": "mbtree=0"}
        ctx = video.codec_context
        ctx.thread_count, ctx.thread_type = THREADS, "FRAME"
        ctx.color_primaries = ctx.color_trc = ctx.colorspace = _AVCOL_BT709
        ctx.color_range = _AVCOL_RANGE_MPEG
        sound = container.add_stream("aac", rate=sample_rate)
        sound.layout, sound.format, sound.bit_rate = "stereo", "fltp", 128_000
        timed = heapq.merge(
            ((Fraction(f.pts, fps), video, f) for f in _video(chunks, fps)),
            ((Fraction(f.pts, sample_rate), sound, f) for f in _audio(audio, sample_rate)),
            key=lambda item: item[0],
        )
        for _, stream, frame in timed:
            container.mux(stream.encode(frame))
        container.mux(video.encode(None))
        container.mux(sound.encode(None))
        container.close()


def _video(chunks: Iterable[np.ndarray], fps: int) -> Iterator[av.VideoFrame]:
    for i, rgb in enumerate(frame for chunk in chunks for frame in chunk):
        frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(rgb), format="rgb24")
        frame = frame.reformat(format="yuv420p", src_colorspace="ITU709", dst_colorspace="ITU709",
                               dst_color_range="MPEG")  # fmt: skip
        frame.pts, frame.time_base = i, Fraction(1, fps)
        yield frame


def _audio(pcm: np.ndarray, sample_rate: int) -> Iterator[av.AudioFrame]:
    for start in range(0, pcm.shape[1], 1024):
        frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(pcm[:, start : start + 1024]), format="fltp",
                                           layout="stereo")  # fmt: skip
        frame.sample_rate, frame.pts, frame.time_base = sample_rate, start, Fraction(1, sample_rate)
        yield frame
