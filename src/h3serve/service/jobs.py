"""Jobs: typed records in an embedded SQLite database, and the one worker that runs renders in order.

The store lives next to the outputs (`output_dir/jobs.sqlite3`, MP4s in `output_dir/videos/<id>.mp4`: server-chosen
names, nothing a client sends becomes a path). Every state change is written before it is visible through the API,
so a restart loses nothing: completed jobs stay listable and downloadable, and a job that was queued or running when
the process died is marked failed with an error that says so.

The scheduler owns a bounded queue (sync and async renders share it; full means 429) and one worker thread, so one
render uses the GPU at a time. The worker runs the startup warmup before anything else.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import enum
import io
import json
import logging
import sqlite3
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from h3serve.config import FPS
from h3serve.media.mp4 import encode_mp4, write_mp4
from h3serve.pipeline.context import Progress, RenderCancelled, RenderContext
from h3serve.pipeline.engine import Engine, RenderResult, WarmupResult
from h3serve.pipeline.request import RenderRequest
from h3serve.service.schemas import JobError, VideoJob, step_cache_mode

log = logging.getLogger(__name__)


class JobStatus(enum.StrEnum):
    QUEUED = "queued"
    IN_PROGRESS = "in_progress"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"


ACTIVE = (JobStatus.QUEUED, JobStatus.IN_PROGRESS)
# Progress shares of each stage (percent); denoise is spread over its steps, video over its decode windows.
STAGE_SHARE = {"text": 4, "keyframes": 2, "layout": 1, "tables": 1, "denoise": 79, "video": 11, "audio": 2}
INTERRUPTED = "the server stopped before this job finished (restart or crash); submit it again"

_COLUMNS = (
    "id", "status", "progress", "model", "prompt", "size", "seconds", "quality", "created_at", "completed_at",
    "error_code", "error_message", "file_name", "inference_time_s", "stage_durations", "peak_memory_mb", "task",
    "num_frames", "num_inference_steps", "seed", "step_cache", "cached_steps",
)  # fmt: skip
_JSON_COLUMNS = ("stage_durations", "cached_steps")
# Columns added after the first schema: a store written by an older build gains them (NULL in its old rows).
_ADDED_COLUMNS = {"step_cache": "TEXT", "cached_steps": "TEXT"}  # cached_steps: a JSON list of forward indices


def new_job_id() -> str:
    return f"video_gen_{uuid.uuid4().hex}"


def progress_percent(p: Progress) -> int:
    done = 0.0
    for stage, share in STAGE_SHARE.items():
        if stage == p.stage:
            return int(done + share * p.fraction)
        done += share
    return 0


class JobStore:
    """The job records. Thread-safe (one connection behind a lock); every write commits."""

    def __init__(self, output_dir: Path):
        self.output_dir = output_dir
        self.videos = output_dir / "videos"
        self.videos.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(output_dir / "jobs.sqlite3", check_same_thread=False, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute(
                "CREATE TABLE IF NOT EXISTS jobs (id TEXT PRIMARY KEY, status TEXT NOT NULL, progress INTEGER, "
                "model TEXT, prompt TEXT, size TEXT, seconds TEXT, quality TEXT, created_at INTEGER, completed_at "
                "INTEGER, error_code TEXT, error_message TEXT, file_name TEXT, inference_time_s REAL, stage_durations "
                "TEXT, peak_memory_mb REAL, task TEXT, num_frames INTEGER, num_inference_steps INTEGER, seed INTEGER, "
                "step_cache TEXT, cached_steps TEXT)"
            )
            present = {row["name"] for row in self._db.execute("PRAGMA table_info(jobs)")}
            for name, kind in _ADDED_COLUMNS.items():
                if name not in present:
                    self._db.execute(f"ALTER TABLE jobs ADD COLUMN {name} {kind}")
        self.recovered = self._recover()

    def _recover(self) -> int:
        """Jobs left active by a previous process become failed; half-written MP4s are removed."""
        with self._lock:
            n = self._db.execute(
                "UPDATE jobs SET status=?, error_code=?, error_message=?, completed_at=? WHERE status IN (?, ?)",
                (JobStatus.FAILED, "interrupted", INTERRUPTED, int(time.time()), *ACTIVE),
            ).rowcount
        for partial in self.videos.glob(".*.tmp"):
            partial.unlink(missing_ok=True)
        if n:
            log.warning("%d job(s) interrupted by the previous stop are marked failed", n)
        return n

    def insert(self, job: VideoJob) -> None:
        values = self._row(job)
        with self._lock:
            self._db.execute(
                f"INSERT INTO jobs ({', '.join(_COLUMNS)}) VALUES ({', '.join('?' * len(_COLUMNS))})",
                [values[c] for c in _COLUMNS],
            )

    def update(self, job_id: str, **changes: Any) -> None:
        if "error" in changes:
            error = changes.pop("error")
            changes["error_code"], changes["error_message"] = (error.code, error.message) if error else (None, None)
        for name in _JSON_COLUMNS:
            if name in changes and changes[name] is not None:
                changes[name] = json.dumps(changes[name])
        assert set(changes) <= set(_COLUMNS), changes
        with self._lock:
            self._db.execute(
                f"UPDATE jobs SET {', '.join(f'{k}=?' for k in changes)} WHERE id=?", [*changes.values(), job_id]
            )

    def get(self, job_id: str) -> VideoJob | None:
        with self._lock:
            row = self._db.execute("SELECT * FROM jobs WHERE id=?", (job_id,)).fetchone()
        return None if row is None else self._job(row)

    def list(self, limit: int, after: str | None = None) -> tuple[list[VideoJob], bool]:
        """Newest first; `after` is the id of the last job of the previous page. Returns (jobs, has_more)."""
        with self._lock:
            if after is None:
                rows = self._db.execute(
                    "SELECT * FROM jobs ORDER BY created_at DESC, rowid DESC LIMIT ?", (limit + 1,)
                ).fetchall()
            else:
                rows = self._db.execute(
                    "SELECT * FROM jobs WHERE (created_at, rowid) < (SELECT created_at, rowid FROM jobs WHERE id=?) "
                    "ORDER BY created_at DESC, rowid DESC LIMIT ?",
                    (after, limit + 1),
                ).fetchall()
        return [self._job(r) for r in rows[:limit]], len(rows) > limit

    def delete(self, job_id: str) -> None:
        job = self.get(job_id)
        with self._lock:
            self._db.execute("DELETE FROM jobs WHERE id=?", (job_id,))
        if job is not None and job.file_name:
            (self.videos / job.file_name).unlink(missing_ok=True)

    def counts(self) -> dict[str, int]:
        with self._lock:
            rows = self._db.execute("SELECT status, COUNT(*) FROM jobs GROUP BY status").fetchall()
        found = {r[0]: r[1] for r in rows}
        return {s.value: found.get(s.value, 0) for s in JobStatus}

    def path(self, job: VideoJob) -> Path | None:
        return self.videos / job.file_name if job.file_name else None

    def close(self) -> None:
        with self._lock:
            self._db.close()

    @staticmethod
    def _row(job: VideoJob) -> dict[str, Any]:
        values = job.model_dump()
        error = values.pop("error")
        values["error_code"] = error["code"] if error else None
        values["error_message"] = error["message"] if error else None
        for name in _JSON_COLUMNS:
            if values[name] is not None:
                values[name] = json.dumps(values[name])
        return values

    @staticmethod
    def _job(row: sqlite3.Row) -> VideoJob:
        values = {k: row[k] for k in row.keys() if k not in ("error_code", "error_message")}  # noqa: SIM118
        if row["error_code"]:
            values["error"] = JobError(code=row["error_code"], message=row["error_message"])
        for name in _JSON_COLUMNS:
            if values[name]:
                values[name] = json.loads(values[name])
        return VideoJob(**values)


def job_record(job_id: str, request: RenderRequest, model: str) -> VideoJob:
    return VideoJob(
        id=job_id,
        status=JobStatus.QUEUED,
        model=model,
        prompt=request.prompt,
        size=f"{request.width}x{request.height}",
        seconds=f"{request.num_frames / FPS:.3f}".rstrip("0").rstrip("."),
        quality=request.quality,
        created_at=int(time.time()),
        task=request.task,
        num_frames=request.num_frames,
        num_inference_steps=request.steps,
        seed=request.seed,
    )


class QueueFull(Exception):
    pass


@dataclass
class Work:
    """One render waiting for or holding the GPU. `persist`: an async job (record + MP4 file); else a sync render
    whose MP4 bytes are the future's result."""

    id: str
    request: RenderRequest
    persist: bool
    ctx: RenderContext = field(default_factory=RenderContext)
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    result: RenderResult | None = None


