"""The H.264 encode of a render's frames: the encoders that make its packets (their settings: `media.encoding`).

x264 (the default) encodes the video as *segments*: runs of `segment` frames, each a closed group of pictures
encoded from its first frame (an IDR) by an encoder of its own with `threads` frame threads, several segments at
once on the host's cores (`workers`), their packets joined in order into one stream. Every segment's encoder has the
same settings, so they share one sequence and picture parameter set, and the joined stream is what a player reads
as one (tests/test_h264.py decodes it frame for frame). The bytes depend on the encoder, preset, crf, threads and
segment length (and the av build), never on `workers` or the host's core count: one setting gives the same file on
a 2-core laptop and a 64-core server. `segment` 0 is one stream, one encoder (the file of the past releases'
shape, whose speed is x264's frame threading alone).

x264's repeatability: with its `non-deterministic` flag off (the default) an encode depends on its thread count
and not on scheduling; mbtree is off because av 19's x264 gave different bytes run to run with it on
(bench/results/README.md, 2026-11-30).

NVENC (`encoder="nvenc"`, opt-in, on GPUs that have the engine: RTX and workstation cards, the DGX Spark's GB10;
not the H100, H200 or GB200) encodes one stream on the GPU's video engine through FFmpeg's h264_nvenc; its bytes
are NVIDIA's driver's and are not promised repeatable. `check_available` refuses it where it cannot open.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Callable, Iterator
from fractions import Fraction

import av

from h3serve.media.encoding import Encoding, EncodingError

# AV_CODEC_FLAG_GLOBAL_HEADER: the parameter sets go in the stream's header (the MP4's avcC), not before each IDR.
# The MP4 muxer sets it on its own streams; a segment's encoder must match them.
_GLOBAL_HEADER = 1 << 22
_AVCOL_BT709 = 1  # AVCOL_PRI_BT709 == AVCOL_TRC_BT709 == AVCOL_SPC_BT709 == 1 in FFmpeg
_AVCOL_RANGE_MPEG = 1


def check_available(encoding: Encoding) -> None:
    """Refuse an encoder this host cannot open (NVENC without an NVENC engine or driver), before anything renders."""
    if encoding.encoder != "nvenc":
        return
    try:
        ctx = _context(encoding, 256, 256, 24, global_header=True)
        ctx.open()
    except (av.FFmpegError, OSError) as err:
        raise EncodingError(
            "encoder",
            f"encoder nvenc cannot open here ({err}): this GPU or its driver has no NVENC engine (the H100, H200 "
            "and GB200 have none; RTX cards and the DGX Spark's GB10 do); use encoder x264",
        ) from err


def configure(ctx: av.codec.context.CodecContext, encoding: Encoding) -> None:
    """The settings every encoder of a file shares (the container's stream and each segment's)."""
    if encoding.encoder == "x264":
        ctx.options = {"crf": str(encoding.crf), "preset": encoding.preset, "x264-params": "mbtree=0"}
        ctx.thread_count = encoding.threads
        # Frame threading, set explicitly: a different default in a later PyAV would change the bytes.
        ctx.thread_type = "FRAME"
    else:
        ctx.options = {"preset": encoding.preset, "rc": "vbr", "cq": str(encoding.crf), "b": "0"}
    ctx.color_primaries = _AVCOL_BT709
    ctx.color_trc = _AVCOL_BT709
    ctx.colorspace = _AVCOL_BT709
    ctx.color_range = _AVCOL_RANGE_MPEG


def codec_name(encoding: Encoding) -> str:
    return "libx264" if encoding.encoder == "x264" else "h264_nvenc"


def _context(encoding: Encoding, width: int, height: int, fps: int, *, global_header: bool):
    ctx = av.CodecContext.create(codec_name(encoding), "w")
    ctx.width, ctx.height, ctx.pix_fmt = width, height, "yuv420p"
    ctx.time_base = Fraction(1, fps)
    ctx.framerate = Fraction(fps, 1)
    if global_header:
        ctx.flags |= _GLOBAL_HEADER
    configure(ctx, encoding)
    return ctx


class Segments:
    """Frames in, packets out in decode order, the segments encoded on threads of their own.

    `put` each frame (an av.VideoFrame whose pts is its index in the video), then `close`; `packets()` yields what is
    ready so far (`wait=True`: everything, after `close`). At most `concurrency` segments encode at once: a `put`
    that would start one more waits for the oldest to finish (the producer is held back, not the host's memory
    filled). `header` is the container's parameter sets, which every segment's encoder must reproduce.
    """

    def __init__(self, encoding: Encoding, width: int, height: int, fps: int, header: bytes | None):
        self.encoding, self.width, self.height, self.fps, self.header = encoding, width, height, fps, header
        self.length = encoding.segment or None  # None: one segment for the whole video
        self._open: deque[_Segment] = deque()
        self._stop = threading.Event()
        self._frames = 0

    def put(self, frame: av.VideoFrame) -> None:
        if self._frames % (self.length or self._frames + 1) == 0:  # a segment's first frame (the video's, one stream)
            if self._open:
                self._open[-1].close()
            while True:  # at most `concurrency` encoding at once
                running = [segment for segment in self._open if segment.running]
                if len(running) < self.encoding.concurrency:
                    break
                running[0].join()  # its packets stay queued for `packets`
            self._open.append(_Segment(self, start=self._frames))
        self._open[-1].put(frame)
        self._frames += 1

    def close(self) -> None:
        if self._open:
            self._open[-1].close()

    def packets(self, wait: bool = False) -> Iterator[av.Packet]:
        while self._open:
            head = self._open[0]
            yield from head.take(wait)
            if not head.done:
                return
            self._open.popleft()

    def stop(self) -> None:
        """Stop every segment's encoder at its next frame (an error or a cancel); their packets are dropped."""
        self._stop.set()
        for segment in self._open:
            segment.abandon()
        for segment in self._open:
            segment.join()
        self._open.clear()


