"""The job store in PostgreSQL (H3_STORE=postgresql://...): `PostgresJobStore`, the same records and the same contract
as `jobs.JobStore` (`interface.JobRecords`), through psycopg 3, imported only when this store is chosen.

The table is the SQLite store's, derived from `VideoJob` by `rows` (one column per field, `error` as two, dicts and
lists as JSON text; a field added to VideoJob is a column an older table gains on open), with PostgreSQL's types
(BIGINT, DOUBLE PRECISION, TEXT) and a `rowid` identity column in the place of SQLite's implicit one: the listing's
tie-break (insertion order) and the name of a row whose id cannot be read. JSON stays text, not jsonb, so that one
codec (`rows.encode`, `rows.decode_row`) reads both stores and a hand-edited value that is no JSON is one row's damage,
not a failed query.

What differs from the SQLite store, and why:
- One server per database, for now: the store holds a session advisory lock (`pg_try_advisory_lock`) from its open to
  `close`, in the place of the output folder's lock; a second server on the same database is refused at its start's
  check, before any weight loads. The fleet's leases (issue 58, step 2) replace it. The MP4s are still in the output
  folder's videos/, which the folder's lock still keeps to one server.
- No record files beside the MP4s (videos/<id>.json) and no `store check`/`store rebuild`: those exist to rebuild a
  lost or damaged SQLite file from the folder; a PostgreSQL database is restored from its own backups (pg_dump, WAL
  archiving). A damaged row is refused at start as in SQLite, named by its id and rowid, to be mended with psql.
- PostgreSQL's text cannot hold the NUL character: a record holding one is refused (`rows.ValueRefused`, naming the
  field; the API answers 400 naming it as the parameter).
- An output folder that holds a SQLite store (jobs.sqlite3) is refused: its jobs are not in PostgreSQL (no migration
  yet), and this store's start would remove the MP4s it does not name.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from h3serve.service.schemas import JobError, JobStatus, VideoJob
from h3serve.service.store.check import DamagedRow
from h3serve.service.store.jobs import ACTIVE, INTERRUPTED, DamagedRecord, RecordDamaged
from h3serve.service.store.lock import SERVER, FolderLock
from h3serve.service.store.rows import (
    COLUMNS,
    CREATED_COLUMN,
    FIELDS,
    ID_COLUMN,
    KEY,
    MP4,
    NEWEST_FIRST,
    OLDEST_FIRST,
    STATUS_COLUMN,
    STORE_FILE,
    Column,
    ValueRefused,
    assignments,
    column_of,
    decode_row,
    encode,
    row_id,
)
from h3serve.service.store.sidecars import SIDECAR
from h3serve.settings import shown_url

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 10
# The advisory lock a server's store holds on its database: one 64-bit key, h3serve's ("h3serve jobs" as bytes).
LOCK_KEY = int.from_bytes(b"h3srvjob", "big", signed=True)
ROWID = "rowid"
_TYPES = {"INTEGER": "bigint", "REAL": "double precision", "TEXT": "text"}  # rows' SQLite type -> PostgreSQL's
_NAMES = ", ".join(c.name for c in COLUMNS)
SELECT = f"SELECT {ROWID}, {_NAMES} FROM jobs"
INSERT = f"INSERT INTO jobs ({_NAMES}) VALUES ({', '.join(['%s'] * len(COLUMNS))})"


def definition(c: Column, new_table: bool) -> str:
    if c.name == KEY:
        return f"{c.name} {_TYPES[c.sql_type]} PRIMARY KEY"
    # As in SQLite: an added column is nullable in an older table (its old rows have no value for it).
    return f"{c.name} {_TYPES[c.sql_type]}" + (" NOT NULL" if c.required and new_table else "")


CREATE = (
    f"CREATE TABLE IF NOT EXISTS jobs ({ROWID} bigint GENERATED ALWAYS AS IDENTITY UNIQUE, "
    f"{', '.join(definition(c, new_table=True) for c in COLUMNS)})"
)
CREATE_INDEX = f"CREATE INDEX IF NOT EXISTS jobs_listing ON jobs ({CREATED_COLUMN}, {ROWID})"
TABLE_COLUMNS = (
    "SELECT column_name, data_type FROM information_schema.columns "
    "WHERE table_schema = current_schema() AND table_name = 'jobs' ORDER BY ordinal_position"
)


class PostgresStoreError(ValueError):
    """The PostgreSQL store cannot be used as it is. `url`: the store's URL as shown (no password); `reason`: why;
    `busy`: another h3serve server holds the database's store; `damaged`: the rows that do not decode."""

    def __init__(self, url: str, reason: str, *, busy: bool = False, damaged: list[DamagedRow] | None = None):
        self.url, self.reason, self.busy, self.damaged = url, reason, busy, damaged or []
        super().__init__(f"{url}: {reason}")


