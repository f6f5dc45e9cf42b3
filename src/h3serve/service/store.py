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

Damage: the store is checked before it is opened (`inspect_store`: SQLite's integrity check, the `jobs` table's
columns, every row decoded) and a damaged one is refused (`StoreDamaged`), as is a store that lacks jobs the folder
holds (an empty store beside MP4s). Each finished job's record is also written beside its MP4, `videos/<id>.json`,
atomically, so that `rebuild_store` can make a new store from the folder. A row that goes bad while the server runs
is shown as a `DamagedRecord` (status `damaged`, logged once) and never takes the list down.

Nothing read back from the folder becomes a path unchecked: a job's file is `videos/<its id>.mp4` (a row or a record
naming any other file is damaged), a record file is read only if it is a regular file, not a link, of at most
RECORD_CAP bytes, and a `.json` in videos/ whose name is not a job id is no job's record (listed, never read).

One process at a time uses an output folder: a server's store and `rebuild_store` hold an exclusive lock on
`h3serve.lock` in it (`FolderLock`), so a rebuild never runs beside a server, nor two servers on one folder.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import sqlite3
import stat
import threading
import time
import types
import typing
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ValidationError

from h3serve.config import FPS
from h3serve.errors import shown
from h3serve.files import FileRefused, read_regular
from h3serve.pipeline.request import RenderRequest
from h3serve.service.schemas import JobError, JobStatus, VideoJob

log = logging.getLogger(__name__)

ACTIVE = (JobStatus.QUEUED, JobStatus.IN_PROGRESS)
FINISHED = (JobStatus.COMPLETED, JobStatus.FAILED, JobStatus.CANCELLED)  # the states whose record has a sidecar
STORE_FILE = "jobs.sqlite3"
SIDECAR = ".json"  # a finished job's record beside its MP4: videos/<id>.json
MP4 = ".mp4"
# A job id as `new_job_id` makes it (and always has): what a record file's name must be to be a job's record. Nothing
# else in videos/ is read as one, and only a name of this shape is ever written or removed there by id.
JOB_ID = re.compile(r"video_gen_[0-9a-f]{32}")
# The most bytes a record file may hold: the longest prompt (100,000 characters, H3_MAX_PROMPT_CHARS's bound) at 6
# bytes each (a control character as JSON writes it, \u0001) is 600 KB; the rest of a record is a few KB.
RECORD_CAP = 4 << 20
LOCK_FILE = "h3serve.lock"
# How long the start's probe of SQLite's write lock waits for a transaction another process holds open. No h3serve
# process can hold one (the folder's lock keeps them out): whoever does is a person's sqlite3 shell or a backup.
SQLITE_LOCK_WAIT_S = 1.0
# The range of SQLite's INTEGER: a record file's larger integer is refused rather than failing the rebuild's insert.
_INT64 = (-(1 << 63), (1 << 63) - 1)
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
_SELECT = f"SELECT rowid, {_NAMES} FROM jobs"  # the rowid names a row whose id cannot be read
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


class _NotText(bytes):
    """A TEXT value that is not UTF-8. The connection's text factory returns it instead of raising, so that one such
    value is its row's damage (`_decode` refuses it) rather than the failure of the whole query."""


def _text(raw: bytes) -> str | _NotText:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return _NotText(raw)


def _decode(row: tuple) -> VideoJob:
    """The record of one row; ValueError saying which column or field is wrong and how (never the value itself)."""
    values: dict[str, Any] = {}
    for c, raw in zip(COLUMNS, row, strict=True):
        if raw is None:
            continue  # NULL: the field's default (a column an older store gained is NULL in its old rows)
        if isinstance(raw, _NotText):
            raise ValueError(f"{c.name}: not UTF-8 text")
        if c.part is not None:
            values.setdefault(c.field, {})[c.part] = raw
        elif c.json:
            try:
                values[c.field] = json.loads(raw)
            except (ValueError, TypeError) as err:
                raise ValueError(f"{c.name}: not JSON ({err})") from err
        else:
            values[c.field] = raw
    try:
        job = VideoJob(**values)
    except ValidationError as err:
        problems = [f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors(include_input=False)]
        raise ValueError("; ".join(problems)) from err
    if (problem := _file_problem(job)) is not None:
        raise ValueError(problem)
    return job


# An id a row may hold: one plain file name's worth (the server's ids are JOB_ID; tests and older stores hold other
# plain names). Never a separator, a leading dot or an empty name: the id names `videos/<id>.mp4` and
# `previews/<id>.png`, so a row written by hand (or a restored store) must not name a path outside them.
PLAIN_ID = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,127}")


