"""The scheduler: a bounded FIFO of renders, the GPU worker that runs them one at a time (after the startup warmup),
and the encoder thread that turns each render's frames into its MP4 as they are decoded, and while the worker starts
the next:

    submit -> queue (max_queue; full: QueueFull, a 429) -> worker: engine.render, its decode's frames
           -> hand-off (ENCODE_BACKLOG) -> encoder: MP4 to a file (async job) or to bytes (sync render) -> done

A job's life is a state machine (`jobs.JobState`: queued, rendering, handed off, encoding, then completed, failed or
cancelled). `_transition` is its only move, checked against the table of moves and against who holds the job (the
worker a rendering one, the encoder an encoding one, whoever comes first a waiting one), all under one lock, and the
only writer of its record, its events and its result; its progress goes through `_progressed`, which publishes
nothing once the job has ended.

In a fleet (several servers on one PostgreSQL store, `fleet`: `store.claims`, docs/fleet.md) an async job waits in the
store's queue instead, with its request; each server's worker claims the oldest job it can render with a lease, which
a heartbeat thread renews while the job renders and encodes. Every write of a claimed job's record is conditional on
the claim (`_write_record`): a server whose lease ran out and whose job another server claimed again writes nothing
more. A shutdown gives its claimed jobs back to the queue. Sync renders stay this server's, in its own line, placed
among the fleet's jobs by the time they came. The events of a claimed job go to the database too (`events.Relay`), for
the other servers' streams; a listener thread takes the fleet's notices (`_noticed`: events stored elsewhere, a cancel
for a job held here, a job deleted). While the database does not answer, the server is not ready (`store_problem`),
a job's progress is not written and its end is retried until it is (`_write_held`).

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
names no file. With H3_OUTPUT_URL the MP4 goes to the bucket by a multipart upload once encoded (`store.objects`); one
the bucket refuses fails its job with code `upload_failed` and S3's reason, the upload aborted, no object kept.
Readiness covers the folders the service writes (`service.folders.service_folders`): a server that cannot
write them is not ready.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import enum
import io
import logging
import math
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from h3serve.media.encoding import Encoding
from h3serve.media.mp4 import FrameStream, encode_mp4, write_mp4
from h3serve.pipeline.context import NodeLost, Progress, RenderCancelled, RenderContext
from h3serve.pipeline.engine import STAGES, RenderEngine, RenderResult
from h3serve.pipeline.request import RenderRequest
from h3serve.service.events import PREVIEWS, Events, Relay
from h3serve.service.folders import describe_folders, folder_problems
from h3serve.service.jobs import Hand, JobState, check_transition, holds
from h3serve.service.metrics import Metrics
from h3serve.service.schemas import JobError, VideoJob, step_cache_mode
from h3serve.service.store import PLAIN_ID, Fleet, JobRecords, LeaseLost, QueueLimit
from h3serve.service.store.claims import Claim, Notice, NoticeKind, Relayed, StoredEvent, StoreUnreachable
from h3serve.service.store.objects import LocalOutputs, OutputObjects, UploadFailed
from h3serve.service.warmup import WarmupResult, run_warmup

log = logging.getLogger(__name__)

# Jobs waiting for the encoder. Each may hold up to a whole video in host memory (362 frames of 1344x768 are 1.1 GB),
# so the worker waits when one is already waiting: at most the one encoding, one waiting and the worker's own.
ENCODE_BACKLOG = 1
RECOVERY_POLL_S = 0.5  # how often a queued job looks whether the GPU workers are back
CLAIM_POLL_S = 0.5  # how often an idle worker of a fleet looks for a job to claim (a job submitted here wakes it)
STORE_RETRY_S = 0.5  # how often a job's last record write is tried again while the fleet's database does not answer


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
    whose MP4 bytes are the future's result. `state`: where it is and who holds it (`jobs`), moved by
    `Scheduler._transition` alone; the other fields are its data."""

    id: str
    request: RenderRequest
    persist: bool
    ctx: RenderContext = field(default_factory=RenderContext)
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    state: JobState | None = None  # None until submitted
    result: RenderResult | None = None  # set when the render has finished
    started: float | None = None  # time.monotonic() when the worker took it
    progress: Progress | None = None  # the render's latest event (`live`)
    stream: FrameStream | None = None  # its frames as they are decoded (`_Frames`), for the encoder
    sink: _Frames | None = None  # its render's `frames_to`
    media: tuple[Any, int, int] | None = None  # (audio, sample rate, fps) of a streamed render
    claim: Claim | None = None  # a fleet's job: this server's claim on it, which every write of its record checks
    queued_at: float = field(default_factory=time.time)  # a sync render's place among the fleet's queued jobs


class _RenderFailed(Exception):
    """A streamed render's error, handed to the encoder reading its frames (which ends the job)."""

    def __init__(self, error: Exception):
        super().__init__(str(error))
        self.error = error


