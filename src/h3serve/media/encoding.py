"""The video encode's settings (`Encoding`), checked without importing av: the settings load (`--help`, `check`,
`ready`) reads them. What each does and which are part of the bytes: `media.h264`."""

from __future__ import annotations

import os
from dataclasses import dataclass

from h3serve.config import ENCODER_PRESET, ENCODER_SEGMENT_FRAMES, ENCODER_THREADS, MAX_ENCODER_THREADS, X264_PRESETS

ENCODERS = ("x264", "nvenc")
NVENC_PRESETS = ("p1", "p2", "p3", "p4", "p5", "p6", "p7")  # fastest .. best, NVIDIA's names
NVENC_PRESET = "p4"
# crf 18 is near visually lossless for x264 and keeps a 5 s 768x448 clip around a few MB.
DEFAULT_CRF = 18
MAX_SEGMENT_FRAMES = 100_000


@dataclass(frozen=True)
class Encoding:
    """The video encode's settings. Every field but `workers` is part of the bytes (see the module docstring)."""

    encoder: str = "x264"
    preset: str = ENCODER_PRESET
    crf: int = DEFAULT_CRF
    threads: int = ENCODER_THREADS  # x264 frame threads of each segment's encoder
    segment: int = ENCODER_SEGMENT_FRAMES  # frames per segment; 0: one stream
    workers: int = 0  # segments encoded at once; 0: the cores this process may use // threads (at least 1)

    @classmethod
    def of(
        cls,
        encoder: str = "x264",
        preset: str | None = None,
        *,
        threads: int = ENCODER_THREADS,
        segment: int | None = None,
        workers: int = 0,
    ) -> Encoding:
        """An encoding whose unset preset and segment length are the encoder's defaults (x264: `ENCODER_PRESET` in
        segments of `ENCODER_SEGMENT_FRAMES`; nvenc: `NVENC_PRESET`, one stream)."""
        x264 = encoder == "x264"
        preset = preset or (ENCODER_PRESET if x264 else NVENC_PRESET)
        segment = (ENCODER_SEGMENT_FRAMES if x264 else 0) if segment is None else segment
        return cls(encoder, preset, threads=threads, segment=segment, workers=workers)

    def check(self) -> None:
        """Refuse a setting outside what the encoder takes, naming the field and what is allowed."""
        if self.encoder not in ENCODERS:
            raise EncodingError("encoder", f"encoder must be one of {ENCODERS}, got {self.encoder!r}")
        presets = X264_PRESETS if self.encoder == "x264" else NVENC_PRESETS
        if self.preset not in presets:
            raise EncodingError("preset", f"the {self.encoder} preset must be one of {presets}, got {self.preset!r}")
        # crf 0 makes x264 lossless, which needs the High 4:4:4 Predictive profile most players reject.
        if not is_int(self.crf) or not 1 <= self.crf <= 51:
            allowed = "crf must be an integer in 1..51 (0, lossless, is not allowed)"
            raise EncodingError("crf", f"{allowed}, got {self.crf!r}")
        if not is_int(self.threads) or not 1 <= self.threads <= MAX_ENCODER_THREADS:
            raise EncodingError(
                "threads",
                f"threads must be an integer in 1..{MAX_ENCODER_THREADS} (pinned for repeatable output; 0/auto is "
                f"not allowed), got {self.threads!r}",
            )
        if not is_int(self.segment) or not (self.segment == 0 or 8 <= self.segment <= MAX_SEGMENT_FRAMES):
            raise EncodingError(
                "segment",
                f"segment must be 0 (one stream) or an integer in 8..{MAX_SEGMENT_FRAMES} frames, got {self.segment!r}",
            )
        if self.encoder == "nvenc" and self.segment:
            raise EncodingError("segment", "nvenc encodes one stream: set segment to 0 with encoder nvenc")
        if not is_int(self.workers) or not 0 <= self.workers <= 256:
            allowed = "workers must be an integer in 0..256 (0: from the cores)"
            raise EncodingError("workers", f"{allowed}, got {self.workers!r}")

    @property
    def concurrency(self) -> int:
        """Segments encoded at once."""
        if self.workers:
            return self.workers
        return max(1, usable_cores() // self.threads)

    def describe(self) -> str:
        shape = f"segments of {self.segment} frames" if self.segment else "one stream"
        return f"{self.encoder} {self.preset} crf {self.crf}, {self.threads} threads, {shape}"


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, which a container's cpuset sets), else the host's."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


class EncodingError(ValueError):
    """An encoder setting refused: `field` names it (Encoding's field name)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