def _file_problem(job: VideoJob) -> str | None:
    """What is wrong with a record's id or `file_name` (None: nothing): the id is a plain name (PLAIN_ID), the file
    `<id>.mp4`, the name the server gives a job's MP4, or absent. Anything else (a path, `../x`, another job's MP4)
    would become a file served and deleted."""
    if not PLAIN_ID.fullmatch(job.id):
        return "id: not a plain name (letters, digits, '_', '-', '.'; no leading '.'), so never a path here"
    if job.file_name is None or job.file_name == f"{job.id}{MP4}":
        return None
    return f"file_name: not this job's MP4 (<its id>{MP4}), so never a path here"


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


def _row_id(rowid: int, raw: Any) -> str:
    return raw if isinstance(raw, str) else f"<row {rowid}>"  # the key itself unreadable: the row's number


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
        preview_every=request.preview_every,
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
                _refuse_damage(output_dir)
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
        self._db.text_factory = _text
        try:
            with self._lock:
                self._db.execute("PRAGMA journal_mode=WAL")  # outside any transaction: the mode cannot change in one
                # In WAL mode NORMAL syncs at checkpoints, not at every commit: a commit survives the process dying (a
                # crash, SIGKILL), and only an OS crash or power loss can undo the last few (never corrupting the
                # file). FULL would fsync every progress write of a render: 3.4 ms each, measured, against 0.015 ms.
                self._db.execute("PRAGMA synchronous=NORMAL")
            with self._transaction() as db:
                db.execute(_CREATE)
                present = {row[1] for row in db.execute("PRAGMA table_info(jobs)")}
                for c in COLUMNS:
                    if c.name not in present:
                        db.execute(f"ALTER TABLE jobs ADD COLUMN {_definition(c, new_table=False)}")
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
            return _decode(values)
        except ValueError as err:
            job_id = _row_id(rowid, values[0])
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
        # An MP4 no completed record names is what a stop left between two steps: a job killed after its MP4 was
        # renamed into place but before it was marked completed (failed above, its record names no file), or a DELETE
        # stopped between its record and its file. Neither is served; each is removed, as the DELETE or the failure
        # would have. A finished job's sidecar beside it means the store lost the record instead (`check_store`
        # refuses that before this runs), so such an MP4 is never touched here.
        named = {row[0] for row in self._read(f"SELECT {_column('file_name')} FROM jobs WHERE {_STATUS}=?",
                                              (JobStatus.COMPLETED,))}  # fmt: skip
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
        rows = self._read(f"SELECT {_ID} FROM jobs WHERE {_STATUS} IN ({', '.join('?' * len(finished))})", finished)
        missing = [job_id for (job_id,) in rows if isinstance(job_id, str) and job_id not in have]
        for job_id in missing:
            self._finish_sidecar(job_id)
        if missing:
            log.info("wrote the record of %d finished job(s) beside their MP4s (videos/<id>%s)", len(missing), SIDECAR)

    def _finish_sidecar(self, job_id: str) -> None:
        """Write the sidecar of a finished job from its row, as committed. A failure is logged and not raised: the
        store holds the record, and the next start writes the missing sidecar."""
        rows = self._read(f"{_SELECT} WHERE {_ID}=?", (job_id,))
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
        values = [v for f in FIELDS for _, v in _encode(f, getattr(job, f))]
        with self._transaction() as db:
            db.execute(_INSERT, values)

    def update(self, job_id: str, **changes: Any) -> None:
        """Set fields of one record, by VideoJob field name (`error`: a JobError or None). A job that finishes here
        (completed, failed, cancelled) gets its sidecar, written after the commit."""
        if not changes:
            return
        assign, values = _assignments(changes)
        finishing = changes.get("status") in FINISHED
        with self._records if finishing else contextlib.nullcontext():
            with self._transaction() as db:
                db.execute(f"UPDATE jobs SET {assign} WHERE {_ID}=?", (*values, job_id))
            if finishing:
                self._finish_sidecar(job_id)

    def entry(self, job_id: str) -> VideoJob | DamagedRecord | None:
        """One job's record, a DamagedRecord if its row does not decode, or None."""
        rows = self._read(f"{_SELECT} WHERE {_ID}=?", (job_id,))
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
        order, beyond = (_OLDEST_FIRST, ">") if oldest_first else (_NEWEST_FIRST, "<")
        if after is None:
            rows = self._read(f"{_SELECT} {order} LIMIT ?", (limit + 1,))
        else:
            rows = self._read(
                f"{_SELECT} WHERE ({_CREATED}, rowid) {beyond} (SELECT {_CREATED}, rowid FROM jobs WHERE {_ID}=?) "
                f"{order} LIMIT ?",
                (after, limit + 1),
            )
        return [self._entry(r) for r in rows[:limit]], len(rows) > limit

    def delete(self, job_id: str) -> None:
        """Remove a record, its sidecar and its MP4 (the sidecar first: a stop halfway leaves a record without a
        sidecar, which the next start writes again, never a sidecar that would bring the deleted job back)."""
        with self._records:
            rows = self._read(f"SELECT {_column('file_name')} FROM jobs WHERE {_ID}=?", (job_id,))
            if JOB_ID.fullmatch(job_id):
                (self.videos / f"{job_id}{SIDECAR}").unlink(missing_ok=True)
            with self._transaction() as db:
                db.execute(f"DELETE FROM jobs WHERE {_ID}=?", (job_id,))
        file_name = rows[0][0] if rows else None
        if file_name == f"{job_id}{MP4}":  # the job's own MP4 only, whatever its row says (`_file_problem`)
            (self.videos / file_name).unlink(missing_ok=True)
        elif file_name:
            log.warning("job %s: its record named a file that is not its MP4; the file was left alone", job_id)

    def counts(self) -> dict[str, int]:
        found = dict(self._read(f"SELECT {_STATUS}, COUNT(*) FROM jobs GROUP BY {_STATUS}"))
        return {s.value: found.get(s.value, 0) for s in JobStatus}

    def path(self, job: VideoJob) -> Path | None:
        return self.videos / job.file_name if job.file_name else None

    def close(self) -> None:
        with self._lock:
            self._db.close()
        if self._owns_folder_lock:
            self._folder_lock.release()


