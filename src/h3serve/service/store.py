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
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import sqlite3
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
from h3serve.pipeline.request import RenderRequest
from h3serve.service.schemas import JobError, JobStatus, VideoJob

log = logging.getLogger(__name__)

ACTIVE = (JobStatus.QUEUED, JobStatus.IN_PROGRESS)
FINISHED = (JobStatus.COMPLETED, JobStatus.FAILED, JobStatus.CANCELLED)  # the states whose record has a sidecar
STORE_FILE = "jobs.sqlite3"
SIDECAR = ".json"  # a finished job's record beside its MP4: videos/<id>.json
# What a sidecar's name may be: ids are the server's (new_job_id), but a name read back from a folder is checked anyway.
_SAFE_ID = re.compile(r"[A-Za-z0-9_-]{1,200}")
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
        return VideoJob(**values)
    except ValidationError as err:
        problems = [f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors(include_input=False)]
        raise ValueError("; ".join(problems)) from err


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

    `check`: refuse a damaged store (`check_store`) before anything is written to it; off only for `rebuild_store`'s
    new, empty one."""

    def __init__(self, output_dir: Path, *, check: bool = True):
        if check:
            check_store(output_dir)
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
        self._write_missing_sidecars()

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
        if isinstance(record, DamagedRecord) or not _SAFE_ID.fullmatch(record.id):
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
            if _SAFE_ID.fullmatch(job_id):
                (self.videos / f"{job_id}{SIDECAR}").unlink(missing_ok=True)
            with self._transaction() as db:
                db.execute(f"DELETE FROM jobs WHERE {_ID}=?", (job_id,))
        file_name = rows[0][0] if rows else None
        if isinstance(file_name, str) and file_name:
            (self.videos / file_name).unlink(missing_ok=True)

    def counts(self) -> dict[str, int]:
        found = dict(self._read(f"SELECT {_STATUS}, COUNT(*) FROM jobs GROUP BY {_STATUS}"))
        return {s.value: found.get(s.value, 0) for s in JobStatus}

    def path(self, job: VideoJob) -> Path | None:
        return self.videos / job.file_name if job.file_name else None

    def close(self) -> None:
        with self._lock:
            self._db.close()


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
    """A sidecar's record; ValueError saying what is wrong with it (a name that is not its id's included)."""
    try:
        job = VideoJob.model_validate_json(path.read_bytes())
    except ValidationError as err:
        problems = [f"{'.'.join(map(str, e['loc'])) or 'file'}: {e['msg']}" for e in err.errors(include_input=False)]
        raise ValueError("; ".join(problems)) from err
    if job.id != path.stem or not _SAFE_ID.fullmatch(job.id):
        raise ValueError(f"holds the record of {job.id[:80]!r}, not of {path.stem!r}")
    if job.status not in FINISHED:
        raise ValueError(f"status {job.status}: only a finished job has a sidecar")
    return job


# ---- the check at start, and the report of `h3serve store check` ---------------------------------------------------
@dataclass(frozen=True)
class DamagedRow:
    rowid: int
    job_id: str
    why: str


@dataclass
class StoreReport:
    """What `inspect_store` found in an output folder. `problem`: what is wrong with the file as a whole (not SQLite,
    the integrity check, a foreign `jobs` table); the rest is per job."""

    path: Path
    exists: bool
    integrity: str = "not run"  # "ok", or the integrity check's first findings
    problem: str | None = None
    rows: int = 0
    ids: set[str] = field(default_factory=set)  # the ids of the rows read
    damaged: list[DamagedRow] = field(default_factory=list)
    mp4s: list[str] = field(default_factory=list)  # ids of videos/<id>.mp4
    sidecars: list[str] = field(default_factory=list)  # ids of videos/<id>.json
    missing_mp4s: list[str] = field(default_factory=list)  # completed records whose MP4 is not on disk

    @property
    def unrecorded_mp4s(self) -> list[str]:
        return [i for i in self.mp4s if i not in self.ids]

    @property
    def unrecorded_sidecars(self) -> list[str]:
        """Finished jobs the folder holds and the store lacks: what a lost or replaced store lost."""
        return [i for i in self.sidecars if i not in self.ids]

    def refusals(self) -> list[str]:
        """Why a start is refused: a damaged file or row, or jobs the folder holds that the store lacks (an empty
        store beside MP4s included). An MP4 a job record names that is gone is not: its download says so (410)."""
        out = [self.problem] if self.problem else []
        if self.damaged:
            shown = "; ".join(f"row {d.rowid} (id {d.job_id[:80]}): {d.why}" for d in self.damaged[:3])
            out.append(f"{len(self.damaged)} job record(s) cannot be read: {shown}")
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
        out.append(f"rows: {self.rows} ({len(self.damaged)} damaged)")
        out += [f"  damaged row {d.rowid} (id {d.job_id[:80]}): {d.why}" for d in self.damaged]
        out.append(f"MP4s: {len(self.mp4s)}; records beside them: {len(self.sidecars)}")
        out += [f"  MP4 without a record in the store: videos/{i}.mp4" for i in self.unrecorded_mp4s]
        out += [f"  record in videos/ the store lacks: videos/{i}{SIDECAR}" for i in self.unrecorded_sidecars]
        out += [f"  completed record whose MP4 is missing: {i}" for i in self.missing_mp4s]
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


def _ids(folder: Path, suffix: str) -> list[str]:
    return sorted(p.name[: -len(suffix)] for p in folder.glob(f"*{suffix}")) if folder.is_dir() else []


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
    report.mp4s, report.sidecars = _ids(videos, ".mp4"), _ids(videos, SIDECAR)
    if not report.exists:
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
    """The start's check: StoreDamaged if the store must not be opened as it is; else its report."""
    report = inspect_store(output_dir)
    if report.refusals():
        raise StoreDamaged(report)
    return report