def connect(url: str):
    """A psycopg connection in autocommit mode (each write opens its transaction explicitly); PostgresStoreError in
    the driver's words, never the password, when it cannot be had."""
    import psycopg

    try:
        return psycopg.connect(url, autocommit=True, connect_timeout=CONNECT_TIMEOUT_S, application_name="h3serve")
    except psycopg.Error as err:
        raise PostgresStoreError(shown_url(url), f"cannot connect ({_words(err, url)})") from None


def _words(err: Exception, url: str) -> str:
    """The driver's message, first line, with anything of the URL's password taken out (belt and braces)."""
    from urllib.parse import urlsplit

    text = (str(err).strip().splitlines() or [type(err).__name__])[0]
    try:
        password = urlsplit(url).password
    except ValueError:
        password = None
    return text.replace(password, "***") if password else text


def _plain(value: Any) -> Any:
    """A value as psycopg takes it: an enum as its value (JobStatus is a StrEnum)."""
    return value.value if isinstance(value, enum.Enum) else value


def _values(pairs: list[tuple[Column, Any]]) -> list[Any]:
    out = []
    for c, value in pairs:
        if isinstance(value, str) and "\x00" in value:
            raise ValueRefused(c.field, c.name, "PostgreSQL's text cannot hold the NUL character")
        out.append(_plain(value))
    return out


def _foreign(table: dict[str, str]) -> str | None:
    """What makes a `jobs` table not h3serve's (None when it is ours, or an older version of ours)."""
    ours = {c.name: _TYPES[c.sql_type] for c in COLUMNS}
    unknown = sorted(set(table) - set(ours) - {ROWID})
    if unknown:
        return f"its jobs table is not h3serve's: columns {', '.join(unknown)[:200]} are not a job record's"
    kinds = [f"{n} is {kind}, not {ours[n]}" for n, kind in table.items() if n in ours and kind != ours[n]]
    if kinds:
        return f"its jobs table is not h3serve's: {'; '.join(kinds)}"
    needed = [c.name for c in COLUMNS if c.part is None and VideoJob.model_fields[c.field].is_required()]
    missing = [n for n in [ROWID, *needed] if n not in table]
    if missing:
        return f"its jobs table is not h3serve's: it has no {', '.join(missing)} column"
    return None


def _inspect(db, url: str) -> None:
    """PostgresStoreError if the `jobs` table is not h3serve's or a row of it does not decode (the start's check, as
    SQLite's `refuse_damage`); nothing is changed."""
    table = dict(db.execute(TABLE_COLUMNS).fetchall())
    if not table:
        return  # a new database: the store makes its table
    foreign = _foreign(table)
    if foreign is not None:
        raise PostgresStoreError(url, f"{foreign}. Nothing was changed; give h3serve a database (or schema) of its own")
    names = ", ".join(c.name if c.name in table else "NULL" for c in COLUMNS)  # an older table's missing columns
    damaged = []
    for row in db.execute(f"SELECT {ROWID}, {names} FROM jobs ORDER BY {ROWID}"):
        try:
            decode_row(row[1:])
        except ValueError as err:
            damaged.append(DamagedRow(row[0], row_id(row[0], row[1]), str(err)))
    if damaged:
        shown_rows = "; ".join(f"rowid {d.rowid} (id {d.job_id[:80]}): {d.why}" for d in damaged[:3])
        raise PostgresStoreError(
            url,
            f"{len(damaged)} job record(s) cannot be read: {shown_rows}. Nothing was changed; mend or delete those "
            "rows with psql (there is no `store rebuild` for PostgreSQL: restore the database from its backups)",
            damaged=damaged,
        )