# ---- sidecars: each finished job's record beside its MP4 -----------------------------------------------------------
def write_sidecar(videos: Path, job: VideoJob) -> Path:
    """`videos/<id>.json`, written whole or not at all: a temporary file (named as `_recover` sweeps), fsynced, renamed
    over the old one, and the folder fsynced so that the rename itself survives a power loss."""
    path = videos / f"{job.id}{SIDECAR}"
    tmp = videos / f".{path.name}.{uuid.uuid4().hex}.tmp"
    try:
        with open(tmp, "xb") as out:
            out.write(job.model_dump_json().encode("utf-8"))
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    folder = os.open(videos, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)
    return path


def read_sidecar(path: Path) -> VideoJob:
    """A record file's record, read as a settings file is (`files.read_regular`): a regular file, never a link (the
    server writes none, and one would read a file outside videos/), nor a FIFO or a device, of at most RECORD_CAP
    bytes. Every field is checked: its name is a job id (JOB_ID) and the record's id, its status a finished one, its
    file name that job's MP4 (`_file_problem`), its values what the store can hold. ValueError saying what is wrong
    (FileRefused, one, for what the file is)."""
    if not JOB_ID.fullmatch(path.stem):
        raise ValueError(f"its name is not a job id ({JOB_ID.pattern}{SIDECAR})")
    raw = read_regular(path, RECORD_CAP, follow=False)
    try:
        job = VideoJob.model_validate_json(raw)
    except ValidationError as err:
        problems = [f"{'.'.join(map(str, e['loc'])) or 'file'}: {e['msg']}" for e in err.errors(include_input=False)]
        raise ValueError("; ".join(problems)) from err
    if job.id != path.stem:
        raise ValueError(f"holds the record of {shown(job.id)}, not of {path.stem}")
    if job.status not in FINISHED:
        raise ValueError(f"status {job.status}: only a finished job has a record beside its MP4")
    for problem in (_file_problem(job), _storable(job)):
        if problem is not None:
            raise ValueError(problem)
    return job


def _storable(job: VideoJob) -> str | None:
    """Why a record's values cannot be stored as they are (None: they can): an integer beyond SQLite's 64 bits, text
    that is not UTF-8 (a lone surrogate, which JSON's \\ud800 can spell). Checked before a rebuild's insert, which would
    fail on them."""
    for f in FIELDS:
        for c, value in _encode(f, getattr(job, f)):
            if isinstance(value, int) and not _INT64[0] <= value <= _INT64[1]:
                return f"{c.name}: an integer beyond SQLite's 64 bits"
            if isinstance(value, str):
                try:
                    value.encode("utf-8")
                except UnicodeEncodeError:
                    return f"{c.name}: not UTF-8 text (a lone surrogate)"
    return None