_END = object()
# Frames waiting for a segment's encoder: a `put` beyond them waits, so an encoder behind the decode holds the render's
# frames back (`media.mp4.FrameStream`'s depth) instead of the host's memory filling with them.
QUEUED_FRAMES = 16


class _Segment:
    """One segment's encoder on a thread of its own: frames through `put`, packets (their times shifted to the
    segment's place in the video) queued for `take`."""

    def __init__(self, owner: Segments, start: int):
        self.owner, self.start = owner, start
        self._in: queue.Queue = queue.Queue(maxsize=QUEUED_FRAMES)
        self._out: queue.Queue = queue.Queue()
        self.done = False
        self._thread = threading.Thread(target=self._run, name=f"h3serve-h264-{start}", daemon=True)
        self._thread.start()

    def put(self, frame: av.VideoFrame) -> None:
        self._queue(frame)

    def close(self) -> None:
        self._queue(_END)

    def _queue(self, item: object) -> None:
        """Wait for room, unless the encoder has ended: then its error is raised here (it cannot take more)."""
        while True:
            try:
                self._in.put(item, timeout=0.1)
                return
            except queue.Full:
                if not self._thread.is_alive():
                    for _ in self.take(wait=True):  # raises the error it ended with
                        pass
                    raise RuntimeError("a segment's encoder ended before its frames did") from None

    def abandon(self) -> None:
        """Stop the encoder at its next frame (the owner's stop flag is set): its unread frames are dropped."""
        while True:
            try:
                self._in.get_nowait()
            except queue.Empty:
                break
        self._in.put_nowait(_END)  # only the writer's thread puts: after the drain there is room

    def join(self) -> None:
        self._thread.join()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def take(self, wait: bool) -> Iterator[av.Packet]:
        while not self.done:
            try:
                item = self._out.get(block=wait)
            except queue.Empty:
                return
            if item is _END:
                self.done = True
            elif isinstance(item, BaseException):
                self.done = True
                raise item
            else:
                yield item

    def _run(self) -> None:
        owner = self.owner
        try:
            ctx = _context(owner.encoding, owner.width, owner.height, owner.fps, global_header=True)
            ctx.open()
            if owner.header is not None and bytes(ctx.extradata or b"") != owner.header:
                raise RuntimeError("a segment's encoder made other parameter sets than the file's: not joined")
            while True:
                frame = self._in.get()
                if frame is _END or owner._stop.is_set():
                    break
                frame.pts -= self.start
                self._emit(ctx.encode(frame))
            if not owner._stop.is_set():
                self._emit(ctx.encode(None))
            self._out.put(_END)
        except BaseException as err:  # handed to the writer at its next `packets`
            self._out.put(err)

    def _emit(self, packets: list[av.Packet]) -> None:
        for packet in packets:
            packet.pts += self.start
            packet.dts += self.start
            packet.time_base = Fraction(1, self.owner.fps)
            self._out.put(packet)


def encode_frames(frames: Iterator[av.VideoFrame], segments: Segments, mux: Callable[[av.Packet], None]) -> None:
    """Feed every frame to `segments`, muxing packets as they are ready, then the rest once the last is in."""
    try:
        for frame in frames:
            segments.put(frame)
            for packet in segments.packets():
                mux(packet)
        segments.close()
        for packet in segments.packets(wait=True):
            mux(packet)
    except BaseException:
        segments.stop()
        raise
