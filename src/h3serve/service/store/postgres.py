"""The job store in PostgreSQL (H3_STORE=postgresql://...): `PostgresJobStore`, the same records and the same contract
as `jobs.JobStore` (`interface.JobRecords`), through psycopg 3, imported only when this store is chosen.

The table is the SQLite store's, derived from `VideoJob` by `rows` (one column per field, `error` as two, dicts and
lists as JSON text; a field added to VideoJob is a column an older table gains on open), with PostgreSQL's types
(BIGINT, DOUBLE PRECISION, TEXT) and a `rowid` identity column in the place of SQLite's implicit one: the listing's
tie-break (insertion order) and the name of a row whose id cannot be read. JSON stays text, not jsonb, so that one
codec (`rows.encode`, `rows.decode_row`) reads both stores and a hand-edited value that is no JSON is one row's damage,
not a failed query.

What differs from the SQLite store, and why:
- Several servers share one database (issue 58's fleet, docs/fleet.md): beside `jobs`, `job_claims` holds each job
  queued through the fleet (its stored request, what it needs of its renderer, who holds it, the lease's end and the
  claim's generation) and `fleet_servers` each server's capabilities and last heartbeat (`claims`). A server's store
  holds a session advisory lock on its name (H3_SERVER_ID) from its open to `close`: two running servers never share
  a name. At open, the jobs this name held when it last stopped are queued again; only active jobs that have no claim
  row (written by a server outside the fleet's queue) are failed (interrupted). The MP4s are in each server's own
  output folder's videos/, which the folder's lock keeps to one server.
- No record files beside the MP4s (videos/<id>.json) and no `store check`/`store rebuild`: those exist to rebuild a
  lost or damaged SQLite file from the folder; a PostgreSQL database is restored from its own backups (pg_dump, WAL
  archiving). A damaged row is refused at start as in SQLite, named by its id and rowid, to be mended with psql.
- PostgreSQL's text cannot hold the NUL character: a record holding one is refused (`rows.ValueRefused`, naming the
  field; the API answers 400 naming it as the parameter).
- An output folder that holds a SQLite store (jobs.sqlite3) is refused: its jobs are not in PostgreSQL (no migration
  yet), and this store's start would remove the MP4s it does not name.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from h3serve.service.schemas import JobStatus, VideoJob
from h3serve.service.store.base import RecordStore, plain
from h3serve.service.store.check import DamagedRow
from h3serve.service.store.claims import Capabilities, Needs, QueueLimit, Renewal, new_server_id
from h3serve.service.store.lock import SERVER, FolderLock
from h3serve.service.store.rows import (
    COLUMNS,
    CREATED_COLUMN,
    FIELDS,
    ID_COLUMN,
    KEY,
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
from h3serve.settings import shown_url

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 10
# h3serve's advisory locks (two-key form): (LOCK_CLASS, hashtext(server id)) held by a running server's store, so two
# running servers never share a name; (LOCK_CLASS, 0) while a store makes the tables; (LOCK_CLASS, 1) for the fleet's
# queue count and insert. ("h3sv" as a 32-bit number.)
LOCK_CLASS = int.from_bytes(b"h3sv", "big", signed=True)
TAKE_NAME = "SELECT pg_try_advisory_lock(%s, hashtext(%s))"
GIVE_NAME = "SELECT pg_advisory_unlock(%s, hashtext(%s))"
ROWID = "rowid"
_TYPES = {"INTEGER": "bigint", "REAL": "double precision", "TEXT": "text"}  # rows' SQLite type -> PostgreSQL's
_NAMES = ", ".join(c.name for c in COLUMNS)
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
_QUEUED, _IN_PROGRESS = f"'{JobStatus.QUEUED.value}'", f"'{JobStatus.IN_PROGRESS.value}'"
# The fleet's tables beside `jobs`: a claim row for each job queued through the fleet (its stored request, its needs,
# who holds it and until when; `seq` is the queue's order), and each server's capabilities and last heartbeat.
FLEET_TABLES = (
    "CREATE TABLE IF NOT EXISTS job_claims ("
    f"job_id text PRIMARY KEY REFERENCES jobs ({KEY}) ON DELETE CASCADE, "
    "seq bigint GENERATED ALWAYS AS IDENTITY UNIQUE, queued_at double precision NOT NULL, request bytea NOT NULL, "
    "build text NOT NULL, task text NOT NULL, adapters text[] NOT NULL, rows bigint NOT NULL, "
    "submitted_by text NOT NULL, server_id text, lease_until timestamptz, generation bigint NOT NULL DEFAULT 0, "
    "cancel_reason text, open boolean NOT NULL DEFAULT true)",
    # A claim's search reads only the jobs not yet ended (`open`), however many finished ones the table holds.
    "CREATE INDEX IF NOT EXISTS job_claims_open ON job_claims (seq) WHERE open",
    "CREATE TABLE IF NOT EXISTS fleet_servers (server_id text PRIMARY KEY, build text NOT NULL, tasks text[] NOT NULL, "
    "adapters text[] NOT NULL, max_rows bigint NOT NULL, lease_s double precision NOT NULL, "
    "seen_at timestamptz NOT NULL)",
)
QUEUED_COUNT = f"SELECT count(*) FROM jobs WHERE {STATUS_COLUMN}={_QUEUED}"
ENQUEUE = (
    "INSERT INTO job_claims (job_id, queued_at, request, build, task, adapters, rows, submitted_by) "
    "VALUES (%s, %s, %s, %s, %s, %s, %s, %s)"
)
_CLAIMABLE = (
    f"(j.{STATUS_COLUMN}={_QUEUED} OR (j.{STATUS_COLUMN}={_IN_PROGRESS} AND c.lease_until < clock_timestamp()))"
)
PICK = (
    f"SELECT c.job_id FROM job_claims c JOIN jobs j ON j.{ID_COLUMN} = c.job_id WHERE c.open AND {_CLAIMABLE} "
    "AND c.build = %s AND c.task = ANY(%s) AND c.adapters <@ %s::text[] AND c.rows <= %s AND c.queued_at < %s "
    "ORDER BY c.seq LIMIT 1 FOR UPDATE OF c SKIP LOCKED"
)
TAKE = (
    "UPDATE job_claims SET server_id=%s, lease_until=clock_timestamp() + make_interval(secs => %s), "
    "generation=generation + 1, cancel_reason=NULL WHERE job_id=%s RETURNING generation, request"
)
RENEW = (
    "UPDATE job_claims c SET lease_until=clock_timestamp() + make_interval(secs => %s) "
    "FROM unnest(%s::text[], %s::bigint[]) AS h(job_id, generation) "
    "WHERE c.server_id = %s AND c.job_id = h.job_id AND c.generation = h.generation "
    "RETURNING c.job_id, c.cancel_reason"
)
HOLDS = "SELECT 1 FROM job_claims WHERE job_id=%s AND server_id=%s AND generation=%s FOR UPDATE"
CLAIM_STATE = (
    f"SELECT j.{STATUS_COLUMN} FROM job_claims c JOIN jobs j ON j.{ID_COLUMN} = c.job_id WHERE c.job_id=%s "
    "FOR UPDATE OF c"
)
RELEASE_OWN = (
    f"UPDATE job_claims c SET server_id=NULL, lease_until=NULL FROM jobs j WHERE j.{ID_COLUMN} = c.job_id "
    f"AND c.server_id=%s AND j.{STATUS_COLUMN}={_IN_PROGRESS} RETURNING c.job_id"
)
REGISTER = (
    "INSERT INTO fleet_servers (server_id, build, tasks, adapters, max_rows, lease_s, seen_at) "
    "VALUES (%s, %s, %s, %s, %s, %s, clock_timestamp()) ON CONFLICT (server_id) DO UPDATE SET build=EXCLUDED.build, "
    "tasks=EXCLUDED.tasks, adapters=EXCLUDED.adapters, max_rows=EXCLUDED.max_rows, lease_s=EXCLUDED.lease_s, "
    "seen_at=EXCLUDED.seen_at"
)
SEEN = "UPDATE fleet_servers SET seen_at=clock_timestamp() WHERE server_id=%s"
QUEUE = (
    "SELECT c.job_id, (SELECT count(*) FROM fleet_servers s WHERE s.seen_at > clock_timestamp() - "
    "make_interval(secs => s.lease_s) AND s.build = c.build AND c.task = ANY(s.tasks) AND c.adapters <@ s.adapters "
    f"AND c.rows <= s.max_rows) FROM job_claims c JOIN jobs j ON j.{ID_COLUMN} = c.job_id WHERE c.open "
    f"AND j.{STATUS_COLUMN}={_QUEUED} ORDER BY c.seq"
)
TABLE_COLUMNS = (
    "SELECT column_name, data_type FROM information_schema.columns "
    "WHERE table_schema = current_schema() AND table_name = 'jobs' ORDER BY ordinal_position"
)


class PostgresStoreError(ValueError):
    """The PostgreSQL store cannot be used as it is. `url`: the store's URL as shown (no password); `reason`: why;
    `busy`: a running h3serve server on the database has this server's name (H3_SERVER_ID); `damaged`: the rows that
    do not decode."""

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


def _values(pairs: list[tuple[Column, Any]]) -> list[Any]:
    out = []
    for c, value in pairs:
        if isinstance(value, str) and "\x00" in value:
            raise ValueRefused(c.field, c.name, "PostgreSQL's text cannot hold the NUL character")
        out.append(plain(value))
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


def check_postgres_store(url: str, output_dir: Path, server_id: str | None = None) -> None:
    """The start's check, before any weight loads: the database answers, no running h3serve server has taken
    `server_id` (where one is given: H3_SERVER_ID), its `jobs` table (if any) is h3serve's and every row decodes, and
    the output folder holds no SQLite store. PostgresStoreError naming the URL (no password) and what is wrong."""
    shown = shown_url(url)
    _refuse_sqlite_folder(shown, output_dir)
    db = connect(url)
    try:
        if server_id is not None:
            if not db.execute(TAKE_NAME, (LOCK_CLASS, server_id)).fetchone()[0]:
                raise _busy(shown, server_id)
            db.execute(GIVE_NAME, (LOCK_CLASS, server_id))
        _inspect(db, shown)
    finally:
        db.close()


def _busy(url: str, server_id: str) -> PostgresStoreError:
    return PostgresStoreError(
        url,
        f"another running h3serve server on this database is named {server_id!r} (H3_SERVER_ID): each server of a "
        "fleet needs a name of its own; give this one another, or leave H3_SERVER_ID unset for a new one at each start",
        busy=True,
    )


class PostgresJobStore(RecordStore):
    """The job records in PostgreSQL: `jobs.JobStore`'s methods and contract (`interface.JobRecords`), and the
    fleet's claims (`claims.ClaimStore`: several servers share the database). Thread-safe: one connection behind a
    lock, as the SQLite store; every write is one transaction. The connection holds an advisory lock on this server's
    name (`server_id`) until `close`, so two running servers never share one. `check`: refuse a foreign table or a
    damaged row (PostgresStoreError) before anything is written. The output folder's lock (the MP4s are there) as the
    SQLite store's: `lock`, one the caller holds, or the store's own."""

    MARK = "%s"
    ROW_WORD = "rowid"
    MEND = "mend or delete the row with psql"
    SEE = "see the server's log"

    def __init__(
        self,
        url: str,
        output_dir: Path,
        *,
        check: bool = True,
        lock: FolderLock | None = None,
        server_id: str | None = None,
    ):
        self.url = shown_url(url)  # what messages show
        self.output_dir = output_dir
        self.videos = output_dir / "videos"
        self.server_id = server_id if server_id is not None else new_server_id()
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

    @property
    def where(self) -> str:
        return self.url

    def _open(self, url: str, check: bool) -> None:
        self.videos.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._logged: set[int] = set()
        self._db = connect(url)
        try:
            if not self._db.execute(TAKE_NAME, (LOCK_CLASS, self.server_id)).fetchone()[0]:
                raise _busy(self.url, self.server_id)
            if check:
                _inspect(self._db, self.url)
            with self._transaction() as db:
                # Two servers starting on a new database would race to make the tables: one at a time.
                db.execute("SELECT pg_advisory_xact_lock(%s, 0)", (LOCK_CLASS,))
                db.execute(CREATE)
                present = {name for name, _ in db.execute(TABLE_COLUMNS).fetchall()}
                for c in COLUMNS:
                    if c.name not in present:
                        db.execute(f"ALTER TABLE jobs ADD COLUMN {definition(c, new_table=False)}")
                db.execute(CREATE_INDEX)
                for statement in FLEET_TABLES:
                    db.execute(statement)
            self.released = self._release_own()
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

    def _left_active(self) -> tuple[str, list[Any]]:
        """Only the active jobs that no server can render again: those without a claim row (a record written without
        the fleet's queue: a store used by one server). A claimed job is another server's, or queued for any; this
        server's own were given back (`_release_own`)."""
        where, params = super()._left_active()
        return f"{where} AND NOT EXISTS (SELECT 1 FROM job_claims c WHERE c.job_id = jobs.{ID_COLUMN})", params

    def _release_own(self) -> int:
        """The jobs this server's name held when it last stopped (a crash, a kill) go back to the queue at once,
        for any server, instead of waiting for their leases to run out."""
        with self._transaction() as db:
            ids = [r[0] for r in db.execute(RELEASE_OWN, (self.server_id,)).fetchall()]
            if ids:
                db.execute(f"UPDATE jobs SET {STATUS_COLUMN}=%s, progress=0 WHERE {ID_COLUMN} = ANY(%s)",
                           (JobStatus.QUEUED.value, ids))  # fmt: skip
        if ids:
            log.warning("%d job(s) this server (%s) held when it stopped are queued again", len(ids), self.server_id)
        return len(ids)

    def insert(self, job: VideoJob) -> None:
        values = _values([pair for f in FIELDS for pair in encode(f, getattr(job, f))])
        with self._transaction() as db:
            db.execute(INSERT, values)

    def update(self, job_id: str, **changes: Any) -> None:
        if not changes:
            return
        assign, values = self._assign(changes)
        with self._transaction() as db:
            db.execute(f"UPDATE jobs SET {assign} WHERE {ID_COLUMN}=%s", (*values, job_id))

    def _assign(self, changes: dict[str, Any]) -> tuple[str, list[Any]]:
        assign, _ = assignments(changes, mark="%s")  # first: a name that is no field is refused here
        pairs = [pair for field, value in changes.items() for pair in encode(field, value)]
        return assign, _values(pairs)

    def delete(self, job_id: str) -> None:
        """Remove a record (and its claim), then its MP4 (the job's own only, whatever its row says, as the SQLite
        store)."""
        with self._transaction() as db:
            rows = db.execute(
                f"DELETE FROM jobs WHERE {ID_COLUMN}=%s RETURNING {column_of('file_name')}", (job_id,)
            ).fetchall()
        self._remove_own_mp4(job_id, rows[0][0] if rows else None)

    def close(self) -> None:
        """This server leaves the fleet's live servers (its claims stay: a job it still held is queued again at its
        next start under the same name, or by another server once its lease runs out), then the connection closes
        (and this server's name lock with it)."""
        try:
            with self._transaction() as db:
                db.execute("DELETE FROM fleet_servers WHERE server_id=%s", (self.server_id,))
        except Exception as err:  # a lost connection: its row ages out as its lease does
            log.warning("the fleet's record of server %s could not be removed: %s", self.server_id, err)
        super().close()

    # ---- the fleet's claims (`claims.ClaimStore`) ----------------------------------------------------------------
    def register(self, capabilities: Capabilities, lease_s: float) -> None:
        """This server, live, with what it can render: what the queue's `takers` count is made of."""
        c = capabilities
        with self._transaction() as db:
            db.execute(REGISTER, (self.server_id, c.build, list(c.tasks), list(c.adapters), c.max_rows, lease_s))

    def enqueue(self, job: VideoJob, request: bytes, needs: Needs, queued_at: float, limit: int, waiting: int) -> None:
        """A job's record and its claim row, in one transaction; QueueLimit (nothing written) when the fleet's queued
        jobs and `waiting` (this server's sync renders) reach `limit`. The count and the insert are one step for the
        whole fleet (a transaction-scoped advisory lock), so two servers never both take the last place."""
        values = _values([pair for f in FIELDS for pair in encode(f, getattr(job, f))])
        with self._transaction() as db:
            db.execute("SELECT pg_advisory_xact_lock(%s, 1)", (LOCK_CLASS,))
            if db.execute(QUEUED_COUNT).fetchone()[0] + waiting >= limit:
                raise QueueLimit(limit)
            db.execute(INSERT, values)
            db.execute(ENQUEUE, (job.id, queued_at, request, needs.build, needs.task, list(needs.adapters),
                                 needs.rows, self.server_id))  # fmt: skip

    def queued_count(self) -> int:
        return self._read(QUEUED_COUNT)[0][0]

    def claim(self, capabilities: Capabilities, before: float, lease_s: float) -> tuple[str, int, bytes] | None:
        """Claim the oldest job this server can render (queued, or in progress with its lease run out) queued before
        `before`: (id, generation, the stored request), or None. SKIP LOCKED: servers claiming at once each get
        another job, none waits on another's claim."""
        c = capabilities
        before = before if math.isfinite(before) else 1e300
        with self._transaction() as db:
            row = db.execute(PICK, (c.build, list(c.tasks), list(c.adapters), c.max_rows, before)).fetchone()
            if row is None:
                return None
            job_id = row[0]
            generation, request = db.execute(TAKE, (self.server_id, lease_s, job_id)).fetchone()
            db.execute(f"UPDATE jobs SET {STATUS_COLUMN}=%s, progress=0 WHERE {ID_COLUMN}=%s",
                       (JobStatus.IN_PROGRESS.value, job_id))  # fmt: skip
        return job_id, generation, bytes(request)

    def renew(self, held: list[tuple[str, int]], lease_s: float) -> Renewal:
        """One heartbeat: this server seen now, the leases of the claims it still holds renewed; the rest are lost.
        Cancels asked for held jobs come back with it."""
        with self._transaction() as db:
            db.execute(SEEN, (self.server_id,))
            kept: dict[str, str | None] = {}
            if held:
                ids, generations = [h[0] for h in held], [h[1] for h in held]
                for job_id, reason in db.execute(RENEW, (lease_s, ids, generations, self.server_id)).fetchall():
                    kept[job_id] = reason
        lost = frozenset(job_id for job_id, _ in held if job_id not in kept)
        return Renewal(lost, {job_id: reason for job_id, reason in kept.items() if reason is not None})

    def write_held(self, job_id: str, generation: int, ending: bool, **changes: Any) -> bool:
        """Write a held job's record, only while this server holds its claim of `generation` (the claim row locked
        for the write, so no claim slips in between); `ending`: the job has finished and its lease is let go. False:
        not held (claimed again, or deleted); nothing written."""
        assign, values = self._assign(changes)
        with self._transaction() as db:
            if db.execute(HOLDS, (job_id, self.server_id, generation)).fetchone() is None:
                return False
            db.execute(f"UPDATE jobs SET {assign} WHERE {ID_COLUMN}=%s", (*values, job_id))
            if ending:
                db.execute("UPDATE job_claims SET lease_until=NULL, open=false WHERE job_id=%s", (job_id,))
        return True

    def release(self, job_id: str, generation: int) -> bool:
        """Give a held job back to the queue: queued, no holder; False when it was not held."""
        with self._transaction() as db:
            if db.execute(HOLDS, (job_id, self.server_id, generation)).fetchone() is None:
                return False
            db.execute("UPDATE job_claims SET server_id=NULL, lease_until=NULL WHERE job_id=%s", (job_id,))
            db.execute(f"UPDATE jobs SET {STATUS_COLUMN}=%s, progress=0 WHERE {ID_COLUMN}=%s",
                       (JobStatus.QUEUED.value, job_id))  # fmt: skip
        return True

    def cancel_queued(self, job_id: str, changes: dict[str, Any], reason: str) -> str | None:
        """Cancel a job this server does not hold: a queued one ends here (`changes` written: `cancelled`); one in
        progress on a server is asked to stop (`held`: its holder's next heartbeat sees the reason). None: not an
        active job of the fleet's queue."""
        assign, values = self._assign(changes)
        with self._transaction() as db:
            row = db.execute(CLAIM_STATE, (job_id,)).fetchone()  # the claim row locked: no claim slips in between
            if row is None or row[0] not in (JobStatus.QUEUED.value, JobStatus.IN_PROGRESS.value):
                return None
            if row[0] == JobStatus.QUEUED.value:
                db.execute(f"UPDATE jobs SET {assign} WHERE {ID_COLUMN}=%s", (*values, job_id))
                db.execute("UPDATE job_claims SET open=false WHERE job_id=%s", (job_id,))
                return "cancelled"
            db.execute("UPDATE job_claims SET cancel_reason=%s WHERE job_id=%s", (reason, job_id))
            return "held"

    def fail_unreadable(self, job_id: str, generation: int, changes: dict[str, Any]) -> None:
        """A claimed job whose stored request does not decode: failed (its holder's write), never claimed again."""
        if not self.write_held(job_id, generation, True, **changes):
            return
        log.error("job %s: its stored request cannot be read; failed (%s)", job_id, changes["error"].message)

    def queue(self) -> list[tuple[str, int]]:
        """The fleet's queued jobs in claim order, each with how many live servers can render it."""
        return [(job_id, takers) for job_id, takers in self._read(QUEUE)]


def _is_driver_error(err: BaseException) -> bool:
    import psycopg

    return isinstance(err, psycopg.Error)