def _refuse_sqlite_folder(url: str, output_dir: Path) -> None:
    if (output_dir / STORE_FILE).exists():
        raise PostgresStoreError(
            url,
            f"the output folder {output_dir} holds a SQLite job store ({STORE_FILE}), whose jobs are not in "
            "PostgreSQL (there is no migration yet): use another output folder with H3_STORE, or unset H3_STORE",
        )


def check_postgres_store(url: str, output_dir: Path) -> None:
    """The start's check, before any weight loads: the database answers, no other h3serve server holds its store, its
    `jobs` table (if any) is h3serve's and every row decodes, and the output folder holds no SQLite store.
    PostgresStoreError naming the URL (no password) and what is wrong."""
    shown = shown_url(url)
    _refuse_sqlite_folder(shown, output_dir)
    db = connect(url)
    try:
        if not db.execute("SELECT pg_try_advisory_lock(%s)", (LOCK_KEY,)).fetchone()[0]:
            raise _busy(shown)
        db.execute("SELECT pg_advisory_unlock(%s)", (LOCK_KEY,))
        _inspect(db, shown)
    finally:
        db.close()


def _busy(url: str) -> PostgresStoreError:
    return PostgresStoreError(
        url,
        "another h3serve server uses this database's job store (it holds the store's lock while it runs): one server "
        "per database for now; stop that one first, or give this one another database",
        busy=True,
    )


