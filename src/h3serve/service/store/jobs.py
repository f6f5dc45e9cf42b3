"""The job store's records: `JobStore`, the typed job records (`schemas.VideoJob`) in an embedded SQLite database
next to the outputs, read and written as rows (`rows`).

Every state change is committed before it is visible through the API, so a restart loses nothing: completed jobs stay
listable and downloadable, and a job that was queued or running when the process died is marked failed with an error
that says so. SQLite runs in WAL mode (readers never wait for the writer) with one connection behind a lock, shared by
the event loop's threadpool, the GPU worker (progress) and the encoder; writes are explicit transactions.

A row that goes bad while the server runs is shown as a `DamagedRecord` (status `damaged`, logged once) and never
takes the list down.
"""

from __future__ import annotations

import contextlib
import logging
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel

from h3serve.config import FPS
from h3serve.pipeline.request import RenderRequest
from h3serve.service.schemas import JobError, JobStatus, VideoJob, adapter_uses
from h3serve.service.store.check import StoreUnavailable, refuse_damage
from h3serve.service.store.lock import SERVER, FolderLock
from h3serve.service.store.rows import (
    COLUMNS,
    CREATE,
    CREATED_COLUMN,
    FIELDS,
    ID_COLUMN,
    INSERT,
    JOB_ID,
    MP4,
    NEWEST_FIRST,
    OLDEST_FIRST,
    SELECT,
    STATUS_COLUMN,
    STORE_FILE,
    assignments,
    column_of,
    decode_row,
    decode_text,
    definition,
    encode,
    row_id,
)
from h3serve.service.store.sidecars import FINISHED, SIDECAR, write_sidecar

log = logging.getLogger(__name__)

ACTIVE = (JobStatus.QUEUED, JobStatus.IN_PROGRESS)
INTERRUPTED = "the server stopped before this job finished (restart or crash); submit it again"


class DamagedRecord(BaseModel):
    """What the API shows for a row that does not decode: its id, status `damaged`, and why in `error` (code
    `damaged_record`). Not a VideoJob: a client that reads the status sees at once that this is no job state."""

    id: str
    object: str = "video"
    status: Literal["damaged"] = "damaged"
    error: JobError


class RecordDamaged(ValueError):
    """`JobStore.get` of a job whose row does not decode: `record` says which and why."""

    def __init__(self, record: DamagedRecord):
        super().__init__(record.error.message)
        self.record = record


def job_record(job_id: str, request: RenderRequest, model: str) -> VideoJob:
    """The record of a job just accepted: queued, with the request's shape and seed."""
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
        flow_shift=request.video_shift,
        audio_flow_shift=request.audio_shift,
        preview_every=request.preview_every,
        adapters=adapter_uses(request),
    )


