"""The scheduler: a bounded FIFO of renders, the GPU worker that runs them one at a time (after the startup warmup),
and the encoder thread that turns each render's frames into its MP4 as they are decoded, and while the worker starts
the next:

    submit -> queue (max_queue; full: QueueFull, a 429) -> worker: engine.render, its decode's frames
           -> hand-off (ENCODE_BACKLOG) -> encoder: MP4 to a file (async job) or to bytes (sync render) -> done

Sync and async renders share the queue and the worker, so one render uses the GPU at a time. A render's frames go to
the encoder as each decode window's are final (`RenderContext.frames_to`): the job is handed off when its first
frames are ready, so its encode overlaps its own decode and then the next render. The GPU never waits on the encoder:
frames it has not reached wait in host memory, never more than the whole video (what a rendered job waiting for the
encoder held before). An engine that returns its frames whole is handed off when it returns, as before.

Cancellation is real wherever a job is. Waiting in the queue or the hand-off, it is removed at once. Rendering, it
stops within one denoise step or decode window (`RenderContext`). Encoding, it stops before the next frame goes to
the encoder (`write_mp4`'s `check`), and the half-written file is removed. `cancel` returns once the job has stopped
(or after its `wait`, saying whether it had). A shutdown (`stop`) ends every job not yet finished the same way:
failed, code `interrupted` (as a crash leaves them once the store reopens).

An MP4 that cannot be written (a full disk, a file-size limit, a folder made read-only or replaced by a file) fails
its job with code `write_failed` and the OS's reason; the write is atomic, so no partial MP4 is left and the record
names no file. Readiness covers the folders the service writes (`startup.service_folders`): a server that cannot
write them is not ready.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import enum
import io
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from h3serve.media.mp4 import FrameStream, encode_mp4, write_mp4
from h3serve.pipeline.context import NodeLost, Progress, RenderCancelled, RenderContext
from h3serve.pipeline.engine import STAGES, RenderEngine, RenderResult
from h3serve.pipeline.request import RenderRequest
from h3serve.service.events import PREVIEWS, Events
from h3serve.service.metrics import Metrics
from h3serve.service.schemas import JobError, JobStatus, VideoJob, step_cache_mode
from h3serve.service.store import JobStore
from h3serve.service.warmup import WarmupResult, run_warmup
from h3serve.startup import describe_folders, folder_problems

log = logging.getLogger(__name__)

# Jobs waiting for the encoder. Each may hold up to a whole video in host memory (362 frames of 1344x768 are 1.1 GB),
# so the worker waits when one is already waiting: at most the one encoding, one waiting and the worker's own.
ENCODE_BACKLOG = 1
RECOVERY_POLL_S = 0.5  # how often a queued job looks whether the GPU workers are back


def progress_percent(p: Progress, finished: set[str]) -> int:
    """A job's progress from a render's event: the shares of the stages it has `finished`, and its own share done.
    (Not `STAGES`' order alone: a render streaming its frames decodes the audio before the video.)"""
    return int(sum(STAGES[s] for s in finished if s != p.stage) + STAGES.get(p.stage, 0) * p.fraction)


def _live(stage: str, done: int, total: int, elapsed: float | None, ahead: int | None = None) -> dict[str, Any]:
    return {"stage": stage, "done": done, "total": total, "elapsed_s": elapsed, "ahead": ahead}


class QueueFull(Exception):
    pass


class WriteFailed(Exception):
    """An MP4 that could not be written; the message is for the client (the OS's reason, no path)."""


# Words for the refusals `write_mp4` raises itself (they carry a message with the path, and no strerror).
_OS_WORDS = {
    FileNotFoundError: "the folder does not exist",
    NotADirectoryError: "the folder is not a folder",
    PermissionError: "permission denied",
    IsADirectoryError: "a folder is in the way",
}


def write_failure(err: OSError, request_id: str) -> str:
    why = err.strerror or _OS_WORDS.get(type(err), "an OS error")
    return (
        f"the MP4 could not be written ({why}): the output folder is full or not writable; no file was kept. See "
        f"/health and the server log, request id {request_id}"
    )


@dataclass(frozen=True)
class Standing:
    """Where the server stands now (`Scheduler.standing`): `ready` to render, `problem` (why not, beyond the warmup:
    the engine's, or the unwritable folders without their paths) and `unwritable` ({folder name: why})."""

    ready: bool
    problem: str | None
    unwritable: dict[str, str]


@dataclass(eq=False)  # identity: two jobs are never equal, and their frames are never compared
class Work:
    """One render on its way through the scheduler. `persist`: an async job (record + MP4 file); else a sync render
    whose MP4 bytes are the future's result."""

    id: str
    request: RenderRequest
    persist: bool
    ctx: RenderContext = field(default_factory=RenderContext)
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    result: RenderResult | None = None  # set when the render has finished
    started: float | None = None  # time.monotonic() when the worker took it
    progress: Progress | None = None  # the render's latest event (`live`)
    stream: FrameStream | None = None  # its frames as they are decoded (`_Frames`), for the encoder
    sink: _Frames | None = None  # its render's `frames_to`
    media: tuple[Any, int, int] | None = None  # (audio, sample rate, fps) of a streamed render
    handed: bool = False  # in the encoder's hands (queued or encoding): the encoder finishes it


class _RenderFailed(Exception):
    """A streamed render's error, handed to the encoder reading its frames (which finishes the job)."""

    def __init__(self, error: Exception):
        super().__init__(str(error))
        self.error = error


class _Frames:
    """A job's frames on their way to the encoder while its render decodes them (`RenderContext.frames_to`): at
    `begin` (the audio decoded, the first frames next) the job is handed off, waiting while the backlog is full as a
    rendered job does (`waited`: those seconds, which are not the render's); each run of frames then goes into an
    unbounded `FrameStream` that the encoder reads as it comes, so the GPU never waits on the encoder. Frames of a job
    already finished (cancelled, failed) are dropped."""

    def __init__(self, scheduler: Scheduler, work: Work):
        self.scheduler, self.work = scheduler, work
        self.stream: FrameStream | None = None
        self.waited = 0.0

    def begin(self, audio: Any, sample_rate: int, fps: int, width: int, height: int) -> None:
        work = self.work
        self.stream = work.stream = FrameStream(width, height, depth=0)
        work.media = (audio, sample_rate, fps)
        start = time.perf_counter()
        handed = self.scheduler._hand_off(work)
        self.waited = time.perf_counter() - start
        if not handed:
            raise RenderCancelled(work.ctx.reason or "cancelled")

    def put(self, frames: Any) -> None:
        assert self.stream is not None, "put before begin"
        if not self.work.future.done():
            self.stream.put(frames)

    def release(self) -> None:
        """The job is finished: its unread frames go, and the context lets go of this sink."""
        if self.stream is not None:
            self.stream.drop()
        if self.work.ctx.frames_to is self:
            self.work.ctx.frames_to = None


class Readiness(enum.StrEnum):
    WARMING = "warming"
    READY = "ready"
    FAILED = "failed"


class Scheduler:
    """The queue, the GPU worker and the encoder thread. All their state is guarded by one condition variable."""

    def __init__(
        self,
        engine: RenderEngine,
        store: JobStore,
        *,
        max_queue: int,
        warmup: bool,
        encoder_threads: int,
        metrics: Metrics,
        folders: dict[str, Path] | None = None,
    ):
        self.engine = engine
        self.folders = folders or {}  # name -> folder the service writes (startup.service_folders), checked for ready
        self._folder_problems: dict[str, str] = {}  # the last check's, to log a change once
        self.store = store
        self.max_queue = max_queue
        self.encoder_threads = encoder_threads
        self.metrics = metrics
        self._warmup_enabled = warmup
        self.readiness = Readiness.WARMING
        self.warmup_result: WarmupResult | None = None
        self._cond = threading.Condition()
        self._queue: collections.deque[Work] = collections.deque()  # waiting for the GPU
        self._rendering: Work | None = None  # on the worker: rendering, or rendered and waiting for the hand-off
        self._encodes: collections.deque[Work] = collections.deque()  # rendered, waiting for the encoder
        self._encoding: Work | None = None
        self._stopping = False
        # Each async job's events, and its latest preview on disk beside videos/ (`service.events`).
        self.events = Events(store.output_dir / PREVIEWS)
        self._worker = threading.Thread(target=self._work, name="h3serve-worker", daemon=True)
        self._encoder = threading.Thread(target=self._encode_loop, name="h3serve-encoder", daemon=True)

    # ---- control --------------------------------------------------------------------------------------------
    def start(self) -> None:
        self._worker.start()
        self._encoder.start()

    def stop(self, timeout: float = 30.0) -> None:
        """End every job not finished (their records say the server stopped) and join the threads."""
        with self._cond:
            self._stopping = True
            queued, rendered = list(self._queue), list(self._encodes)
            self._queue.clear()
            self._encodes.clear()
            for work in (self._rendering, self._encoding):
                if work is not None:
                    work.ctx.cancel("the server stopped during this job")
            self._cond.notify_all()
        for work in queued:
            self._finish_cancelled(work, "the server stopped before this job ran")
        for work in rendered:
            self._finish_cancelled(work, "the server stopped before this job's MP4 was written", ran=True)
        deadline = time.monotonic() + timeout
        for thread in (self._worker, self._encoder):
            if thread.is_alive():
                thread.join(max(0.0, deadline - time.monotonic()))

    @property
    def ready(self) -> bool:
        """Warmed up, the engine can render (its GPU workers are all up: `RenderEngine.problem`) and every folder the
        service writes can be written now."""
        return self.standing().ready

    def standing(self) -> Standing:
        """Readiness, why the server cannot render now beyond the warmup (the engine's problem or an unwritable
        folder), and the unwritable folders, from one look at the folders."""
        unwritable = self.folder_problems()
        problem = self.engine.problem or (describe_folders(unwritable) if unwritable else None)
        return Standing(self.readiness is Readiness.READY and problem is None, problem, unwritable)

    def folder_problems(self) -> dict[str, str]:
        """{folder name: why} for each folder the service cannot write now (a file is created and removed in each);
        a change is logged once, with the paths."""
        problems = folder_problems(self.folders)
        with self._cond:
            changed, self._folder_problems = problems != self._folder_problems, problems
        if changed and problems:
            log.error("not ready: %s", describe_folders(problems, self.folders))
        elif changed:
            log.info("every folder the service writes is writable again")
        return problems

    @property
    def depth(self) -> int:
        """Renders waiting for the GPU."""
        with self._cond:
            return len(self._queue)

    def live(self) -> dict[str, dict[str, Any]]:
        """Where each unfinished job is now, by id, for its record (`live`; not stored, so a job the scheduler no
        longer holds has none): `queued` with the renders `ahead` of it, a render stage (engine.STAGES) with its
        units `done` of `total` (denoise steps, decode windows), or `encode` once rendered; `elapsed_s` since the
        worker took it."""
        now = time.monotonic()
        with self._cond:
            busy = int(self._rendering is not None)  # the render on the GPU is ahead of every queued one
            out = {w.id: _live("queued", 0, 0, None, ahead) for ahead, w in enumerate(self._queue, start=busy)}
            for work in (*self._encodes, self._encoding, self._rendering):
                if work is None or work.future.done():  # finished: its thread lets go of it next
                    continue
                elapsed = None if work.started is None else round(now - work.started, 3)
                p = work.progress
                if work is not self._rendering or work.result is not None:  # rendered: its MP4 is being written
                    out[work.id] = _live("encode", 0, 1, elapsed)
                elif p is None:
                    out[work.id] = _live("starting", 0, 0, elapsed)
                else:
                    out[work.id] = _live(p.stage, p.done, p.total, elapsed)
            return out

    def submit(self, work: Work, record: VideoJob | None = None) -> None:
        """Queue a render (and insert its record first, so it is never lost); QueueFull when the queue is full."""
        with self._cond:
            if len(self._queue) >= self.max_queue:
                raise QueueFull
            if record is not None:
                self.store.insert(record)
            self._queue.append(work)
            if work.persist:
                self.events.publish(
                    work.id, "queued", {"ahead": len(self._queue) - 1 + int(self._rendering is not None)}
                )
            self._cond.notify_all()

    def cancel(self, job_id: str, reason: str, wait: float = 30.0) -> bool:
        """Cancel a job by id wherever it is; True if it was found. Returns once it has stopped (or after `wait`)."""
        with self._cond:
            waiting = next((w for w in (*self._queue, *self._encodes) if w.id == job_id), None)
            if waiting is not None:
                (self._queue if waiting in self._queue else self._encodes).remove(waiting)
            active = next((w for w in (self._rendering, self._encoding) if w is not None and w.id == job_id), None)
            if active is not None:
                active.ctx.cancel(reason)
            # A worker waiting to hand off wakes: to drop this job, or because the backlog has room now.
            self._cond.notify_all()
        if waiting is not None:  # (a job handed off while its render still decodes is active too: it stops there)
            self._finish_cancelled(waiting, reason, ran=waiting.started is not None)
            return True
        if active is None:
            return False
        with contextlib.suppress(concurrent.futures.TimeoutError, concurrent.futures.CancelledError):
            active.future.exception(timeout=wait)
        return True

    # ---- the GPU worker -------------------------------------------------------------------------------------
    def _work(self) -> None:
        self._warm()
        while (work := self._next_render()) is not None:
            with self._guard(work):
                if self._render(work) and not self._hand_off(work):
                    self._finish_cancelled(work, work.ctx.reason, ran=True)
            with self._cond:
                self._rendering = None

    def _warm(self) -> None:
        if not self._warmup_enabled:
            self.readiness = Readiness.READY
            return
        log.info("warmup: rendering the production shape")
        result = self.warmup_result = run_warmup(self.engine, threads=self.encoder_threads)
        if result.passed:
            log.info("warmup passed in %.2f s (%s); ready", result.seconds, result.request)
            self.readiness = Readiness.READY
        else:
            log.error("warmup failed (%s): %s; the server stays not ready", result.request, result.error)
            self.readiness = Readiness.FAILED

    def _next_render(self) -> Work | None:
        with self._cond:
            # While the GPU workers restart (a node awaited), a queued job waits for them rather than failing.
            while (not self._queue or self.engine.recovering) and not self._stopping:
                self._cond.wait(RECOVERY_POLL_S if self._queue else None)
            if self._stopping:
                return None
            self._rendering = self._queue.popleft()
            self._rendering.started = time.monotonic()
            return self._rendering

    def _render(self, work: Work) -> bool:
        """Render one job; True when its frames came back whole and it is to be handed off (otherwise it has been
        finished here, or its frames streamed to the encoder, which finishes it)."""
        last, stage = -1, None
        finished: set[str] = set()  # the stages this render has left (their order: `progress_percent`)

        def on_progress(p: Progress) -> None:
            nonlocal last, stage
            if work.future.done():  # finished while its render winds down (cancelled while it streamed its frames)
                return
            work.progress = p
            changed = p.stage != stage
            if changed and stage is not None:
                finished.add(stage)
            stage = p.stage
            percent = progress_percent(p, finished)
            if work.persist and percent != last:
                last = percent
                self.store.update(work.id, progress=percent)
            if work.persist:
                if changed:
                    self.events.publish(work.id, "stage", {"stage": p.stage, "progress": percent})
                if p.done:
                    data = {"stage": p.stage, "done": p.done, "total": p.total, "progress": percent}
                    self.events.publish(work.id, "progress", data)

        def on_preview(preview) -> None:
            if work.future.done():
                return
            if not self.events.set_preview(work.id, preview.png):  # logged: no event for a preview nobody can fetch
                return
            data = {"url": f"/v1/videos/{work.id}/preview?forward={preview.forward}", "forward": preview.forward,
                    "forwards": preview.forwards, "width": preview.width, "height": preview.height,
                    "seconds": round(preview.seconds, 4)}  # fmt: skip
            self.events.publish(work.id, "preview", data)

        work.ctx.on_progress = on_progress
        if work.persist and work.request.preview_every:
            work.ctx.on_preview = on_preview
        if work.persist:
            self.store.update(work.id, status=JobStatus.IN_PROGRESS)
        frames = work.sink = work.ctx.frames_to = _Frames(self, work)
        try:
            result = self.engine.render(work.request, work.ctx)
        except RenderCancelled as err:
            if not self._take_back(work):  # the encoder reading its frames stops and finishes it
                frames.stream.fail(err)
            elif not work.future.done():
                self._finish_cancelled(work, str(err) or "cancelled", ran=True)
            return False
        except Exception as err:
            if not self._take_back(work):
                log.error("job %s: the render failed while its frames streamed to the encoder", work.id, exc_info=err)
                frames.stream.fail(_RenderFailed(err))
            elif not work.future.done():
                self._finish_failed(work, err, "render")
            return False
        if frames.waited and "total" in result.timings:  # waiting for the encoder's backlog is not rendering
            result.timings["total"] -= frames.waited
        if work.handed:
            if not work.future.done():
                work.result = result
            frames.stream.close()  # after the result: the encoder finishes the job once it has read the end
            return False
        work.result = result
        return True

    def _take_back(self, work: Work) -> bool:
        """After its render failed: True when the worker is to finish the job (never handed off, or handed and still
        waiting for the encoder: taken back from it); False when the encoder is reading its frames (it finishes it)."""
        with self._cond:
            if not work.handed:
                return True
            if work in self._encodes:
                self._encodes.remove(work)
                self._cond.notify_all()  # room in the backlog
                return True
            return work is not self._encoding

    def _hand_off(self, work: Work) -> bool:
        """Give a job to the encoder (rendered, or its frames about to stream), waiting while the backlog is full (a
        cancel wakes the wait); False when it was cancelled first (and not handed)."""
        with self._cond:
            while len(self._encodes) >= ENCODE_BACKLOG and not work.ctx.cancelled:
                self._cond.wait(RECOVERY_POLL_S)  # a sync render's cancel (its route's) notifies no one: polled
            if work.ctx.cancelled:
                return False
            self._encodes.append(work)
            work.handed = True
            self._cond.notify_all()
            return True

    # ---- the encoder ----------------------------------------------------------------------------------------
    def _encode_loop(self) -> None:
        while (work := self._next_encode()) is not None:
            with self._guard(work):
                self._encode(work)
            with self._cond:
                self._encoding = None

    def _next_encode(self) -> Work | None:
        with self._cond:
            while not self._encodes and not self._stopping:
                self._cond.wait()
            if self._stopping:
                return None  # `stop` has finished what was left waiting
            self._encoding = self._encodes.popleft()
            self._cond.notify_all()  # room in the backlog: a worker waiting to hand off goes on
            return self._encoding

    def _encode(self, work: Work) -> None:
        """Encode a job's MP4 (its frames as its render decodes them, or whole) and finish the job."""
        if work.ctx.cancelled:
            self._finish_cancelled(work, work.ctx.reason, ran=True)
            return
        try:
            payload = self._write(work)
        except RenderCancelled:  # cancelled between frames: write_mp4 has removed the partial file
            self._finish_cancelled(work, work.ctx.reason, ran=True)
            return
        except _RenderFailed as err:  # the render streaming the frames failed (logged there): no file was kept
            self._finish_failed(work, err.error, "render", logged=True)
            return
        except OSError as err:  # the encode's own errors are ValueErrors; an OSError is the disk's or the folder's
            work.ctx.cancel("the MP4 could not be written")  # a render still decoding stops
            self._finish_unwritten(work, err)
            return
        except Exception as err:
            work.ctx.cancel("the MP4 encode failed")
            self._finish_failed(work, err, "MP4 encode")
            return
        if work.ctx.cancelled:  # cancelled while encoding: the encode has finished, its file goes
            if work.persist:
                (self.store.videos / payload).unlink(missing_ok=True)
            self._finish_cancelled(work, work.ctx.reason, ran=True)
            return
        self._finish_completed(work, payload)

    def _write(self, work: Work) -> str | bytes:
        """The MP4 of a job: an async job's file (its name returned) or a sync render's bytes."""
        if work.stream is not None:  # read as the render decodes them; its errors come out of the stream
            frames, (audio, sample_rate, fps) = work.stream, work.media
        else:
            result = work.result
            frames, audio, sample_rate, fps = result.frames, result.audio, result.sample_rate, result.fps
        settings = {
            "fps": fps,
            "sample_rate": sample_rate,
            "threads": self.encoder_threads,
            "check": work.ctx.check,  # a cancel stops the encode before the next frame
        }
        if work.persist:
            path = self.store.videos / f"{work.id}.mp4"  # the server's name: nothing a client sent
            write_mp4(path, frames, audio, **settings)  # atomic: a failed write leaves no file
            return path.name
        buffer = io.BytesIO()
        encode_mp4(buffer, frames, audio, **settings)
        return buffer.getvalue()

    # ---- outcomes -------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _guard(self, work: Work) -> Iterator[None]:
        """A failure outside the render and the encode (a store write that raised): logged, the job's waiter
        released, and the thread goes on with the next job."""
        try:
            yield
        except Exception as err:
            log.exception("job %s: the scheduler could not finish it", work.id)
            if not work.future.done():
                work.future.set_exception(err)

    def _finish_completed(self, work: Work, payload: str | bytes) -> None:
        result = work.result
        self.metrics.render_finished("completed", result)
        if work.persist:
            self.store.update(
                work.id,
                status=JobStatus.COMPLETED,
                progress=100,
                completed_at=int(time.time()),
                file_name=payload,
                inference_time_s=round(result.timings["total"], 4),
                stage_durations={k: round(v, 4) for k, v in result.timings.items() if k != "total"},
                peak_memory_mb=round(result.peak_memory_mb, 1),
                num_gpus=max(1, len(result.split)),
                step_cache=step_cache_mode(result.step_cache, work.request.quality),
                cached_steps=list(result.step_cache.cached) if result.step_cache is not None else [],
            )
            self._release(work)  # the frames are on disk: a finished job holds no video
            self.events.publish(work.id, "completed", {"status": "completed", "url": f"/v1/videos/{work.id}/content"})
        else:
            self._release(work, keep_result=True)
        work.future.set_result(payload)

    def _release(self, work: Work, keep_result: bool = False) -> None:
        """A finished job lets go of its video: the rendered frames (with the result, unless `keep_result`: a sync
        render's timings for its response), and the streamed ones nobody will read."""
        if not keep_result:
            work.result = None
        work.stream = work.media = None
        if work.sink is not None:
            work.sink.release()
            work.sink = None

    def _finish_failed(self, work: Work, err: Exception, stage: str, logged: bool = False) -> None:
        """A render or encode that raised: the traceback goes to the log (unless `logged` already), the record and
        the client get a message that names the request id to look for there (an exception's text can hold paths and
        internals)."""
        if not logged:
            log.error("job %s: the %s failed", work.id, stage, exc_info=err)
        self.metrics.render_finished("failed", None)
        if work.persist:
            message = f"the {stage} failed (internal error); see the server log, request id {work.id}"
            code = "render_failed"
            if isinstance(err, NodeLost):  # names a node and a rank, nothing of this host: the client may know
                message, code = f"the {stage} failed: {err}; it resumes when the node joins again", "node_lost"
            error = JobError(code=code, message=message)
            self.store.update(work.id, status=JobStatus.FAILED, completed_at=int(time.time()), error=error)
            self.events.publish(work.id, "failed", {"status": "failed", "error": error.model_dump()})
        self._release(work)
        work.future.set_exception(err)

    def _finish_unwritten(self, work: Work, err: OSError) -> None:
        """An MP4 the disk or the folder refused: failed with code write_failed and the OS's reason (no path)."""
        log.error("job %s: the MP4 could not be written: %s", work.id, err)
        self.metrics.render_finished("failed", None)
        message = write_failure(err, work.id)
        if work.persist:
            error = JobError(code="write_failed", message=message)
            self.store.update(work.id, status=JobStatus.FAILED, completed_at=int(time.time()), error=error)
            self.events.publish(work.id, "failed", {"status": "failed", "error": error.model_dump()})
        self._release(work)
        work.future.set_exception(WriteFailed(message))

    def _finish_cancelled(self, work: Work, reason: str, ran: bool = False) -> None:
        """A job stopped before it finished: cancelled by its client (or a timeout), or failed by a shutdown.
        `ran`: it had reached the GPU (counted as a cancelled render)."""
        if ran:
            self.metrics.render_finished("cancelled", None)
        stopped = self._stopping
        if work.persist and self.store.get(work.id) is not None:
            status, code = (JobStatus.FAILED, "interrupted") if stopped else (JobStatus.CANCELLED, "cancelled")
            error = JobError(code=code, message=reason or "cancelled")
            self.store.update(work.id, status=status, completed_at=int(time.time()), error=error)
            self.events.publish(work.id, str(status), {"status": str(status), "error": error.model_dump()})
        self._release(work)  # a video nobody will encode: its memory goes now
        if not work.future.done():
            work.future.set_exception(RenderCancelled(reason))