# ---- one process per output folder ------------------------------------------------------------------------------
SERVER, REBUILD, START_CHECK = "server", "store rebuild", "start check"  # who holds the lock, as its file says
_HOLDER = re.compile(rf"([0-9]{{1,10}}) ({SERVER}|{REBUILD}|{START_CHECK})\n")


class FolderBusy(ValueError):
    """The output folder's lock cannot be had: `path` is the lock file, `reason` why (without the path, which the
    text puts first), `holder` who holds it as it wrote itself there ("h3serve server, pid 12"), None when unknown or
    when the lock file itself is the problem."""

    def __init__(self, path: Path, reason: str, holder: str | None = None):
        self.path, self.reason, self.holder = path, reason, holder
        super().__init__(f"{path}: {reason}")


class FolderLock:
    """An exclusive `flock` on `output_dir/h3serve.lock`, held until `release` (or the end of a `with`): a server's
    store holds it for the server's life, `rebuild_store` for its run, the start's check for an instant (to see that
    no one holds it). So a rebuild never runs beside a server, `--force` or not, and a second server on one folder is
    refused at its check, before any weight loads. FolderBusy when another process (or another open in this one)
    holds it.

    flock, not SQLite's own locks: those last one transaction, and a rebuild replaces the very file they are taken
    on. The kernel drops a flock with its process (a crash, kill -9), so the file left behind means nothing and is
    never removed (removing it while another process waits on the old one would let two hold "the" lock). The holder
    writes `<pid> <role>` into it, for the refusal's text only. The file is opened without following a link."""

    def __init__(self, output_dir: Path, role: str):
        self.path = output_dir / LOCK_FILE
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
        try:
            fd = os.open(self.path, flags, 0o644)
        except OSError as err:
            raise FolderBusy(self.path, f"the output folder's lock file cannot be opened ({_why(err)})") from None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise FolderBusy(self.path, "is not a regular file; h3serve's lock file is: remove what is there")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                found = _HOLDER.fullmatch(os.pread(fd, 64, 0).decode("ascii", "replace"))
                holder = f"h3serve {found[2]}, pid {found[1]}" if found else None
                raise FolderBusy(
                    self.path,
                    f"the output folder is in use by {holder or 'another h3serve process'}, which holds this lock "
                    "while it runs: one process uses an output folder at a time; stop that one first, or use another "
                    "output folder",
                    holder,
                ) from None
            except OSError as err:
                raise FolderBusy(self.path, f"the output folder's lock cannot be taken ({_why(err)})") from None
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()} {role}\n".encode("ascii"), 0)
        except BaseException:
            os.close(fd)
            raise
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)  # the lock goes with the file's last descriptor

    def __enter__(self) -> FolderLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _why(err: OSError) -> str:
    return err.strerror or type(err).__name__


class StoreUnavailable(ValueError):
    """The store cannot be opened for writing: `path`, and `reason` (SQLite's words). `locked`: another process holds
    SQLite's write lock on it, which no h3serve process does while it is refused (the folder's lock keeps them out)."""

    def __init__(self, path: Path, err: sqlite3.Error):
        self.path, self.reason = path, str(err)
        self.locked = (getattr(err, "sqlite_errorcode", 0) & 0xFF) in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)
        if self.locked:
            text = (
                f"locked by another process ({self.reason}); it is no h3serve server's: close whatever holds it in a "
                "transaction (a sqlite3 shell, a backup tool), then start again"
            )
        else:
            text = f"cannot be opened for writing ({self.reason})"
        super().__init__(f"{path}: {text}")


# ---- the check at start, and the report of `h3serve store check` ---------------------------------------------------
@dataclass(frozen=True)
class DamagedRow:
    rowid: int
    job_id: str
    why: str