class PostgresJobStore:
    """The job records in PostgreSQL: `jobs.JobStore`'s methods and contract (`interface.JobRecords`). Thread-safe:
    one connection behind a lock, as the SQLite store; every write is one transaction. The connection holds the
    database's advisory lock until `close`. `check`: refuse a foreign table or a damaged row (PostgresStoreError)
    before anything is written. The output folder's lock (the MP4s are there) as the SQLite store's: `lock`, one the
    caller holds, or the store's own."""

    def __init__(self, url: str, output_dir: Path, *, check: bool = True, lock: FolderLock | None = None):
        self.url = shown_url(url)  # what messages show
        self.output_dir = output_dir
        self.videos = output_dir / "videos"
        _refuse_sqlite_folder(self.url, output_dir)
        output_dir.mkdir(parents=True, exist_ok=True)
        self._folder_lock = lock if lock is not None else FolderLock(output_dir, SERVER)
        self._owns_folder_lock = lock is None
        try:
            self._open(url, check)
        except BaseException:
            if self._owns_folder_lock:
                self._folder_lock.release()
            raise

    def _open(self, url: str, check: bool) -> None:
        self.videos.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._logged: set[int] = set()
        self._db = connect(url)
        try:
            if not self._db.execute("SELECT pg_try_advisory_lock(%s)", (LOCK_KEY,)).fetchone()[0]:
                raise _busy(self.url)
            if check:
                _inspect(self._db, self.url)
            with self._transaction() as db:
                db.execute(CREATE)
                present = {name for name, _ in db.execute(TABLE_COLUMNS).fetchall()}
                for c in COLUMNS:
                    if c.name not in present:
                        db.execute(f"ALTER TABLE jobs ADD COLUMN {definition(c, new_table=False)}")
                db.execute(CREATE_INDEX)
            self.recovered = self._recover()
        except BaseException as err:
            self._db.close()
            if not isinstance(err, PostgresStoreError) and _is_driver_error(err):
                raise PostgresStoreError(self.url, f"cannot be opened ({_words(err, url)})") from None
            raise

    @contextmanager
    def _transaction(self) -> Iterator[Any]:
        with self._lock, self._db.transaction():
            yield self._db

    def _read(self, sql: str, params: tuple | list = ()) -> list[tuple]:
        with self._lock:
            return self._db.execute(sql, params).fetchall()

    def _entry(self, row: tuple) -> VideoJob | DamagedRecord:
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
                    "job store %s: the record of job %s (rowid %d) cannot be read: %s; it is listed as damaged "
                    "(mend or delete the row with psql)",
                    self.url,
                    job_id,
                    rowid,
                    err,
                )
            message = f"the store's record of this job cannot be read ({err}); see the server's log"
            return DamagedRecord(id=job_id, error=JobError(code="damaged_record", message=message))

    def _recover(self) -> int:
        """As the SQLite store's: jobs a previous process left active become failed (this server holds the database,
        so none of them is rendering), half-written MP4s are removed, and so is an MP4 no completed record names."""
        assign, values = assignments(
            {
                "status": JobStatus.FAILED,
                "error": JobError(code="interrupted", message=INTERRUPTED),
                "completed_at": int(time.time()),
            },
            mark="%s",
        )
        with self._transaction() as db:
            params = [*map(_plain, values), *map(_plain, ACTIVE)]
            n = db.execute(f"UPDATE jobs SET {assign} WHERE {STATUS_COLUMN} IN (%s, %s)", params).rowcount
        for partial in self.videos.glob(".*.tmp"):
            partial.unlink(missing_ok=True)
        completed = f"SELECT {column_of('file_name')} FROM jobs WHERE {STATUS_COLUMN}=%s"
        named = {row[0] for row in self._read(completed, (JobStatus.COMPLETED.value,))}
        for mp4 in self.videos.glob("*.mp4"):
            # A sidecar beside it: a SQLite store's finished job (`_refuse_sqlite_folder` stops most such folders).
            if mp4.name not in named and not mp4.with_suffix(SIDECAR).exists():
                mp4.unlink(missing_ok=True)
        if n:
            log.warning("%d job(s) interrupted by the previous stop are marked failed", n)
        return n

    def insert(self, job: VideoJob) -> None:
        values = _values([pair for f in FIELDS for pair in encode(f, getattr(job, f))])
        with self._transaction() as db:
            db.execute(INSERT, values)

    def update(self, job_id: str, **changes: Any) -> None:
        if not changes:
            return
        assign, _ = assignments(changes, mark="%s")  # first: a name that is no field is refused here
        pairs = [pair for field, value in changes.items() for pair in encode(field, value)]
        with self._transaction() as db:
            db.execute(f"UPDATE jobs SET {assign} WHERE {ID_COLUMN}=%s", (*_values(pairs), job_id))

    def entry(self, job_id: str) -> VideoJob | DamagedRecord | None:
        rows = self._read(f"{SELECT} WHERE {ID_COLUMN}=%s", (job_id,))
        return self._entry(rows[0]) if rows else None

    def get(self, job_id: str) -> VideoJob | None:
        found = self.entry(job_id)
        if isinstance(found, DamagedRecord):
            raise RecordDamaged(found)
        return found

    def list(
        self, limit: int, after: str | None = None, oldest_first: bool = False
    ) -> tuple[list[VideoJob | DamagedRecord], bool]:
        order, beyond = (OLDEST_FIRST, ">") if oldest_first else (NEWEST_FIRST, "<")
        if after is None:
            rows = self._read(f"{SELECT} {order} LIMIT %s", (limit + 1,))
        else:
            rows = self._read(
                f"{SELECT} WHERE ({CREATED_COLUMN}, {ROWID}) {beyond} "
                f"(SELECT {CREATED_COLUMN}, {ROWID} FROM jobs WHERE {ID_COLUMN}=%s) {order} LIMIT %s",
                (after, limit + 1),
            )
        return [self._entry(r) for r in rows[:limit]], len(rows) > limit

    def delete(self, job_id: str) -> None:
        """Remove a record, then its MP4 (the job's own only, whatever its row says, as the SQLite store)."""
        with self._transaction() as db:
            rows = db.execute(
                f"DELETE FROM jobs WHERE {ID_COLUMN}=%s RETURNING {column_of('file_name')}", (job_id,)
            ).fetchall()
        file_name = rows[0][0] if rows else None
        if file_name == f"{job_id}{MP4}":
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
            self._db.close()  # the advisory lock goes with the session
        if self._owns_folder_lock:
            self._folder_lock.release()


def _is_driver_error(err: BaseException) -> bool:
    import psycopg

    return isinstance(err, psycopg.Error)