class Readiness(enum.StrEnum):
    WARMING = "warming"
    READY = "ready"
    FAILED = "failed"


class Scheduler:
    """A bounded FIFO of renders and the single worker thread that runs them (after the warmup)."""

    def __init__(self, engine: Engine, store: JobStore, *, max_queue: int, warmup: bool, encoder_threads: int, metrics):
        self.engine = engine
        self.store = store
        self.max_queue = max_queue
        self.encoder_threads = encoder_threads
        self.metrics = metrics
        self._warmup_enabled = warmup
        self.readiness = Readiness.WARMING
        self.warmup_result: WarmupResult | None = None
        self._queue: collections.deque[Work] = collections.deque()
        self._cond = threading.Condition()
        self._running: Work | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="h3serve-worker", daemon=True)

    # ---- control --------------------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel what is queued and running (their records say the server stopped) and join the worker."""
        with self._cond:
            self._stopping = True
            queued = list(self._queue)
            self._queue.clear()
            running = self._running
            self._cond.notify_all()
        for work in queued:
            self._finish_cancelled(work, "the server stopped before this job ran", JobStatus.FAILED)
        if running is not None:
            running.ctx.cancel("the server stopped during this render")
        self._thread.join(timeout)

    @property
    def ready(self) -> bool:
        return self.readiness is Readiness.READY

    @property
    def depth(self) -> int:
        with self._cond:
            return len(self._queue)

    def submit(self, work: Work, record: VideoJob | None = None) -> None:
        """Queue a render (and insert its record first, so it is never lost); QueueFull when the queue is full."""
        with self._cond:
            if len(self._queue) >= self.max_queue:
                raise QueueFull
            if record is not None:
                self.store.insert(record)
            self._queue.append(work)
            self._cond.notify_all()

    def cancel(self, job_id: str, reason: str, wait: float = 30.0) -> bool:
        """Cancel a queued or running render by id; True if it was found. A running render is waited for until it
        has stopped (it stops within one denoise step or decode window)."""
        with self._cond:
            queued = next((w for w in self._queue if w.id == job_id), None)
            if queued is not None:
                self._queue.remove(queued)
            running = self._running if self._running is not None and self._running.id == job_id else None
            if running is not None:
                running.ctx.cancel(reason)
        if queued is not None:
            self._finish_cancelled(queued, reason, JobStatus.CANCELLED)
            return True
        if running is None:
            return False
        with contextlib.suppress(concurrent.futures.TimeoutError, concurrent.futures.CancelledError):
            running.future.exception(timeout=wait)
        return True

    # ---- the worker -----------------------------------------------------------------------------------------
    def _run(self) -> None:
        if self._warmup_enabled:
            log.info("warmup: rendering the production shape")
            self.warmup_result = self.engine.warmup(threads=self.encoder_threads)
            if self.warmup_result.passed:
                log.info("warmup passed in %.2f s (%s); ready", self.warmup_result.seconds, self.warmup_result.request)
                self.readiness = Readiness.READY
            else:
                log.error("warmup failed (%s): %s; the server stays not ready", self.warmup_result.request,
                          self.warmup_result.error)  # fmt: skip
                self.readiness = Readiness.FAILED
        else:
            self.readiness = Readiness.READY
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                work = self._queue.popleft()
                self._running = work
            try:
                self._execute(work)
            finally:
                with self._cond:
                    self._running = None

    def _execute(self, work: Work) -> None:
        last = [-1]

        def on_progress(p: Progress) -> None:
            percent = progress_percent(p)
            if work.persist and percent != last[0]:
                last[0] = percent
                self.store.update(work.id, progress=percent)

        work.ctx.on_progress = on_progress
        if work.persist:
            self.store.update(work.id, status=JobStatus.IN_PROGRESS)
        try:
            result = self.engine.render(work.request, work.ctx)
            work.ctx.check()
            if work.persist:
                name = f"{work.id}.mp4"
                write_mp4(self.store.videos / name, result.frames, result.audio, fps=result.fps,
                          sample_rate=result.sample_rate, threads=self.encoder_threads)  # fmt: skip
                payload: Any = name
            else:
                buffer = io.BytesIO()
                encode_mp4(buffer, result.frames, result.audio, fps=result.fps, sample_rate=result.sample_rate,
                           threads=self.encoder_threads)  # fmt: skip
                payload = buffer.getvalue()
        except RenderCancelled as err:
            self.metrics.render_finished("cancelled", None)
            # Stopped by shutdown, the job failed; stopped by its client, it was cancelled.
            status = JobStatus.FAILED if self._stopping else JobStatus.CANCELLED
            self._finish_cancelled(work, str(err) or "cancelled", status)
            return
        except Exception as err:
            log.exception("render %s failed", work.id)
            self.metrics.render_finished("failed", None)
            if work.persist:
                self.store.update(
                    work.id,
                    status=JobStatus.FAILED,
                    completed_at=int(time.time()),
                    error=JobError(code="render_failed", message=f"{type(err).__name__}: {err}"),
                )
            work.future.set_exception(err)
            return
        work.result = result
        self.metrics.render_finished("completed", result)
        stages = {k: round(v, 4) for k, v in result.timings.items() if k != "total"}
        if work.persist:
            self.store.update(
                work.id,
                status=JobStatus.COMPLETED,
                progress=100,
                completed_at=int(time.time()),
                file_name=payload,
                inference_time_s=round(result.timings["total"], 4),
                stage_durations=stages,
                peak_memory_mb=round(result.peak_memory_mb, 1),
                step_cache=step_cache_mode(result.step_cache, work.request.quality),
                cached_steps=list(result.step_cache.cached) if result.step_cache is not None else [],
            )
        work.future.set_result(payload)

    def _finish_cancelled(self, work: Work, reason: str, status: JobStatus) -> None:
        if work.persist and self.store.get(work.id) is not None:
            code = "cancelled" if status is JobStatus.CANCELLED else "server_stopped"
            self.store.update(
                work.id, status=status, completed_at=int(time.time()), error=JobError(code=code, message=reason)
            )
        if not work.future.done():
            work.future.set_exception(RenderCancelled(reason))