@dataclass
class StoreReport:
    """What `inspect_store` found in an output folder. `problem`: what is wrong with the file as a whole (not SQLite,
    the integrity check, a foreign `jobs` table); `folder_problem`: with videos/ (not a folder); the rest is per job."""

    path: Path
    exists: bool
    integrity: str = "not run"  # "ok", or the integrity check's first findings
    problem: str | None = None
    folder_problem: str | None = None
    rows: int = 0
    ids: set[str] = field(default_factory=set)  # the ids of the rows read
    damaged: list[DamagedRow] = field(default_factory=list)
    mp4s: list[str] = field(default_factory=list)  # ids of videos/<id>.mp4
    sidecars: list[str] = field(default_factory=list)  # ids of videos/<id>.json, named by a job id (JOB_ID)
    ignored: list[str] = field(default_factory=list)  # names of the other videos/*.json: no job's record, never read
    missing_mp4s: list[str] = field(default_factory=list)  # completed records whose MP4 is not on disk

    @property
    def unrecorded_mp4s(self) -> list[str]:
        return [i for i in self.mp4s if i not in self.ids]

    @property
    def unrecorded_sidecars(self) -> list[str]:
        """Finished jobs the folder holds and the store lacks: what a lost or replaced store lost."""
        return [i for i in self.sidecars if i not in self.ids]

    def refusals(self) -> list[str]:
        """Why a start is refused: a damaged file or row, videos/ not a folder, or jobs the folder holds that the store
        lacks (an empty store beside MP4s included). An MP4 a job record names that is gone is not: its download says
        so (410); nor is a .json whose name is no job id (`ignored`)."""
        out = [self.problem] if self.problem else []
        if self.folder_problem:
            out.append(self.folder_problem)
        if self.damaged:
            shown_rows = "; ".join(f"row {d.rowid} (id {d.job_id[:80]}): {d.why}" for d in self.damaged[:3])
            out.append(f"{len(self.damaged)} job record(s) cannot be read: {shown_rows}")
        if self.problem is None:
            lost = self.unrecorded_sidecars
            if lost:
                out.append(
                    f"{len(lost)} finished job(s) have their record in videos/ but not in the store (e.g. {lost[0]})"
                )
            if self.rows == 0 and self.mp4s:
                out.append(f"the store holds no jobs but videos/ holds {len(self.mp4s)} MP4(s)")
        return out

    def lines(self) -> list[str]:
        """The report `h3serve store check` prints."""
        state = "absent (a new store is made at start)" if not self.exists else f"{self.path.stat().st_size} bytes"
        out = [f"store: {self.path} ({state})", f"integrity: {self.integrity}"]
        if self.problem:
            out.append(f"damaged: {self.problem}")
        if self.folder_problem:
            out.append(f"damaged: {self.folder_problem}")
        out.append(f"rows: {self.rows} ({len(self.damaged)} damaged)")
        out += [f"  damaged row {d.rowid} (id {d.job_id[:80]}): {d.why}" for d in self.damaged]
        out.append(f"MP4s: {len(self.mp4s)}; records beside them: {len(self.sidecars)}")
        out += [f"  MP4 without a record in the store: videos/{i}.mp4" for i in self.unrecorded_mp4s]
        out += [f"  record in videos/ the store lacks: videos/{i}{SIDECAR}" for i in self.unrecorded_sidecars]
        out += [f"  completed record whose MP4 is missing: {i}" for i in self.missing_mp4s]
        out += [f"  ignored: {_in_videos(name)} (its name is no job id: no job's record)" for name in self.ignored]
        refusals = self.refusals()
        out.append("verdict: " + ("damaged: " + "; ".join(refusals) if refusals else "sound"))
        return out


class StoreDamaged(ValueError):
    """A store that must not be opened as it is: its text names the file and what is wrong; `report` has the rest."""

    def __init__(self, report: StoreReport):
        super().__init__(
            f"{report.path}: {'; '.join(report.refusals())}. Nothing was changed; `h3serve store check` lists what is "
            "wrong, `h3serve store rebuild` moves this store aside and rebuilds it from the job records in videos/"
        )
        self.report = report


def _in_videos(name: str) -> str:
    """A file of videos/ as a report names it: quoted, as an echo is (a name may hold a newline, or be long)."""
    return shown(f"videos/{name}")


def _listing(videos: Path, report: StoreReport) -> None:
    """The MP4s, the job records and the other .json files of videos/ into `report` (names only: nothing is opened);
    videos/ that is there and no folder is `report.folder_problem`."""
    if not videos.is_dir():
        if videos.exists() or videos.is_symlink():
            report.folder_problem = (
                f"{videos} is not a folder (the MP4s and their records belong in it): move it aside, and the start "
                "makes the folder"
            )
        return
    try:
        names = sorted(p.name for p in videos.iterdir() if not p.name.startswith("."))  # "." names: temporary files
    except OSError as err:
        report.folder_problem = f"{videos} cannot be listed ({_why(err)})"
        return
    report.mp4s = [n[: -len(MP4)] for n in names if n.endswith(MP4)]
    records = [n for n in names if n.endswith(SIDECAR)]
    report.sidecars = [n[: -len(SIDECAR)] for n in records if JOB_ID.fullmatch(n[: -len(SIDECAR)])]
    report.ignored = [n for n in records if not JOB_ID.fullmatch(n[: -len(SIDECAR)])]


