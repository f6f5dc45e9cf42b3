"""The context one render runs in: a cancel flag the stages check, and typed progress events they report.

The engine checks the flag at every stage boundary, after every denoise step and between video-decode windows, so
a cancelled render stops within one step (or one decode window) and raises `RenderCancelled`. Progress events say
which stage is running and how far it is (`done` of `total` units: denoise steps, decode windows, or 0/1 for the
stages that are one piece of work).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import numpy as np


class RenderCancelled(Exception):
    """The render was cancelled (by a client, a timeout or shutdown); nothing was produced."""


class NodeLost(RuntimeError):
    """A render split over several hosts failed because a node was lost (`parallel.nodes`): `node`, its first `rank`
    and `why` are data, and the text, naming them and nothing of this host, may be shown to the client."""

    def __init__(self, node: int, rank: int, why: str):
        super().__init__(f"node {node} (rank {rank}) lost: {why}")
        self.node, self.rank, self.why = node, rank, why


@dataclass(frozen=True)
class Progress:
    stage: str  # one of engine.STAGES
    done: int
    total: int

    @property
    def fraction(self) -> float:
        return self.done / self.total if self.total else 1.0


ProgressCallback = Callable[[Progress], None]


class FrameSink(Protocol):
    """Where a render's frames go as they are decoded (`media.mp4.Mp4Writer`): `begin` with the decoded audio and the
    frame size, then `put` with each run of final frames, in order, as packed yuv420p ((n, H * 3 // 2, W) uint8,
    `media.yuv.rgb_to_i420`: converted where they were decoded)."""

    def begin(self, audio: np.ndarray, sample_rate: int, fps: int, width: int, height: int) -> None: ...

    def put(self, frames: np.ndarray) -> None: ...


class RenderContext:
    """Passed through one render. `cancel()` may be called from any thread; the render stops at its next check."""

    def __init__(
        self,
        on_progress: ProgressCallback | None = None,
        on_preview: Callable[[Any], None] | None = None,
        frames_to: FrameSink | None = None,
    ):
        self._cancelled = threading.Event()
        self._reason = ""
        self.on_progress = on_progress
        self.on_preview = on_preview  # takes each `pipeline.preview.Preview` a request asked for (None: none are made)
        # Takes the video's frames as each decode window's are final (the result then holds none), the audio first.
        self.frames_to = frames_to

    def cancel(self, reason: str = "cancelled") -> None:
        if not self._cancelled.is_set():
            self._reason = reason
            self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    @property
    def reason(self) -> str:
        return self._reason

    def check(self) -> None:
        """Raise RenderCancelled if `cancel()` was called."""
        if self._cancelled.is_set():
            raise RenderCancelled(self._reason)

    def preview(self, preview: Any) -> None:
        """Hand on a preview (`pipeline.preview.Preview`), then check the flag."""
        if self.on_preview is not None:
            self.on_preview(preview)
        self.check()

    def report(self, stage: str, done: int, total: int) -> None:
        """Report progress, then check the flag (every report is also a cancellation point)."""
        if self.on_progress is not None:
            self.on_progress(Progress(stage, done, total))
        self.check()