class JobStore:
    """The job records. Thread-safe: one connection behind a lock; every write is one transaction.

    The output folder's lock (`FolderLock`) is held from the open to `close`: a second server on the folder, or a
    rebuild, is refused (FolderBusy) rather than run beside this one. `lock`: one the caller holds already (a rebuild
    opening the store it built), used and left to the caller; without it the store takes its own.
    `check`: refuse a damaged store (StoreDamaged, as the start's check does) before anything is written to it.
    StoreUnavailable when another process holds SQLite's write lock on it."""

    def __init__(self, output_dir: Path, *, check: bool = True, lock: FolderLock | None = None):
        output_dir.mkdir(parents=True, exist_ok=True)  # the lock file's folder
        self._folder_lock = lock if lock is not None else FolderLock(output_dir, SERVER)
        self._owns_folder_lock = lock is None
        try:
            if check:
                refuse_damage(output_dir)
            self._open(output_dir)
        except BaseException:
            if self._owns_folder_lock:
                self._folder_lock.release()
            raise

    def _open(self, output_dir: Path) -> None:
        self.output_dir = output_dir
        self.videos = output_dir / "videos"
        self.videos.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        # A finish (the record, then its sidecar) and a delete (the sidecar, then the record) of one job never
        # interleave: no sidecar outlives its record, so a rebuild never brings a deleted job back.
        self._records = threading.Lock()
        self._logged: set[int] = set()  # rows whose damage the log has told (once each)
        # isolation_level=None: no implicit transactions; the writes below open theirs explicitly.
        self._db = sqlite3.connect(output_dir / STORE_FILE, check_same_thread=False, isolation_level=None)
        self._db.text_factory = decode_text
        try:
            with self._lock:
                self._db.execute("PRAGMA journal_mode=WAL")  # outside any transaction: the mode cannot change in one
                # In WAL mode NORMAL syncs at checkpoints, not at every commit: a commit survives the process dying (a
                # crash, SIGKILL), and only an OS crash or power loss can undo the last few (never corrupting the
                # file). FULL would fsync every progress write of a render: 3.4 ms each, measured, against 0.015 ms.
                self._db.execute("PRAGMA synchronous=NORMAL")
            with self._transaction() as db:
                db.execute(CREATE)
                present = {row[1] for row in db.execute("PRAGMA table_info(jobs)")}
                for c in COLUMNS:
                    if c.name not in present:
                        db.execute(f"ALTER TABLE jobs ADD COLUMN {definition(c, new_table=False)}")
            self.recovered = self._recover()
            self._write_missing_sidecars()
        except BaseException as err:
            self._db.close()
            if isinstance(err, sqlite3.Error):  # "database is locked": named, not SQLite's bare words after a load
                raise StoreUnavailable(output_dir / STORE_FILE, err) from err
            raise

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        """One transaction under the lock: BEGIN IMMEDIATE takes SQLite's write lock at the start (so another process
        on the same file fails or waits here, not halfway), COMMIT on success, ROLLBACK on any error."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
                self._db.execute("COMMIT")
            except BaseException:
                if self._db.in_transaction:  # SQLite has already rolled back after some errors
                    self._db.execute("ROLLBACK")
                raise

    def _read(self, sql: str, params: tuple = ()) -> list[tuple]:
        with self._lock:  # one statement: SQLite reads it from one snapshot
            return self._db.execute(sql, params).fetchall()

    def _entry(self, row: tuple) -> VideoJob | DamagedRecord:
        """A row (rowid first) as its record, or as a DamagedRecord, logged the first time it is met."""
        rowid, values = row[0], row[1:]
        try:
            return decode_row(values)
        except ValueError as err:
            job_id = row_id(rowid, values[0])
            with self._lock:
                first = rowid not in self._logged
                self._logged.add(rowid)
            if first:
                log.error(
                    "job store %s: the record of job %s (row %d) cannot be read: %s; it is listed as damaged "
                    "(h3serve store check, h3serve store rebuild)",
                    self.output_dir / STORE_FILE,
                    job_id,
                    rowid,
                    err,
                )
            message = f"the store's record of this job cannot be read ({err}); see h3serve store check"
            return DamagedRecord(id=job_id, error=JobError(code="damaged_record", message=message))

    def _recover(self) -> int:
        """Jobs left active by a previous process become failed; half-written MP4s (and sidecars) are removed."""
        assign, values = assignments(
            {
                "status": JobStatus.FAILED,
                "error": JobError(code="interrupted", message=INTERRUPTED),
                "completed_at": int(time.time()),
            }
        )
        with self._transaction() as db:
            n = db.execute(f"UPDATE jobs SET {assign} WHERE {STATUS_COLUMN} IN (?, ?)", (*values, *ACTIVE)).rowcount
        for partial in self.videos.glob(".*.tmp"):
            partial.unlink(missing_ok=True)
        # An MP4 no completed record names is what a stop left between two steps: a job killed after its MP4 was
        # renamed into place but before it was marked completed (failed above, its record names no file), or a DELETE
        # stopped between its record and its file. Neither is served; each is removed, as the DELETE or the failure
        # would have. A finished job's sidecar beside it means the store lost the record instead (`check_store`
        # refuses that before this runs), so such an MP4 is never touched here.
        completed_files = f"SELECT {column_of('file_name')} FROM jobs WHERE {STATUS_COLUMN}=?"
        named = {row[0] for row in self._read(completed_files, (JobStatus.COMPLETED,))}
        for mp4 in self.videos.glob("*.mp4"):
            if mp4.name not in named and not mp4.with_suffix(SIDECAR).exists():
                mp4.unlink(missing_ok=True)
        if n:
            log.warning("%d job(s) interrupted by the previous stop are marked failed", n)
        return n

    def _write_missing_sidecars(self) -> None:
        """A sidecar for every finished job that has none: the jobs a previous stop failed (`_recover`), a sidecar
        write that failed, and a store from before sidecars."""
        have = {p.stem for p in self.videos.glob(f"*{SIDECAR}")}
        finished = [s.value for s in FINISHED]
        rows = self._read(
            f"SELECT {ID_COLUMN} FROM jobs WHERE {STATUS_COLUMN} IN ({', '.join('?' * len(finished))})", finished
        )
        missing = [job_id for (job_id,) in rows if isinstance(job_id, str) and job_id not in have]
        for job_id in missing:
            self._finish_sidecar(job_id)
        if missing:
            log.info("wrote the record of %d finished job(s) beside their MP4s (videos/<id>%s)", len(missing), SIDECAR)

    def _finish_sidecar(self, job_id: str) -> None:
        """Write the sidecar of a finished job from its row, as committed. A failure is logged and not raised: the
        store holds the record, and the next start writes the missing sidecar."""
        rows = self._read(f"{SELECT} WHERE {ID_COLUMN}=?", (job_id,))
        if not rows:
            return
        record = self._entry(rows[0])
        if isinstance(record, DamagedRecord) or not JOB_ID.fullmatch(record.id):
            return
        try:
            write_sidecar(self.videos, record)
        except OSError as err:
            log.warning(
                "job %s: its record could not be written beside its MP4 (%s); the next start retries", job_id, err
            )

    def insert(self, job: VideoJob) -> None:
        values = [v for f in FIELDS for _, v in encode(f, getattr(job, f))]
        with self._transaction() as db:
            db.execute(INSERT, values)

    def update(self, job_id: str, **changes: Any) -> None:
        """Set fields of one record, by VideoJob field name (`error`: a JobError or None). A job that finishes here
        (completed, failed, cancelled) gets its sidecar, written after the commit."""
        if not changes:
            return
        assign, values = assignments(changes)
        finishing = changes.get("status") in FINISHED
        with self._records if finishing else contextlib.nullcontext():
            with self._transaction() as db:
                db.execute(f"UPDATE jobs SET {assign} WHERE {ID_COLUMN}=?", (*values, job_id))
            if finishing:
                self._finish_sidecar(job_id)

    def entry(self, job_id: str) -> VideoJob | DamagedRecord | None:
        """One job's record, a DamagedRecord if its row does not decode, or None."""
        rows = self._read(f"{SELECT} WHERE {ID_COLUMN}=?", (job_id,))
        return self._entry(rows[0]) if rows else None

    def get(self, job_id: str) -> VideoJob | None:
        """One job's record, or None; RecordDamaged if its row does not decode."""
        found = self.entry(job_id)
        if isinstance(found, DamagedRecord):
            raise RecordDamaged(found)
        return found

    def list(
        self, limit: int, after: str | None = None, oldest_first: bool = False
    ) -> tuple[list[VideoJob | DamagedRecord], bool]:
        """Newest first (or oldest first); `after` is the id of the last job of the previous page. Returns (jobs,
        has_more); a row that does not decode is a DamagedRecord in its place, the rest are served."""
        order, beyond = (OLDEST_FIRST, ">") if oldest_first else (NEWEST_FIRST, "<")
        if after is None:
            rows = self._read(f"{SELECT} {order} LIMIT ?", (limit + 1,))
        else:
            rows = self._read(
                f"{SELECT} WHERE ({CREATED_COLUMN}, rowid) {beyond} "
                f"(SELECT {CREATED_COLUMN}, rowid FROM jobs WHERE {ID_COLUMN}=?) {order} LIMIT ?",
                (after, limit + 1),
            )
        return [self._entry(r) for r in rows[:limit]], len(rows) > limit

    def delete(self, job_id: str) -> None:
        """Remove a record, its sidecar and its MP4 (the sidecar first: a stop halfway leaves a record without a
        sidecar, which the next start writes again, never a sidecar that would bring the deleted job back)."""
        with self._records:
            rows = self._read(f"SELECT {column_of('file_name')} FROM jobs WHERE {ID_COLUMN}=?", (job_id,))
            if JOB_ID.fullmatch(job_id):
                (self.videos / f"{job_id}{SIDECAR}").unlink(missing_ok=True)
            with self._transaction() as db:
                db.execute(f"DELETE FROM jobs WHERE {ID_COLUMN}=?", (job_id,))
        file_name = rows[0][0] if rows else None
        if file_name == f"{job_id}{MP4}":  # the job's own MP4 only, whatever its row says (`file_problem`)
            (self.videos / file_name).unlink(missing_ok=True)
        elif file_name:
            log.warning("job %s: its record named a file that is not its MP4; the file was left alone", job_id)

    def counts(self) -> dict[str, int]:
        found = dict(self._read(f"SELECT {STATUS_COLUMN}, COUNT(*) FROM jobs GROUP BY {STATUS_COLUMN}"))
        return {s.value: found.get(s.value, 0) for s in JobStatus}

    def path(self, job: VideoJob) -> Path | None:
        return self.videos / job.file_name if job.file_name else None

    def close(self) -> None:
        with self._lock:
            self._db.close()
        if self._owns_folder_lock:
            self._folder_lock.release()
