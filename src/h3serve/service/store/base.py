"""What the two job stores share (`RecordStore`): reading a row as its record (or a `DamagedRecord`), one job's entry,
the paged list, the counts by state, the start's recovery (jobs left active failed, half-written and unnamed MP4s
removed) and a delete's removal of the job's own MP4. `jobs.JobStore` (SQLite) and `postgres.PostgresJobStore` are
this class with what really differs between them: the driver's placeholder (`MARK`), the row-number column
(`ROWID`), how a statement runs (`_read`, `_transaction`) and the words that point a person at the mending tool.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel

from h3serve.service.schemas import JobError, JobStatus, VideoJob
from h3serve.service.store.lock import FolderLock
from h3serve.service.store.rows import (
    COLUMNS,
    CREATED_COLUMN,
    ID_COLUMN,
    MP4,
    NEWEST_FIRST,
    OLDEST_FIRST,
    STATUS_COLUMN,
    assignments,
    column_of,
    decode_row,
    row_id,
)
from h3serve.service.store.sidecars import SIDECAR

log = logging.getLogger(__name__)

ACTIVE = (JobStatus.QUEUED, JobStatus.IN_PROGRESS)
INTERRUPTED = "the server stopped before this job finished (restart or crash); submit it again"
_NAMES = ", ".join(c.name for c in COLUMNS)


class DamagedRecord(BaseModel):
    """What the API shows for a row that does not decode: its id, status `damaged`, and why in `error` (code
    `damaged_record`). Not a VideoJob: a client that reads the status sees at once that this is no job state."""

    id: str
    object: str = "video"
    status: Literal["damaged"] = "damaged"
    error: JobError


class RecordDamaged(ValueError):
    """`get` of a job whose row does not decode: `record` says which and why."""

    def __init__(self, record: DamagedRecord):
        super().__init__(record.error.message)
        self.record = record


def plain(value: Any) -> Any:
    """A value as either driver takes it: an enum as its value (JobStatus is a StrEnum)."""
    return value.value if isinstance(value, enum.Enum) else value


class RecordStore:
    """The job records' reads and the start's recovery, over a connection behind `_lock`. A subclass sets the class
    attributes and `_read`/`_transaction`, and in its open sets `output_dir`, `videos`, `_lock`, `_logged`, `_db`,
    `_folder_lock` and `_owns_folder_lock`."""

    MARK: ClassVar[str]  # the driver's placeholder: SQLite's `?`, psycopg's `%s`
    ROWID: ClassVar[str] = "rowid"  # the row number (`rows.NEWEST_FIRST` orders by it): SQLite's implicit column,
    # PostgreSQL's identity column of the same name
    ROW_WORD: ClassVar[str] = "row"  # how a log line names a row number
    MEND: ClassVar[str]  # the log's pointer to the tool that mends a damaged row
    SEE: ClassVar[str]  # a damaged record's message's pointer, for a client

    output_dir: Path
    videos: Path
    recovered: int
    _lock: threading.Lock
    _logged: set[int]
    _db: Any
    _folder_lock: FolderLock
    _owns_folder_lock: bool

    @property
    def where(self) -> str:
        """The store as a log line names it."""
        raise NotImplementedError

    def _read(self, sql: str, params: tuple | list = ()) -> list[tuple]:
        raise NotImplementedError

    def _transaction(self) -> AbstractContextManager[Any]:
        raise NotImplementedError

    @property
    def _select(self) -> str:
        return f"SELECT {self.ROWID}, {_NAMES} FROM jobs"

    def _entry(self, row: tuple) -> VideoJob | DamagedRecord:
        """A row (its row number first) as its record, or as a DamagedRecord, logged the first time it is met."""
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
                    "job store %s: the record of job %s (%s %d) cannot be read: %s; it is listed as damaged (%s)",
                    self.where,
                    job_id,
                    self.ROW_WORD,
                    rowid,
                    err,
                    self.MEND,
                )
            message = f"the store's record of this job cannot be read ({err}); {self.SEE}"
            return DamagedRecord(id=job_id, error=JobError(code="damaged_record", message=message))

    def _recover(self) -> int:
        """Jobs left active by a previous process become failed (`_left_active`: which); half-written MP4s are
        removed, and so is an MP4 no completed record names."""
        assign, values = assignments(
            {
                "status": JobStatus.FAILED,
                "error": JobError(code="interrupted", message=INTERRUPTED),
                "completed_at": int(time.time()),
            },
            mark=self.MARK,
        )
        where, params = self._left_active()
        with self._transaction() as db:
            n = db.execute(f"UPDATE jobs SET {assign} WHERE {where}", [*map(plain, values), *params]).rowcount
        for partial in self.videos.glob(".*.tmp"):
            partial.unlink(missing_ok=True)
        # An MP4 no completed record names is what a stop left between two steps: a job killed after its MP4 was
        # renamed into place but before it was marked completed (failed above, its record names no file), or a DELETE
        # stopped between its record and its file. Neither is served; each is removed, as the DELETE or the failure
        # would have. A finished job's sidecar beside it means the store lost the record instead (SQLite's
        # `check_store` refuses that before this runs), so such an MP4 is never touched here.
        completed = f"SELECT {column_of('file_name')} FROM jobs WHERE {STATUS_COLUMN}={self.MARK}"
        named = {row[0] for row in self._read(completed, (JobStatus.COMPLETED.value,))}
        for mp4 in self.videos.glob("*.mp4"):
            if mp4.name not in named and not mp4.with_suffix(SIDECAR).exists():
                mp4.unlink(missing_ok=True)
        if n:
            log.warning("%d job(s) interrupted by the previous stop are marked failed", n)
        return n

    def _left_active(self) -> tuple[str, list[Any]]:
        """The condition (and its values) of the rows `_recover` fails: every active one, in a store one process
        uses."""
        return f"{STATUS_COLUMN} IN ({self.MARK}, {self.MARK})", [plain(s) for s in ACTIVE]

    def _remove_own_mp4(self, job_id: str, file_name: Any) -> None:
        """After a delete: the job's own MP4 only, whatever its row said (`rows.file_problem`)."""
        if file_name == f"{job_id}{MP4}":
            (self.videos / file_name).unlink(missing_ok=True)
        elif file_name:
            log.warning("job %s: its record named a file that is not its MP4; the file was left alone", job_id)

    def entry(self, job_id: str) -> VideoJob | DamagedRecord | None:
        """One job's record, a DamagedRecord if its row does not decode, or None."""
        rows = self._read(f"{self._select} WHERE {ID_COLUMN}={self.MARK}", (job_id,))
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
        m = self.MARK
        if after is None:
            rows = self._read(f"{self._select} {order} LIMIT {m}", (limit + 1,))
        else:
            rows = self._read(
                f"{self._select} WHERE ({CREATED_COLUMN}, {self.ROWID}) {beyond} "
                f"(SELECT {CREATED_COLUMN}, {self.ROWID} FROM jobs WHERE {ID_COLUMN}={m}) {order} LIMIT {m}",
                (after, limit + 1),
            )
        return [self._entry(r) for r in rows[:limit]], len(rows) > limit

    def counts(self) -> dict[str, int]:
        found = dict(self._read(f"SELECT {STATUS_COLUMN}, COUNT(*) FROM jobs GROUP BY {STATUS_COLUMN}"))
        return {s.value: found.get(s.value, 0) for s in JobStatus}

    def path(self, job: VideoJob) -> Path | None:
        return self.videos / job.file_name if job.file_name else None

    def close(self) -> None:
        with self._lock:
            self._db.close()  # (PostgreSQL: the session's advisory lock goes with it)
        if self._owns_folder_lock:
            self._folder_lock.release()