class _Frames:
    """A job's frames on their way to the encoder while its render decodes them (`RenderContext.frames_to`): at
    `begin` (the audio decoded, the first frames next) the job is handed off, waiting while the backlog is full as a
    rendered job does (`waited`: those seconds, which are not the render's); each run of frames then goes into an
    unbounded `FrameStream` that the encoder reads as it comes, so the GPU never waits on the encoder. Frames of a job
    already ended (cancelled, failed) are dropped."""

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
        self.scheduler._feed(self.work, self.stream, frames)

    def release(self) -> None:
        """The job has ended: its unread frames go, and the context lets go of this sink."""
        if self.stream is not None:
            self.stream.drop()
        if self.work.ctx.frames_to is self:
            self.work.ctx.frames_to = None


class Readiness(enum.StrEnum):
    WARMING = "warming"
    READY = "ready"
    FAILED = "failed"


class Scheduler:
    """The queue, the GPU worker and the encoder thread. All their state, and every job's, is guarded by one condition
    variable (an RLock: a move made while the lock is held takes it again)."""

    def __init__(
        self,
        engine: RenderEngine,
        store: JobRecords,
        *,
        max_queue: int,
        warmup: bool,
        encoding: Encoding,
        metrics: Metrics,
        folders: dict[str, Path] | None = None,
        outputs: OutputObjects | None = None,
        fleet: Fleet | None = None,
    ):
        self.engine = engine
        # Several servers on one PostgreSQL store (`store.claims`): async jobs wait in the store's queue, the worker
        # claims them with a lease that `_beat` renews; None: one server, the queue here (SQLite, and tests).
        self.fleet = fleet
        self.folders = folders or {}  # name -> folder the service writes (`folders.service_folders`), checked for ready
        self._folder_problems: dict[str, str] = {}  # the last check's, to log a change once
        self.store = store
        self.outputs = outputs or LocalOutputs(store.videos)  # where the async jobs' MP4s go (`store.objects`)
        self.max_queue = max_queue
        self.encoding = encoding  # the MP4's video encode (`media.encoding`)
        self.metrics = metrics
        self._warmup_enabled = warmup
        self.readiness = Readiness.WARMING
        self.warmup_result: WarmupResult | None = None
        self._cond = threading.Condition()
        self._queue: collections.deque[Work] = collections.deque()  # queued: waiting for the GPU
        self._encodes: collections.deque[Work] = collections.deque()  # handed off: waiting for the encoder
        self._waiting = {JobState.QUEUED: self._queue, JobState.HANDED_OFF: self._encodes}  # kept by `_transition`
        self._rendering: Work | None = None  # the worker's job, in whatever state its render leaves it
        self._encoding: Work | None = None  # the encoder's
        self._stopping = False
        # Each async job's events, and its latest preview on disk beside videos/ (`service.events`).
        self.events = Events(store.output_dir / PREVIEWS)
        self._worker = threading.Thread(target=self._work, name="h3serve-worker", daemon=True)
        self._encoder = threading.Thread(target=self._encode_loop, name="h3serve-encoder", daemon=True)
        self._beating = threading.Event()  # set by `stop`: the heartbeat ends
        self._heart = threading.Thread(target=self._beat, name="h3serve-heartbeat", daemon=True)
        # A fleet: the events of the jobs this server holds go to the database for every server's streams (`Relay`),
        # and the fleet's notices (events stored, cancels, deletes: `_noticed`) come from a listener thread.
        self.relay = Relay(fleet.publish) if fleet is not None else None
        self._listening = threading.Event()  # set by `stop`: the listener ends
        self._listener = threading.Thread(target=self._listen, name="h3serve-listen", daemon=True)

    # ---- control --------------------------------------------------------------------------------------------
    def start(self) -> None:
        self._worker.start()
        self._encoder.start()
        if self.fleet is not None:
            self._heart.start()
            self.relay.start()
            self._listener.start()

    def stop(self, timeout: float = 30.0) -> None:
        """End every job not finished (their records say the server stopped) and join the threads."""
        with self._cond:
            self._stopping = True
            for work in (self._rendering, self._encoding):
                if work is not None:
                    work.ctx.cancel("the server stopped during this job")
            for work in list(self._queue):
                self._end_cancelled(work, "the server stopped before this job ran", Hand.CLIENT)
            for work in list(self._encodes):
                self._end_cancelled(work, "the server stopped before this job's MP4 was written", Hand.CLIENT)
            self._cond.notify_all()
        deadline = time.monotonic() + timeout
        for thread in (self._worker, self._encoder):
            if thread.is_alive():
                thread.join(max(0.0, deadline - time.monotonic()))
        self._beating.set()  # after the jobs: a job still ending keeps its lease until its record is written
        if self._heart.is_alive():
            self._heart.join(max(0.0, deadline - time.monotonic()))
        if self.relay is not None:  # the last events (the ends) go out before the store closes
            self.relay.stop(max(0.0, deadline - time.monotonic()))
        self._listening.set()
        if self._listener.is_alive():
            self._listener.join(max(0.0, deadline - time.monotonic()))

    @property
    def ready(self) -> bool:
        """Warmed up, the engine can render (its GPU workers are all up: `RenderEngine.problem`) and every folder the
        service writes can be written now."""
        return self.standing().ready

    def standing(self) -> Standing:
        """Readiness, why the server cannot render now beyond the warmup (the engine's problem or an unwritable
        folder), and the unwritable folders, from one look at the folders."""
        unwritable = self.folder_problems()
        problem = self.engine.problem or (describe_folders(unwritable) if unwritable else None) or self.store_problem
        return Standing(self.readiness is Readiness.READY and problem is None, problem, unwritable)

    @property
    def store_problem(self) -> str | None:
        """Why the fleet's database does not answer now (this server then claims and accepts nothing); None while it
        does, and without a fleet."""
        why = self.fleet.problem if self.fleet is not None else None
        return f"the job store does not answer ({why}); it is reconnected by itself" if why else None

    def look_at_store(self) -> None:
        """One round trip to a fleet's database (reconnecting if it was lost), so that `standing` says how it is now,
        not at the last use (/health and /ready ask; a server busy rendering may not have used it for a while)."""
        if self.fleet is not None:
            with contextlib.suppress(StoreUnreachable):
                self.fleet.probe()

    def held(self) -> list[str]:
        """The fleet's jobs this server holds now (rendering, waiting for the encoder, encoding)."""
        with self._cond:
            works = (self._rendering, self._encoding, *self._encodes)
            return [w.id for w in works if w is not None and w.claim is not None and not w.state.ended]

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
        """Renders waiting for the GPU: here, and in a fleet the fleet's queued jobs too (while its database does not
        answer, those here only)."""
        queued = 0
        if self.fleet is not None:
            with contextlib.suppress(StoreUnreachable):
                queued = self.fleet.queued()
        with self._cond:
            return len(self._queue) + queued

    @property
    def server_id(self) -> str | None:
        """This server's name in its fleet (H3_SERVER_ID, or the one made at start); None without a fleet."""
        return self.fleet.server_id if self.fleet is not None else None

    def live(self) -> dict[str, dict[str, Any]]:
        """Where each unfinished job is now, by id, for its record (`live`; not stored, so a job the scheduler no
        longer holds has none): `queued` with the renders `ahead` of it, a render stage (engine.STAGES) with its
        units `done` of `total` (denoise steps, decode windows), or `encode` once rendered; `elapsed_s` since the
        worker took it."""
        now = time.monotonic()
        fleet_queue = []
        if self.fleet is not None:
            with contextlib.suppress(StoreUnreachable):  # (while the database does not answer: this server's jobs)
                fleet_queue = self.fleet.queue()
        with self._cond:
            busy = int(self._rendering is not None)  # the render on the GPU is ahead of every queued one
            out = {w.id: _live("queued", 0, 0, None, ahead) for ahead, w in enumerate(self._queue, start=busy)}
            # The fleet's queue, in claim order: `takers` counts the live servers that can render each (0: none can,
            # it waits for one that can).
            for ahead, (job_id, takers) in enumerate(fleet_queue):
                out[job_id] = {**_live("queued", 0, 0, None, ahead), "takers": takers}
            for work in (*self._encodes, self._encoding, self._rendering):
                if work is None or work.state.ended:  # ended: its thread lets go of it next
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
        """Queue a render (and insert its record first, so it is never lost); QueueFull when the queue is full. In a
        fleet an async job goes to the store's queue (its record, its stored request), for whichever server claims it
        first; its `work` is not used further (the claiming server makes its own). The limit then counts the fleet's
        queued jobs with this server's waiting sync renders."""
        if self.fleet is not None and work.persist:
            with self._cond:
                waiting = len(self._queue)
            try:
                self.fleet.enqueue(record, work.request, work.queued_at, self.max_queue, waiting)
            except QueueLimit:
                raise QueueFull from None
            with self._cond:
                self._cond.notify_all()  # this server's worker, if idle, claims it now rather than at its next look
            return
        queued = self.fleet.queued() if self.fleet is not None else 0
        with self._cond:
            if len(self._queue) + queued >= self.max_queue:
                raise QueueFull
            self._transition(work, JobState.QUEUED, Hand.CLIENT, record=record)

    def cancel(self, job_id: str, reason: str, wait: float = 30.0) -> bool:
        """Cancel a job by id wherever it is; True if it was found. Returns once it has stopped (or after `wait`)."""
        with self._cond:
            held = (*self._queue, *self._encodes, self._rendering, self._encoding)
            work = next((w for w in held if w is not None and w.id == job_id), None)
            if work is None:
                return self._cancel_elsewhere(job_id, reason, wait)
            if work in (self._rendering, self._encoding):  # on a thread (a streamed job can wait and render at once)
                work.ctx.cancel(reason)  # it stops at its next check; a worker waiting to hand it off wakes
                self._cond.notify_all()
            if holds(work.state, Hand.CLIENT):  # waiting for the GPU or the encoder: it ends here, now
                self._end_cancelled(work, reason, Hand.CLIENT)
                return True
        with contextlib.suppress(concurrent.futures.TimeoutError, concurrent.futures.CancelledError):
            work.future.exception(timeout=wait)  # its thread ends it
        return True

    def _cancel_elsewhere(self, job_id: str, reason: str, wait: float) -> bool:
        """A fleet's job this server does not hold: a queued one is cancelled in the store at once; one another server
        renders is asked to stop (its heartbeat sees it) and waited for, up to `wait`. False: no such active job."""
        if self.fleet is None:
            return False
        changes = {"status": JobState.CANCELLED.status, "completed_at": int(time.time()),
                   "error": JobError(code="cancelled", message=reason or "cancelled")}  # fmt: skip
        outcome = self.fleet.cancel(job_id, changes, reason)
        if outcome == "held":
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline:
                job = self.store.get(job_id)
                if job is None or job.status not in (JobState.QUEUED.status, JobState.RENDERING.status):
                    break
                time.sleep(RECOVERY_POLL_S / 5)
        return outcome is not None

    # ---- the GPU worker -------------------------------------------------------------------------------------
    def _work(self) -> None:
        self._warm()
        while (work := self._next_render()) is not None:
            with self._guard(work, Hand.WORKER):
                self._render(work)
            with self._cond:
                self._rendering = None

    def _warm(self) -> None:
        if not self._warmup_enabled:
            self.readiness = Readiness.READY
            return
        log.info("warmup: rendering the production shape")
        result = self.warmup_result = run_warmup(self.engine, encoding=self.encoding)
        if result.passed:
            log.info("warmup passed in %.2f s (%s); ready", result.seconds, result.request)
            self.readiness = Readiness.READY
        else:
            log.error("warmup failed (%s): %s; the server stays not ready", result.request, result.error)
            self.readiness = Readiness.FAILED

    def _next_render(self) -> Work | None:
        if self.fleet is not None:
            return self._next_fleet_render(self.fleet)
        with self._cond:
            while True:
                # While the GPU workers restart (a node awaited), a queued job waits for them rather than failing.
                while (not self._queue or self.engine.recovering) and not self._stopping:
                    self._cond.wait(RECOVERY_POLL_S if self._queue else None)
                if self._stopping:
                    return None
                work = self._queue[0]
                with self._guard(work, Hand.WORKER):  # its record refused the move: it fails, the next one comes
                    self._transition(work, JobState.RENDERING, Hand.WORKER)
                    self._rendering = work
                    return work

    def _next_fleet_render(self, fleet: Fleet) -> Work | None:
        """The next render of a fleet's server: the oldest job it can claim from the store's queue, or this server's
        oldest waiting sync render where that was submitted first; None once stopping. A claimed job becomes a local
        job here (queued, then rendering at once), its record already `in_progress` by the claim."""
        while True:
            with self._cond:
                while self.engine.recovering and not self._stopping:
                    self._cond.wait(RECOVERY_POLL_S)
                if self._stopping:
                    return None
                head = self._queue[0] if self._queue else None
            claim = None
            try:
                if fleet.problem is not None:  # the database was lost: this look is the one that finds it back
                    fleet.probe()
                # A server that cannot render now (its warmup failed, a GPU worker or a folder lost) claims nothing:
                # the fleet's other servers take the queue.
                if self.standing().ready:
                    claim = fleet.claim(head.queued_at if head is not None else math.inf)
            except StoreUnreachable as err:  # logged once by the store; `standing` says so meanwhile
                log.debug("the fleet's queue could not be read (%s); looking again in %.1f s", err, CLAIM_POLL_S)
            except Exception:  # the store did not answer: this server renders what it has, and looks again
                log.exception("the fleet's queue could not be read; looking again in %.1f s", CLAIM_POLL_S)
            with self._cond:
                if claim is not None:
                    if self._stopping:
                        fleet.release(claim)
                        return None
                    work = Work(claim.job_id, claim.request, persist=True, claim=claim)
                    self._transition(work, JobState.QUEUED, Hand.CLIENT)
                    head = work
                if head is None or head not in self._queue:  # (a sync render cancelled meanwhile)
                    if not self._queue and not self._stopping:
                        self._cond.wait(CLAIM_POLL_S)  # a submit here wakes it
                    continue
                with self._guard(head, Hand.WORKER):
                    self._transition(head, JobState.RENDERING, Hand.WORKER)
                    self._rendering = head
                    return head

    def _beat(self) -> None:
        """A fleet's heartbeat, every H3_HEARTBEAT_S until `stop`: this server seen, the leases of the jobs it holds
        (rendering, waiting for the encoder, encoding) renewed. A job whose claim is gone (its lease ran out and
        another server claimed it again, or it was deleted) stops here, and its record is not written by this server
        again; a cancel another server's DELETE asked for is made here."""
        fleet = self.fleet
        while not self._beating.wait(fleet.heartbeat_s):
            with self._cond:
                held = {w.id: w for w in (self._rendering, self._encoding, *self._encodes)
                        if w is not None and w.claim is not None and not w.state.ended}  # fmt: skip
            try:
                renewal = fleet.renew([w.claim for w in held.values()])
            except StoreUnreachable as err:  # the next beat tries again, before the lease runs out
                log.warning("the fleet's leases could not be renewed (%s); trying again in %.1f s", err.reason,
                            fleet.heartbeat_s)  # fmt: skip
                continue
            except Exception:  # the store did not answer: the next beat tries again, before the lease runs out
                log.exception("the fleet's leases could not be renewed; trying again in %.1f s", fleet.heartbeat_s)
                continue
            for job_id in renewal.lost:
                log.warning("job %s: this server no longer holds its claim; its render stops", job_id)
                held[job_id].ctx.cancel("this server's claim on the job is gone (its lease ran out, or it was deleted)")
                with self._cond:
                    self._cond.notify_all()  # a worker waiting to hand it off wakes
            for job_id, reason in renewal.cancels.items():  # (a notice missed: the listener was reconnecting)
                self._cancel_held(job_id, reason or "cancelled", "heartbeat")

    def _cancel_held(self, job_id: str, reason: str, via: str) -> None:
        """A cancel another server's DELETE asked for a job this server holds, come by a notice or a heartbeat
        (`via`, counted once per job in h3serve_fleet_cancels)."""
        with self._cond:
            works = (self._rendering, self._encoding, *self._encodes)
            work = next((w for w in works if w is not None and w.id == job_id and w.claim is not None), None)
            if work is None or work.state.ended or work.ctx.cancelled:
                return
            self.metrics.fleet_cancels.labels(via).inc()
        self.cancel(job_id, reason, wait=0)

    def _listen(self) -> None:
        """The fleet's notices until `stop` (`Fleet.listen`, on a connection of its own)."""
        self.fleet.listen(self._noticed, self._listening)

    def _noticed(self, notice: Notice) -> None:
        """A fleet notice: wake the streams of a job whose events another server stored; stop a job this server holds
        that another server's DELETE cancelled (at once, not at the next heartbeat); let go of a deleted job's MP4
        and preview in this server's folder (H3_OUTPUT_URL unset: the MP4 of a job this server rendered is here)."""
        if notice.kind is NoticeKind.EVENTS:
            if self.events.log(notice.job_id) is None:  # (this server's own are woken as it logs them)
                self.events.poke(notice.job_id)
        elif notice.kind is NoticeKind.CANCEL:
            if notice.server_id == self.fleet.server_id:
                self._cancel_held(notice.job_id, notice.reason or "cancelled", "notify")
        elif notice.kind is NoticeKind.DELETED:
            if PLAIN_ID.fullmatch(notice.job_id):
                self.events.forget(notice.job_id)
                if not self.outputs.remote:  # (a bucket's object is the deleting server's to remove)
                    self.outputs.delete(f"{notice.job_id}.mp4")
        elif notice.kind is NoticeKind.RECONNECTED:  # notices may have been missed: every stream reads again
            self.events.poke_all()

    def _render(self, work: Work) -> None:
        """Render one job. Its frames come back whole (it is handed to the encoder now) or stream to the encoder as
        they are decoded (handed off at `_Frames.begin`; their stream is closed here). A render that raised ends its
        job here or in the encoder, whichever holds it (`_render_failed`)."""
        self._watch(work)
        frames = work.sink = work.ctx.frames_to = _Frames(self, work)
        try:
            result = self.engine.render(work.request, work.ctx)
        except Exception as err:
            self._render_failed(work, frames, err)
            return
        if frames.waited and "total" in result.timings:  # waiting for the encoder's backlog is not rendering
            result.timings["total"] -= frames.waited
        if work.state is JobState.RENDERING:  # its frames came back whole (only this thread moves it on from here)
            work.result = result
            if not self._hand_off(work):
                self._end_cancelled(work, work.ctx.reason, Hand.WORKER)
            return
        with self._cond:
            if not work.state.ended:  # (ended while its render wound down: it keeps nothing)
                work.result = result
        frames.stream.close()  # after the result: the encoder ends the job once it has read the end

    def _watch(self, work: Work) -> None:
        """The render's progress and previews, as `live`, the record's percent and the events (`_progressed`)."""
        last, stage = -1, None
        finished: set[str] = set()  # the stages this render has left (their order: `progress_percent`)

        def on_progress(p: Progress) -> None:
            nonlocal last, stage
            changed = p.stage != stage
            if changed and stage is not None:
                finished.add(stage)
            stage = p.stage
            percent = progress_percent(p, finished)
            events = [("stage", {"stage": p.stage, "progress": percent})] if changed else []
            if p.done:
                events.append(("progress", {"stage": p.stage, "done": p.done, "total": p.total, "progress": percent}))
            self._progressed(work, p, None if percent == last else percent, events)
            last = percent

        def on_preview(preview) -> None:
            if work.state.ended:  # (checked again as the event goes out; this spares the PNG's write)
                return
            if not self.events.set_preview(work.id, preview.png):  # logged: no event for a preview nobody can fetch
                return
            data = {"url": f"/v1/videos/{work.id}/preview?forward={preview.forward}", "forward": preview.forward,
                    "forwards": preview.forwards, "width": preview.width, "height": preview.height,
                    "seconds": round(preview.seconds, 4)}  # fmt: skip
            self._progressed(work, None, None, [("preview", data)], png=preview.png)

        work.ctx.on_progress = on_progress
        if work.persist and work.request.preview_every:
            work.ctx.on_preview = on_preview

    def _progressed(
        self,
        work: Work,
        progress: Progress | None,
        percent: int | None,
        events: list[tuple[str, dict[str, Any]]],
        png: bytes | None = None,
    ) -> None:
        """A render's progress while its job has not ended (a render winding down after its job ended publishes
        nothing more): `live`'s view, the record's percent (None: unchanged) and an async job's events (`png`: a
        preview event's image, relayed with it in a fleet)."""
        with self._cond:
            if work.state.ended:
                return
            if progress is not None:
                work.progress = progress
            if not work.persist:
                return
            if percent is not None:
                try:
                    self._write_record(work, progress=percent)
                except LeaseLost:  # another server has the job now: this render stops (`_beat` says so too)
                    work.ctx.cancel("this server's lease on the job ran out and another server claimed it")
                    return
                except StoreUnreachable:  # the record's percent waits for the next one; the render goes on
                    pass
            for name, data in events:
                self._publish(work, name, data, png if name == "preview" else None)

    def _publish(self, work: Work, name: str, data: dict[str, Any], png: bytes | None = None) -> None:
        """An async job's event, in its log here and, for a fleet's job, relayed to the database for every server's
        streams (with a preview's PNG)."""
        event = self.events.publish(work.id, name, data)
        if work.claim is not None:
            stored = StoredEvent(event.id, event.name, event.data)
            self.relay.put(Relayed(work.id, work.claim.generation, stored, png))

    def _feed(self, work: Work, stream: FrameStream, frames: Any) -> None:
        """A run of a streaming render's frames, for the encoder; dropped once the job has ended (nobody reads them)."""
        with self._cond:
            if not work.state.ended:
                stream.put(frames)  # never waits (an unbounded stream)

    def _render_failed(self, work: Work, frames: _Frames, err: Exception) -> None:
        """End a job whose render raised if the worker holds it, or takes it back while it waits for the encoder (it
        ends now, not after the encode ahead of it); one the encoder has taken meets the error in its frames' stream,
        and the encoder ends it."""
        cancelled = isinstance(err, RenderCancelled)
        with self._cond:
            if holds(work.state, Hand.WORKER):
                if cancelled:
                    self._end_cancelled(work, str(err) or "cancelled", Hand.WORKER)
                else:
                    self._end_failed(work, err, "render", Hand.WORKER)
            elif work.state is JobState.ENCODING:
                if not cancelled:
                    log.error(
                        "job %s: the render failed while its frames streamed to the encoder", work.id, exc_info=err
                    )
                frames.stream.fail(err if cancelled else _RenderFailed(err))

    def _hand_off(self, work: Work) -> bool:
        """Give a job to the encoder (rendered, or its frames about to stream), waiting while the backlog is full (a
        cancel wakes the wait); False when it was cancelled first (and not handed)."""
        with self._cond:
            while len(self._encodes) >= ENCODE_BACKLOG and not work.ctx.cancelled:
                self._cond.wait(RECOVERY_POLL_S)  # a sync render's cancel (its route's) notifies no one: polled
            if work.ctx.cancelled:
                return False
            self._transition(work, JobState.HANDED_OFF, Hand.WORKER)
            return True

    # ---- the encoder ----------------------------------------------------------------------------------------
    def _encode_loop(self) -> None:
        while (work := self._next_encode()) is not None:
            with self._guard(work, Hand.ENCODER):
                self._encode(work)
            with self._cond:
                self._encoding = None

    def _next_encode(self) -> Work | None:
        with self._cond:
            while not self._encodes and not self._stopping:
                self._cond.wait()
            if self._stopping:
                return None  # `stop` has ended what was left waiting
            self._encoding = self._encodes[0]
            self._transition(self._encoding, JobState.ENCODING, Hand.ENCODER)  # room in the backlog: the worker goes on
            return self._encoding

    def _encode(self, work: Work) -> None:
        """Encode a job's MP4 (its frames as its render decodes them, or whole) and end the job."""
        if work.ctx.cancelled:
            self._end_cancelled(work, work.ctx.reason, Hand.ENCODER)
            return
        try:
            payload = self._write(work)
        except RenderCancelled:  # cancelled between frames: write_mp4 has removed the partial file
            self._end_cancelled(work, work.ctx.reason, Hand.ENCODER)
            return
        except _RenderFailed as err:  # the render streaming the frames failed (logged there): no file was kept
            self._end_failed(work, err.error, "render", Hand.ENCODER, logged=True)
            return
        except UploadFailed as err:  # H3_OUTPUT_URL's bucket refused it or did not answer: the upload was aborted
            work.ctx.cancel("the MP4 could not be stored")
            self._end_unstored(work, err)
            return
        except OSError as err:  # the encode's own errors are ValueErrors; an OSError is the disk's or the folder's
            work.ctx.cancel("the MP4 could not be written")  # a render still decoding stops
            self._end_unwritten(work, err)
            return
        except Exception as err:
            work.ctx.cancel("the MP4 encode failed")
            self._end_failed(work, err, "MP4 encode", Hand.ENCODER)
            return
        if work.ctx.cancelled:  # cancelled while encoding: the encode has finished, its file goes
            if work.persist:
                self._discard(payload)
            self._end_cancelled(work, work.ctx.reason, Hand.ENCODER)
            return
        self._transition(work, JobState.COMPLETED, Hand.ENCODER, payload=payload)

    def _discard(self, name: str) -> None:
        """The MP4 of a job cancelled once it was written goes; a bucket that refuses is logged (the MP4 has no
        record naming it; `h3serve store check` lists it), never the job's failure."""
        try:
            self.outputs.delete(name)
        except Exception as err:
            log.warning("%s in %s could not be removed after its job was cancelled: %s", name, self.outputs.where, err)

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
            "encoding": self.encoding,
            "check": work.ctx.check,  # a cancel stops the encode before the next frame
        }
        if work.persist:
            name = f"{work.id}.mp4"  # the server's name: nothing a client sent
            # Whole or not at all: a file renamed into place, or an upload completed (`store.objects`).
            self.outputs.write(name, lambda path: write_mp4(path, frames, audio, **settings), work.ctx.check)
            return name
        buffer = io.BytesIO()
        encode_mp4(buffer, frames, audio, **settings)
        return buffer.getvalue()

    # ---- a job's moves --------------------------------------------------------------------------------------
    def _transition(
        self,
        work: Work,
        to: JobState,
        hand: Hand,
        *,
        record: VideoJob | None = None,
        payload: str | bytes | None = None,
        error: JobError | None = None,
        raised: BaseException | None = None,
    ) -> None:
        """Move a job on: the one writer of its state, its record, its events and its result, under the lock, after
        `check_transition` (IllegalTransition: a move the table does not have, or by a hand that does not hold the
        job). The facts are the move's: the `record` a submit inserts; an ending's `payload` (completed: the MP4's
        file name or bytes), or the record's `error` and the exception its waiter gets (`raised`)."""
        with self._cond:
            check_transition(work.id, work.state, to, hand)
            if to.ended:
                self._end(work, to, payload, error, raised)
            else:
                self._advance(work, to, record)
            self._cond.notify_all()  # the threads wait on moves: a job to take, room in the backlog

    def _advance(self, work: Work, to: JobState, record: VideoJob | None) -> None:
        """A move short of the end. Its record is written first: a refused write (the store's error, raised) moves
        nothing, so a job is never queued without its record nor further on than its record says."""
        if to is JobState.QUEUED and record is not None:
            self.store.insert(record)
        elif to is JobState.RENDERING and work.persist and work.claim is None:  # (a claim wrote in_progress)
            self.store.update(work.id, status=to.status)
        self._move(work, to)
        if to is JobState.RENDERING:
            work.started = time.monotonic()
        elif to is JobState.QUEUED and work.claim is not None:  # its `queued` was stored with it: its log goes on
            self.events.adopt(work.id, work.claim.history)
        elif to is JobState.QUEUED and work.persist:
            ahead = len(self._queue) - 1 + int(self._rendering is not None)
            self.events.publish(work.id, "queued", {"ahead": ahead})

    def _move(self, work: Work, to: JobState) -> None:
        """The state, and the waiting line that goes with it (a queued job is in the queue, a handed-off one in the
        encoder's backlog, and nowhere else)."""
        if (left := self._waiting.get(work.state)) is not None:
            left.remove(work)
        work.state = to
        if (joined := self._waiting.get(to)) is not None:
            joined.append(work)

    def _end(
        self,
        work: Work,
        to: JobState,
        payload: str | bytes | None,
        error: JobError | None,
        raised: BaseException | None,
    ) -> None:
        """An ending: it ends even if its record cannot be written (logged, and its waiter gets the store's error), and
        the job lets go of its video."""
        self._move(work, to)
        try:
            self._record_end(work, to, payload, error, raised)
        except LeaseLost as err:  # logged by `_record_end`: another server has the job; nothing was written
            raised = err
        except Exception as err:
            log.exception("job %s: the scheduler could not finish it", work.id)
            raised = err
        self._release(work, keep_result=to is JobState.COMPLETED and not work.persist)
        if raised is None:
            work.future.set_result(payload)
        else:
            work.future.set_exception(raised)

    def _record_end(
        self,
        work: Work,
        to: JobState,
        payload: str | bytes | None,
        error: JobError | None,
        raised: BaseException | None,
    ) -> None:
        """An ending's count in the metrics, and an async job's record and last event."""
        cancelled = isinstance(raised, RenderCancelled)  # by its client, or by a shutdown (failed, interrupted)
        result = work.result if to is JobState.COMPLETED else None
        if not cancelled or work.started is not None:  # a job cancelled before the GPU took it was no render
            self.metrics.render_finished("cancelled" if cancelled else to.value, result)
        if not work.persist or (cancelled and self.store.get(work.id) is None):
            return
        if work.claim is not None and self._stopping and error is not None and error.code == "interrupted":
            # A fleet's job this server stops during: back to the queue, for another server (or this one's next
            # start) to render again from its stored request, rather than failed.
            if self.fleet.release(work.claim):
                log.info("job %s: queued again for the fleet (this server is stopping)", work.id)
            return
        status, now = to.status, int(time.time())
        if to is JobState.COMPLETED:
            self._write_record(
                work,
                status=status,
                progress=100,
                completed_at=now,
                file_name=payload,
                inference_time_s=round(result.timings["total"], 4),
                stage_durations={k: round(v, 4) for k, v in result.timings.items() if k != "total"},
                peak_memory_mb=round(result.peak_memory_mb, 1),
                num_gpus=max(1, len(result.split)),
                step_cache=step_cache_mode(result.step_cache, work.request.quality),
                cached_steps=list(result.step_cache.cached) if result.step_cache is not None else [],
            )
            self._publish(work, "completed", {"status": "completed", "url": f"/v1/videos/{work.id}/content"})
        else:
            self._write_record(work, status=status, completed_at=now, error=error)
            self._publish(work, str(status), {"status": str(status), "error": error.model_dump()})

    def _write_record(self, work: Work, **changes: Any) -> None:
        """Write a job's record: a fleet's job only while this server holds its claim (`Fleet.write`: LeaseLost
        otherwise, nothing written, so a job another server has claimed again is never finished twice), and the MP4 of
        a completion so refused is discarded where it is this server's own file."""
        if work.claim is None:
            self.store.update(work.id, **changes)
            return
        ending = changes.get("status") in (JobState.COMPLETED.status, JobState.FAILED.status, JobState.CANCELLED.status)
        try:
            self._write_held(work, ending, changes)
        except LeaseLost:
            log.warning("job %s: not written (%s): another server claimed it again after this server's lease ran "
                        "out", work.id, ", ".join(changes))  # fmt: skip
            self.events.moved(work.id)  # its streams here follow the new holder's events
            name = changes.get("file_name")
            # A shared bucket's key is the new holder's too (the same bytes): only this server's own file goes.
            if name and isinstance(self.outputs, LocalOutputs):
                self._discard(name)
            raise

    def _write_held(self, work: Work, ending: bool, changes: dict[str, Any]) -> None:
        """`Fleet.write`; a job's last write (its end) is tried again while the database does not answer, until it is
        made, refused (LeaseLost) or the server stops (the job then stays held: queued again at the next start, or
        claimed by another server after its lease), so that a render finished during an outage is not lost. The wait
        lets go of the scheduler's lock (the job has ended here already: nothing else moves it)."""
        told = False
        while True:
            try:
                self.fleet.write(work.claim, ending, **changes)
                if told:
                    log.warning("job %s: its end is written, the job store answering again", work.id)
                return
            except StoreUnreachable as err:
                if not ending or self._stopping:  # (an end written twice is the same record: `unknown` too)
                    raise
                if not told:
                    log.warning("job %s: its end cannot be written yet (%s); retrying every %.1f s", work.id,
                                err.reason, STORE_RETRY_S)  # fmt: skip
                    told = True
                with self._cond:
                    self._cond.wait(STORE_RETRY_S)

    def _release(self, work: Work, keep_result: bool = False) -> None:
        """An ended job lets go of its video: the rendered frames (with the result, unless `keep_result`: a sync
        render's timings for its response), and the streamed ones nobody will read."""
        if not keep_result:
            work.result = None
        work.stream = work.media = None
        if work.sink is not None:
            work.sink.release()
            work.sink = None

    @contextlib.contextmanager
    def _guard(self, work: Work, hand: Hand) -> Iterator[None]:
        """A failure outside the render and the encode (a record write refused): logged, the job failed if this hand
        holds it (its waiter released), and the thread goes on with the next job."""
        try:
            yield
        except Exception as err:
            log.exception("job %s: the scheduler could not finish it", work.id)
            with self._cond:
                if holds(work.state, hand):
                    self._end_failed(work, err, "render" if hand is Hand.WORKER else "MP4 encode", hand, logged=True)

    # ---- the endings ----------------------------------------------------------------------------------------
    def _end_failed(self, work: Work, err: Exception, stage: str, hand: Hand, logged: bool = False) -> None:
        """A render or encode that raised: the traceback goes to the log (unless `logged` already), the record and
        the client get a message that names the request id to look for there (an exception's text can hold paths and
        internals)."""
        if not logged:
            log.error("job %s: the %s failed", work.id, stage, exc_info=err)
        message, code = (
            f"the {stage} failed (internal error); see the server log, request id {work.id}",
            "render_failed",
        )
        if isinstance(err, NodeLost):  # names a node and a rank, nothing of this host: the client may know
            message, code = f"the {stage} failed: {err}; it resumes when the node joins again", "node_lost"
        self._transition(work, JobState.FAILED, hand, error=JobError(code=code, message=message), raised=err)

    def _end_unwritten(self, work: Work, err: OSError) -> None:
        """An MP4 the disk or the folder refused: failed with code write_failed and the OS's reason (no path)."""
        log.error("job %s: the MP4 could not be written: %s", work.id, err)
        message = write_failure(err, work.id)
        error = JobError(code="write_failed", message=message)
        self._transition(work, JobState.FAILED, Hand.ENCODER, error=error, raised=WriteFailed(message))

    def _end_unstored(self, work: Work, err: UploadFailed) -> None:
        """An MP4 H3_OUTPUT_URL's bucket did not take (its upload aborted, no object kept): failed with code
        upload_failed and S3's reason (no endpoint, no key)."""
        log.error("job %s: the MP4 could not be stored in %s: %s", work.id, self.outputs.where, err.reason)
        message = (
            f"the MP4 could not be stored in the output bucket ({err.reason}); no object was kept. See the server log, "
            f"request id {work.id}"
        )
        error = JobError(code="upload_failed", message=message)
        self._transition(work, JobState.FAILED, Hand.ENCODER, error=error, raised=WriteFailed(message))

    def _end_cancelled(self, work: Work, reason: str, hand: Hand) -> None:
        """A job stopped before it finished: cancelled by its client (or a timeout), or, in a shutdown, failed with
        code interrupted (as a crash leaves it once the store reopens)."""
        to, code = (JobState.FAILED, "interrupted") if self._stopping else (JobState.CANCELLED, "cancelled")
        error = JobError(code=code, message=reason or "cancelled")
        self._transition(work, to, hand, error=error, raised=RenderCancelled(reason))
