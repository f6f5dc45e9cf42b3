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
from typing import Any

from h3serve.config import FPS
from h3serve.pipeline.request import RenderRequest
from h3serve.service.schemas import JobStatus, VideoJob, adapter_uses
from h3serve.service.store.base import ACTIVE, INTERRUPTED, DamagedRecord, RecordDamaged, RecordStore
from h3serve.service.store.check import StoreUnavailable, refuse_damage
from h3serve.service.store.lock import SERVER, FolderLock
from h3serve.service.store.rows import (
    COLUMNS,
    CREATE,
    FIELDS,
    ID_COLUMN,
    INSERT,
    JOB_ID,
    SELECT,
    STATUS_COLUMN,
    STORE_FILE,
    assignments,
    column_of,
    decode_text,
    definition,
    encode,
)
from h3serve.service.store.sidecars import FINISHED, SIDECAR, write_sidecar

log = logging.getLogger(__name__)

__all__ = ["ACTIVE", "INTERRUPTED", "DamagedRecord", "JobStore", "RecordDamaged", "job_record"]


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


class JobStore(RecordStore):
    """The job records. Thread-safe: one connection behind a lock; every write is one transaction.

    The output folder's lock (`FolderLock`) is held from the open to `close`: a second server on the folder, or a
    rebuild, is refused (FolderBusy) rather than run beside this one. `lock`: one the caller holds already (a rebuild
    opening the store it built), used and left to the caller; without it the store takes its own.
    `check`: refuse a damaged store (StoreDamaged, as the start's check does) before anything is written to it.
    StoreUnavailable when another process holds SQLite's write lock on it."""

    MARK = "?"
    MEND = "h3serve store check, h3serve store rebuild"
    SEE = "see h3serve store check"

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

    def _read(self, sql: str, params: tuple | list = ()) -> list[tuple]:
        with self._lock:  # one statement: SQLite reads it from one snapshot
            return self._db.execute(sql, params).fetchall()

    @property
    def where(self) -> str:
        return str(self.output_dir / STORE_FILE)

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

    def delete(self, job_id: str) -> None:
        """Remove a record, its sidecar and its MP4 (the sidecar first: a stop halfway leaves a record without a
        sidecar, which the next start writes again, never a sidecar that would bring the deleted job back)."""
        with self._records:
            rows = self._read(f"SELECT {column_of('file_name')} FROM jobs WHERE {ID_COLUMN}=?", (job_id,))
            if JOB_ID.fullmatch(job_id):
                (self.videos / f"{job_id}{SIDECAR}").unlink(missing_ok=True)
            with self._transaction() as db:
                db.execute(f"DELETE FROM jobs WHERE {ID_COLUMN}=?", (job_id,))
        self._remove_own_mp4(job_id, rows[0][0] if rows else None)