def _foreign(db: sqlite3.Connection) -> str | None:
    """What makes a `jobs` table not this service's (None when it is ours, or an older version of ours): a column we do
    not know, one of ours of another type, or a field every record has (and so every version's table) missing."""
    table = {row[1]: (str(row[2]).upper(), row[5]) for row in db.execute("PRAGMA table_info(jobs)")}
    ours = {c.name: c for c in COLUMNS}
    unknown = sorted(set(table) - set(ours))
    if unknown:
        return f"its jobs table is not h3serve's: columns {', '.join(unknown)[:200]} are not a job record's"
    kinds = [
        f"{n} is {kind or 'untyped'}, not {ours[n].sql_type}"
        for n, (kind, _) in table.items()
        if kind != ours[n].sql_type
    ]
    if kinds:
        return f"its jobs table is not h3serve's: {'; '.join(kinds)}"
    needed = [c.name for c in COLUMNS if c.part is None and VideoJob.model_fields[c.field].is_required()]
    missing = [n for n in needed if n not in table]
    if missing:
        return f"its jobs table is not h3serve's: it has no {', '.join(missing)} column"
    if table[KEY][1] != 1:
        return f"its jobs table is not h3serve's: {KEY} is not its primary key"
    return None


def _read_rows(db: sqlite3.Connection, report: StoreReport) -> list[VideoJob]:
    """Every row that can be read, decoded; the others into `report.damaged`. One at a time, so that a damaged page
    ends the reading there, with what came before it kept."""
    present = {row[1] for row in db.execute("PRAGMA table_info(jobs)")}
    names = ", ".join(c.name if c.name in present else "NULL" for c in COLUMNS)  # an older store's missing columns
    jobs = []
    cursor = db.execute(f"SELECT rowid, {names} FROM jobs")
    while True:
        try:
            row = cursor.fetchone()
        except sqlite3.DatabaseError as err:
            report.problem = report.problem or f"reading its rows failed after {report.rows} ({err})"
            break
        if row is None:
            break
        report.rows += 1
        try:
            job = _decode(row[1:])
        except ValueError as err:
            report.damaged.append(DamagedRow(row[0], _row_id(row[0], row[1]), str(err)))
            if isinstance(row[1], str):
                report.ids.add(row[1])  # a damaged row is still a record of that id: its files are not "unrecorded"
            continue
        report.ids.add(job.id)
        jobs.append(job)
    return jobs


