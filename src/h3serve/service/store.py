"""The job store: typed job records (`schemas.VideoJob`) in an embedded SQLite database next to the outputs.

The store lives in `output_dir/jobs.sqlite3`, the MP4s in `output_dir/videos/<id>.mp4` (server-chosen names: nothing a
client sends becomes a path). Every state change is committed before it is visible through the API, so a restart
loses nothing: completed jobs stay listable and downloadable, and a job that was queued or running when the process
died is marked failed with an error that says so.

The table is derived from `VideoJob`, the one statement of the record: one column per field, a nested record
(`error: JobError`) as one column per part (`error_code`, `error_message`), dicts and lists as JSON text. A field
added to `VideoJob` is a column of a new store, and an older store gains it on open (NULL in its old rows, read back
as the field's default). Every name that goes into SQL is a column of that list, checked once at import.

SQLite runs in WAL mode (readers never wait for the writer) with one connection behind a lock, shared by the event
loop's threadpool, the GPU worker (progress) and the encoder; writes are explicit transactions.
"""

from __future__ import annotations

import json
import logging
import re
import sqlite3
import threading
import time
import types
import typing
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from h3serve.config import FPS
from h3serve.pipeline.request import RenderRequest
from h3serve.service.schemas import JobError, JobStatus, VideoJob

log = logging.getLogger(__name__)

ACTIVE = (JobStatus.QUEUED, JobStatus.IN_PROGRESS)
INTERRUPTED = "the server stopped before this job finished (restart or crash); submit it again"
KEY = "id"  # the primary key: VideoJob.id
_NAME = re.compile(r"[a-z][a-z0-9_]*")  # what a column name may be: it is written into SQL, so nothing else is let in
# SQLite's type for a field's Python type, in this order (bool is an int, a StrEnum a str); dicts and lists are JSON.
_SQL_TYPES = ((int, "INTEGER"), (float, "REAL"), (str, "TEXT"))


@dataclass(frozen=True)
class Column:
    name: str  # the SQL column
    field: str  # the VideoJob field it stores
    part: str | None  # for a nested record's column, the part it holds: error_code is part "code" of field "error"
    sql_type: str
    json: bool  # a dict or a list, stored as JSON text
    required: bool  # the field admits no None: NOT NULL in a new table


def _unwrap(annotation: Any) -> tuple[Any, bool]:
    """(the type a field holds, whether it admits None) for `X` or `X | None`."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        kinds = [a for a in typing.get_args(annotation) if a is not types.NoneType]
        if len(kinds) != 1:
            raise TypeError(f"a job record field may be one type or that type | None, not {annotation}")
        return kinds[0], True
    return annotation, False


def _sql_type(field: str, kind: Any) -> tuple[str, bool]:
    """(SQLite type, stored as JSON) for one field's type."""
    if typing.get_origin(kind) in (dict, list) or kind in (dict, list):
        return "TEXT", True
    for python, sql in _SQL_TYPES:
        if isinstance(kind, type) and issubclass(kind, python):
            return sql, False
    raise TypeError(f"job record field {field!r} is a {kind}, which has no column type here")


def columns_of(model: type[BaseModel]) -> tuple[Column, ...]:
    """The table of a record model: its fields in order, nested records flattened one level, names checked."""
    columns = []
    for name, info in model.model_fields.items():
        kind, optional = _unwrap(info.annotation)
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            for part, sub in kind.model_fields.items():
                sql, is_json = _sql_type(f"{name}.{part}", _unwrap(sub.annotation)[0])
                columns.append(Column(f"{name}_{part}", name, part, sql, is_json, required=False))
        else:
            sql, is_json = _sql_type(name, kind)
            columns.append(Column(name, name, None, sql, is_json, required=not optional))
    names = [c.name for c in columns]
    for name in names:
        if not _NAME.fullmatch(name):
            raise ValueError(f"job record column {name!r} is not a plain lower-case name ({_NAME.pattern})")
    if len(set(names)) != len(names):
        raise ValueError(f"job record columns collide: {names}")
    return tuple(columns)


COLUMNS = columns_of(VideoJob)
FIELDS = tuple(dict.fromkeys(c.field for c in COLUMNS))  # VideoJob's fields, in order
_BY_FIELD = {f: tuple(c for c in COLUMNS if c.field == f) for f in FIELDS}


def _column(field: str) -> str:
    """The column of a plain field, for the fixed statements below; a field renamed in VideoJob fails at import."""
    found = _BY_FIELD.get(field, ())
    if len(found) != 1 or found[0].part is not None:
        raise ValueError(f"{field!r} is not a plain field of VideoJob (fields: {', '.join(FIELDS)})")
    return found[0].name


def _definition(c: Column, new_table: bool) -> str:
    if c.name == KEY:
        return f"{c.name} {c.sql_type} PRIMARY KEY NOT NULL"
    # ALTER TABLE cannot add a NOT NULL column without a default: an added column is nullable in an older store.
    return f"{c.name} {c.sql_type}" + (" NOT NULL" if c.required and new_table else "")


_ID, _STATUS, _CREATED = _column(KEY), _column("status"), _column("created_at")
_NAMES = ", ".join(c.name for c in COLUMNS)
_CREATE = f"CREATE TABLE IF NOT EXISTS jobs ({', '.join(_definition(c, new_table=True) for c in COLUMNS)})"
_INSERT = f"INSERT INTO jobs ({_NAMES}) VALUES ({', '.join('?' * len(COLUMNS))})"
_SELECT = f"SELECT {_NAMES} FROM jobs"
_NEWEST_FIRST = f"ORDER BY {_CREATED} DESC, rowid DESC"
_OLDEST_FIRST = f"ORDER BY {_CREATED} ASC, rowid ASC"