# ---- rebuild ---------------------------------------------------------------------------------------------------------
@dataclass
class Rebuilt:
    moved: list[Path]  # the old store's files, moved aside
    from_sidecars: int
    from_rows: int  # jobs no sidecar held, taken from the old store's readable rows
    lost: list[DamagedRow]  # damaged rows no sidecar held: still in the moved-aside store
    bad_sidecars: list[str]  # "videos/<name>: why"
    unrecorded: Path | None  # where MP4s with no record at all (and sidecars that did not read) were moved

    def lines(self, store: Path) -> list[str]:
        out = [f"moved aside: {p}" for p in self.moved]
        out.append(
            f"rebuilt {store}: {self.from_sidecars + self.from_rows} job(s), {self.from_sidecars} from the records in "
            f"videos/, {self.from_rows} from the old store's readable rows"
        )
        out += [f"  not recovered: row {d.rowid} (id {d.job_id[:80]}): {d.why}" for d in self.lost]
        out += [f"  sidecar skipped: {s}" for s in self.bad_sidecars]
        if self.unrecorded is not None:
            out.append(f"MP4s with no record anywhere, and sidecars that did not read, moved to {self.unrecorded}")
        return out


def rebuild_store(output_dir: Path, now: float | None = None) -> Rebuilt:
    """A new store from the folder: every sidecar's record, and every readable row of the old store that no sidecar
    holds (a job that had not finished: the new store's first open marks it failed, interrupted). The old store's
    files are moved aside as `jobs.sqlite3.damaged-<UTC time>` (and its -wal, -shm), never deleted; MP4s that no
    record names, and sidecars that do not read, are moved to `unrecorded-<UTC time>/`, so that the folder the new
    store describes is consistent (and its next start is not refused). The
    new store is built under a temporary name and renamed into place. Run it with the server stopped."""
    path, videos = output_dir / STORE_FILE, output_dir / "videos"
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))
    taken = (f"{STORE_FILE}.damaged-{stamp}", f"unrecorded-{stamp}")
    if any((output_dir / name).exists() for name in taken):  # a second rebuild within the second: never replace
        stamp = f"{stamp}-{uuid.uuid4().hex[:8]}"
    videos.mkdir(parents=True, exist_ok=True)
    rows: list[VideoJob] = []
    report = inspect_store(output_dir, rows)
    records: dict[str, VideoJob] = {}
    bad: list[str] = []
    for job_id in report.sidecars:
        try:
            records[job_id] = read_sidecar(videos / f"{job_id}{SIDECAR}")
        except (ValueError, OSError) as err:
            bad.append(f"videos/{job_id}{SIDECAR}: {err}")
    from_sidecars = len(records)
    from_rows = 0
    for job in rows:  # a sidecar is the finished record as committed: it wins over a row read from a damaged file
        if job.id not in records:
            records[job.id] = job
            from_rows += 1
    lost = [d for d in report.damaged if d.job_id not in records]

    building = output_dir / f".{STORE_FILE}.rebuild-{stamp}.tmp"
    building.unlink(missing_ok=True)
    db = sqlite3.connect(building, isolation_level=None)
    try:
        db.execute("BEGIN")
        db.execute(_CREATE)
        for job in sorted(records.values(), key=lambda j: (j.created_at, j.id)):  # rowid order: creation order
            db.execute(_INSERT, [v for f in FIELDS for _, v in _encode(f, getattr(job, f))])
        db.execute("COMMIT")
    finally:
        db.close()
    moved = []
    for suffix in ("", "-wal", "-shm"):
        old = output_dir / f"{STORE_FILE}{suffix}"
        if old.exists():
            aside = output_dir / f"{STORE_FILE}.damaged-{stamp}{suffix}"
            os.replace(old, aside)
            moved.append(aside)
    os.replace(building, path)
    named = {j.file_name for j in records.values() if j.file_name}
    stray = [p for p in sorted(videos.glob("*.mp4")) if p.name not in named]
    stray += [videos / name.split(":", 1)[0].removeprefix("videos/") for name in bad]  # sidecars that did not read
    unrecorded = None
    if stray:
        unrecorded = output_dir / f"unrecorded-{stamp}"
        unrecorded.mkdir(exist_ok=True)
        for file in stray:
            os.replace(file, unrecorded / file.name)
    return Rebuilt(moved, from_sidecars, from_rows, lost, bad, unrecorded)