def inspect_store(output_dir: Path, rows: list[VideoJob] | None = None) -> StoreReport:
    """Check the store in `output_dir` without changing it (read-only: a leftover WAL is read, not merged; SQLite may
    add the -wal and -shm files a WAL database keeps beside it).

    The integrity check is SQLite's full `PRAGMA integrity_check`, not `quick_check`: quick_check skips verifying
    that the primary key's index agrees with the table, and `get` finds a job by that index (an index that disagrees
    loses a job that the list still shows). It is small here: 34 ms for 10,000 records (7 MB), measured on this
    project's 2-core test machine, against 6 ms for quick_check. `rows`: when given, the records read are appended
    (for `rebuild_store`)."""
    path = output_dir / STORE_FILE
    videos = output_dir / "videos"
    report = StoreReport(path=path, exists=path.exists())
    _listing(videos, report)
    if not report.exists:
        return report
    if not path.is_file():  # a FIFO would hold SQLite's open forever
        report.problem = "is not a regular file (a folder, a FIFO or a device is in its place)"
        return report
    try:
        db = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
    except sqlite3.Error as err:
        report.problem = f"cannot be opened ({err})"
        return report
    db.text_factory = _text
    try:
        try:
            found = [str(r[0]) for r in db.execute("PRAGMA integrity_check(20)")]
        except sqlite3.DatabaseError as err:  # damage the check stops on ("database disk image is malformed")
            found = [str(err)]
        report.integrity = "ok" if found == ["ok"] else "; ".join(found[:5])
        if found != ["ok"]:
            report.problem = f"SQLite's integrity check failed: {report.integrity}"
        tables = [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")]
        if "jobs" not in tables:
            if tables and report.problem is None:
                report.problem = f"it is not h3serve's store: no jobs table (tables: {', '.join(tables)[:200]})"
            return report
        foreign = _foreign(db)
        if foreign is not None:
            report.problem = report.problem or foreign
            return report
        jobs = _read_rows(db, report)
        if rows is not None:
            rows.extend(jobs)
        report.missing_mp4s = [
            j.id
            for j in jobs
            if j.status == JobStatus.COMPLETED and j.file_name and not (videos / j.file_name).is_file()
        ]
    except sqlite3.DatabaseError as err:  # "file is not a database", "database disk image is malformed"
        report.problem = report.problem or f"not a readable SQLite database ({err})"
    finally:
        db.close()
    return report


def check_store(output_dir: Path) -> StoreReport:
    """The start's check, before any weight loads; its report, or a ValueError naming the file and what is wrong:
    FolderBusy when another h3serve process (a server, a rebuild) uses the folder, StoreDamaged when the store must
    not be opened as it is, StoreUnavailable when another process holds SQLite's write lock on it (a sqlite3 shell in
    a transaction), which the server's first write would otherwise wait on, then fail, after the model had loaded."""
    if output_dir.is_dir():
        FolderLock(output_dir, START_CHECK).release()  # free now; the server's store takes it for good
    report = _refuse_damage(output_dir)
    path = output_dir / STORE_FILE
    if path.is_file():
        # Opened for writing and a write transaction begun and rolled back: nothing is written. After the check
        # above, so that a damaged store is never opened but read-only.
        try:
            db = sqlite3.connect(path, timeout=SQLITE_LOCK_WAIT_S, isolation_level=None)
            try:
                db.execute("BEGIN IMMEDIATE")
                db.execute("ROLLBACK")
            finally:
                db.close()
        except sqlite3.Error as err:
            raise StoreUnavailable(path, err) from None
    return report


def _refuse_damage(output_dir: Path) -> StoreReport:
    """StoreDamaged if the store must not be opened as it is; else its report."""
    report = inspect_store(output_dir)
    if report.refusals():
        raise StoreDamaged(report)
    return report


# ---- rebuild ---------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Skipped:
    """A file of videos/ the rebuild did not take: `name` (in videos/), and `why`."""

    name: str
    why: str


@dataclass
class Rebuilt:
    moved: list[Path]  # the old store's files, moved aside
    from_sidecars: int
    from_rows: int  # jobs no sidecar held, taken from the old store's readable rows
    lost: list[DamagedRow]  # damaged rows no sidecar held: still in the moved-aside store
    bad_sidecars: list[Skipped]  # job records that did not read, or did not pass their checks: moved to `unrecorded`
    ignored: list[str]  # videos/*.json whose name is no job id: no job's record, left where they are
    unrecorded: Path | None  # where MP4s with no record at all (and the bad records) were moved
    not_moved: list[Skipped] = field(default_factory=list)  # files that could not be moved there

    def lines(self, store: Path) -> list[str]:
        out = [f"moved aside: {p}" for p in self.moved]
        out.append(
            f"rebuilt {store}: {self.from_sidecars + self.from_rows} job(s), {self.from_sidecars} from the records in "
            f"videos/, {self.from_rows} from the old store's readable rows"
        )
        out += [f"  not recovered: row {d.rowid} (id {d.job_id[:80]}): {d.why}" for d in self.lost]
        out += [f"  record skipped: {_in_videos(s.name)}: {s.why}" for s in self.bad_sidecars]
        out += [f"  ignored: {_in_videos(name)} (its name is no job id: no job's record)" for name in self.ignored]
        if self.unrecorded is not None:
            out.append(f"MP4s with no record anywhere, and records that were skipped, moved to {self.unrecorded}")
        out += [f"  not moved: {_in_videos(s.name)}: {s.why}" for s in self.not_moved]
        return out


def rebuild_store(output_dir: Path, now: float | None = None, *, lock: FolderLock | None = None) -> Rebuilt:
    """A new store from the folder: every job record in videos/ that passes `read_sidecar`'s checks, and every
    readable row of the old store that no record holds (a job that had not finished: the new store's first open marks
    it failed, interrupted). The old store's files are moved aside as `jobs.sqlite3.damaged-<UTC time>` (and its -wal,
    -shm), never deleted; MP4s that no record names (or that are no regular file), and records that were skipped, are
    moved to `unrecorded-<UTC time>/`, so that the folder the new store describes is consistent (and its next start is
    not refused). A .json whose name is no job id is left alone.

    Everything is read and checked before anything changes; the new store is built under a temporary name in the
    folder and renamed into place only when complete (a failure before leaves the old store as it was, and removes
    the temporary one). What can fail after (a file that cannot be moved) is listed, never raised halfway.

    Holds the folder's lock (FolderBusy while a server or another rebuild holds it; `lock`: the caller's, held
    already). FileRefused, with nothing changed, when videos/ is there and no folder."""
    with contextlib.nullcontext(lock) if lock is not None else FolderLock(output_dir, REBUILD):
        return _rebuild(output_dir, now)


def _rebuild(output_dir: Path, now: float | None) -> Rebuilt:
    path, videos = output_dir / STORE_FILE, output_dir / "videos"
    if (videos.exists() or videos.is_symlink()) and not videos.is_dir():
        raise FileRefused(videos, "is not a folder: move it aside; the MP4s and their records belong in a folder there")
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))
    taken = (f"{STORE_FILE}.damaged-{stamp}", f"unrecorded-{stamp}")
    if any((output_dir / name).exists() for name in taken):  # a second rebuild within the second: never replace
        stamp = f"{stamp}-{uuid.uuid4().hex[:8]}"
    videos.mkdir(parents=True, exist_ok=True)
    rows: list[VideoJob] = []
    report = inspect_store(output_dir, rows)
    records: dict[str, VideoJob] = {}
    bad: list[Skipped] = []
    for job_id in report.sidecars:
        name = f"{job_id}{SIDECAR}"
        try:
            records[job_id] = read_sidecar(videos / name)
        except FileRefused as err:
            bad.append(Skipped(name, err.reason))
        except (ValueError, OSError) as err:
            bad.append(Skipped(name, str(err)))
    from_sidecars = len(records)
    from_rows = 0
    for job in rows:  # a sidecar is the finished record as committed: it wins over a row read from a damaged file
        if job.id not in records:
            records[job.id] = job
            from_rows += 1
    lost = [d for d in report.damaged if d.job_id not in records]
    # The MP4s the new store names: regular files only (a link would serve a file outside videos/).
    named = {j.file_name for j in records.values() if j.file_name and _regular(videos / j.file_name)}

    building = output_dir / f".{STORE_FILE}.rebuild-{stamp}.tmp"
    building.unlink(missing_ok=True)
    try:
        db = sqlite3.connect(building, isolation_level=None)
        try:
            db.execute("BEGIN")
            db.execute(_CREATE)
            for job in sorted(records.values(), key=lambda j: (j.created_at, j.id)):  # rowid order: creation order
                db.execute(_INSERT, [v for f in FIELDS for _, v in _encode(f, getattr(job, f))])
            db.execute("COMMIT")
        finally:
            db.close()
    except BaseException:
        for leftover in (building, building.with_name(f"{building.name}-journal")):
            leftover.unlink(missing_ok=True)
        raise
    pairs: list[tuple[Path, Path]] = []  # (the old store's file, where it went)
    # Every file SQLite keeps beside a store goes with it: a hot rollback journal left beside the new store would be
    # played back into it on its first open. A move that fails puts back what was moved (the old store whole again).
    try:
        for suffix in ("", "-wal", "-shm", "-journal"):
            old = output_dir / f"{STORE_FILE}{suffix}"
            if old.exists() or old.is_symlink():
                aside = output_dir / f"{STORE_FILE}.damaged-{stamp}{suffix}"
                os.replace(old, aside)
                pairs.append((old, aside))
        os.replace(building, path)
    except OSError:
        for old, aside in reversed(pairs):
            with contextlib.suppress(OSError):
                os.replace(aside, old)
        building.unlink(missing_ok=True)
        raise
    moved = [aside for _, aside in pairs]

    stray = [f"{i}{MP4}" for i in report.mp4s if f"{i}{MP4}" not in named]
    stray += [s.name for s in bad]
    unrecorded, not_moved = None, []
    if stray:
        unrecorded = output_dir / f"unrecorded-{stamp}"
        try:
            unrecorded.mkdir()
        except OSError as err:
            not_moved = [Skipped(name, f"{unrecorded} cannot be made ({_why(err)})") for name in stray]
            stray = []
        for name in stray:
            try:
                os.replace(videos / name, unrecorded / name)  # a rename: the file itself is never opened
            except OSError as err:
                not_moved.append(Skipped(name, _why(err)))
    return Rebuilt(moved, from_sidecars, from_rows, lost, bad, report.ignored, unrecorded, not_moved)


def _regular(path: Path) -> bool:
    """A regular file, not a link to one."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False