def _encode(field: str, value: Any) -> list[tuple[Column, Any]]:
    """The column values of one field's value (a nested record's parts, JSON for dicts and lists)."""
    pairs = []
    for c in _BY_FIELD[field]:
        if c.part is not None:
            part = None if value is None else getattr(value, c.part)
            pairs.append((c, part))
        elif c.json:
            pairs.append((c, None if value is None else json.dumps(value)))
        else:
            pairs.append((c, value))
    return pairs


def _decode(row: tuple) -> VideoJob:
    values: dict[str, Any] = {}
    for c, raw in zip(COLUMNS, row, strict=True):
        if raw is None:
            continue  # NULL: the field's default (a column an older store gained is NULL in its old rows)
        if c.part is not None:
            values.setdefault(c.field, {})[c.part] = raw
        else:
            values[c.field] = json.loads(raw) if c.json else raw
    return VideoJob(**values)


def _assignments(changes: dict[str, Any]) -> tuple[str, list[Any]]:
    """`col=?, ...` and its values for changes named by VideoJob field; an unknown name is refused, never written."""
    unknown = sorted(set(changes) - set(FIELDS))
    if unknown or KEY in changes:
        raise ValueError(f"cannot set {', '.join(unknown) or KEY} of a job record (fields: {', '.join(FIELDS)})")
    pairs = [pair for field, value in changes.items() for pair in _encode(field, value)]
    return ", ".join(f"{c.name}=?" for c, _ in pairs), [v for _, v in pairs]


def new_job_id() -> str:
    return f"video_gen_{uuid.uuid4().hex}"


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
    )


class JobStore:
    """The job records. Thread-safe: one connection behind a lock; every write is one transaction."""

    def __init__(self, output_dir: Path):
        self.output_dir = output_dir
        self.videos = output_dir / "videos"
        self.videos.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        # isolation_level=None: no implicit transactions; the writes below open theirs explicitly.
        self._db = sqlite3.connect(output_dir / "jobs.sqlite3", check_same_thread=False, isolation_level=None)
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")  # outside any transaction: the mode cannot change inside one
            # In WAL mode NORMAL syncs at checkpoints, not at every commit: a commit survives the process dying (a
            # crash, SIGKILL), and only an OS crash or power loss can undo the last few (never corrupting the file).
            # FULL would fsync every progress write of a render: 3.4 ms each, measured here, against 0.015 ms.
            self._db.execute("PRAGMA synchronous=NORMAL")
        with self._transaction() as db:
            db.execute(_CREATE)
            present = {row[1] for row in db.execute("PRAGMA table_info(jobs)")}
            for c in COLUMNS:
                if c.name not in present:
                    db.execute(f"ALTER TABLE jobs ADD COLUMN {_definition(c, new_table=False)}")
        self.recovered = self._recover()

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

    def _recover(self) -> int:
        """Jobs left active by a previous process become failed; half-written MP4s are removed."""
        assign, values = _assignments(
            {
                "status": JobStatus.FAILED,
                "error": JobError(code="interrupted", message=INTERRUPTED),
                "completed_at": int(time.time()),
            }
        )
        with self._transaction() as db:
            n = db.execute(f"UPDATE jobs SET {assign} WHERE {_STATUS} IN (?, ?)", (*values, *ACTIVE)).rowcount
        for partial in self.videos.glob(".*.tmp"):
            partial.unlink(missing_ok=True)
        if n:
            log.warning("%d job(s) interrupted by the previous stop are marked failed", n)
        return n

    def insert(self, job: VideoJob) -> None:
        values = [v for f in FIELDS for _, v in _encode(f, getattr(job, f))]
        with self._transaction() as db:
            db.execute(_INSERT, values)

    def update(self, job_id: str, **changes: Any) -> None:
        """Set fields of one record, by VideoJob field name (`error`: a JobError or None)."""
        if not changes:
            return
        assign, values = _assignments(changes)
        with self._transaction() as db:
            db.execute(f"UPDATE jobs SET {assign} WHERE {_ID}=?", (*values, job_id))

    def get(self, job_id: str) -> VideoJob | None:
        rows = self._read(f"{_SELECT} WHERE {_ID}=?", (job_id,))
        return _decode(rows[0]) if rows else None

    def list(self, limit: int, after: str | None = None, oldest_first: bool = False) -> tuple[list[VideoJob], bool]:
        """Newest first (or oldest first); `after` is the id of the last job of the previous page. Returns (jobs,
        has_more)."""
        order, beyond = (_OLDEST_FIRST, ">") if oldest_first else (_NEWEST_FIRST, "<")
        if after is None:
            rows = self._read(f"{_SELECT} {order} LIMIT ?", (limit + 1,))
        else:
            rows = self._read(
                f"{_SELECT} WHERE ({_CREATED}, rowid) {beyond} (SELECT {_CREATED}, rowid FROM jobs WHERE {_ID}=?) "
                f"{order} LIMIT ?",
                (after, limit + 1),
            )
        return [_decode(r) for r in rows[:limit]], len(rows) > limit

    def delete(self, job_id: str) -> None:
        """Remove a record and its MP4."""
        job = self.get(job_id)
        with self._transaction() as db:
            db.execute(f"DELETE FROM jobs WHERE {_ID}=?", (job_id,))
        if job is not None and job.file_name:
            (self.videos / job.file_name).unlink(missing_ok=True)

    def counts(self) -> dict[str, int]:
        found = dict(self._read(f"SELECT {_STATUS}, COUNT(*) FROM jobs GROUP BY {_STATUS}"))
        return {s.value: found.get(s.value, 0) for s in JobStatus}

    def path(self, job: VideoJob) -> Path | None:
        return self.videos / job.file_name if job.file_name else None

    def close(self) -> None:
        with self._lock:
            self._db.close()
