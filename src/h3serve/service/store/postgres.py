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
- One API across the fleet (docs/fleet.md): `job_events` holds each claimed job's events as its holder relays them
  (`publish`, the holder's ids) and `job_previews` each job's latest preview; NOTIFY tells the other servers at commit
  (`CHANNELS`: a job's events stored, a cancel for a job's holder, a job deleted), which each server hears on a
  connection of its own (`listen`). A NOTIFY payload holds at most 8000 bytes, so it carries ids (a cancel's reason cut
  to MAX_REASON), never the events or the PNG: a server that missed notices while reconnecting reads the rows again.
- A lost connection (PostgreSQL restarted) is reopened at the next use (`_connected`, with the name lock taken
  again); meanwhile calls raise `claims.StoreUnreachable` and `problem` says why (the API's 503, /health not ready).
- PostgreSQL's text cannot hold the NUL character: a record holding one is refused (`rows.ValueRefused`, naming the
  field; the API answers 400 naming it as the parameter).
- An output folder that holds a SQLite store (jobs.sqlite3) is refused: its jobs are not in PostgreSQL (no migration
  yet), and this store's start would remove the MP4s it does not name.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from h3serve.service.schemas import JobStatus, VideoJob
from h3serve.service.store.base import RecordStore, plain
from h3serve.service.store.check import DamagedRow
from h3serve.service.store.claims import (
    Capabilities,
    Needs,
    Notice,
    NoticeKind,
    QueueLimit,
    Relayed,
    Renewal,
    StoredEvent,
    StoreUnreachable,
    new_server_id,
)
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
    # Each job's events as its holder relayed them (`publish`), for every server's event stream; the ids are the
    # holder's, so Last-Event-ID resumes on any server. And each job's latest preview (one row a job: a NOTIFY payload
    # holds at most 8000 bytes, a preview strip up to megabytes).
    f"CREATE TABLE IF NOT EXISTS job_events (job_id text NOT NULL REFERENCES jobs ({KEY}) ON DELETE CASCADE, "
    "id bigint NOT NULL, name text NOT NULL, data text NOT NULL, PRIMARY KEY (job_id, id))",
    f"CREATE TABLE IF NOT EXISTS job_previews (job_id text PRIMARY KEY REFERENCES jobs ({KEY}) ON DELETE CASCADE, "
    "png bytea NOT NULL)",
)
# The fleet's notices (NOTIFY, sent as their transaction commits): a job's events were stored (payload: its id), a
# cancel for the server that holds a job (JSON: job, server, reason), a job deleted (its id).
EVENTS_CHANNEL, CANCEL_CHANNEL, DELETED_CHANNEL = "h3serve_events", "h3serve_cancel", "h3serve_deleted"
CHANNELS = {EVENTS_CHANNEL: NoticeKind.EVENTS, CANCEL_CHANNEL: NoticeKind.CANCEL, DELETED_CHANNEL: NoticeKind.DELETED}
NOTIFY = "SELECT pg_notify(%s, %s)"
MAX_REASON = 500  # characters of a cancel's reason in its notice (a payload holds at most 8000 bytes)
KEEP_PROGRESS = 256  # progress events kept per job in job_events (as `events.LIMIT` keeps in a server's log)
HOLDS_SHARE = "SELECT 1 FROM job_claims WHERE job_id=%s AND server_id=%s AND generation=%s FOR SHARE"
PUT_EVENT = "INSERT INTO job_events (job_id, id, name, data) VALUES (%s, %s, %s, %s) ON CONFLICT DO NOTHING"
NEXT_EVENT = (
    "INSERT INTO job_events (job_id, id, name, data) SELECT %s, coalesce(max(id), 0) + 1, %s, %s FROM job_events "
    "WHERE job_id=%s"
)
PUT_PREVIEW = (
    "INSERT INTO job_previews (job_id, png) VALUES (%s, %s) ON CONFLICT (job_id) DO UPDATE SET png=EXCLUDED.png"
)
PRUNE_PROGRESS = (
    "DELETE FROM job_events WHERE job_id=%s AND name='progress' AND id <= (SELECT max(id) FROM job_events WHERE "
    "job_id=%s AND name='progress') - %s"
)
EVENTS_SINCE = "SELECT id, name, data FROM job_events WHERE job_id=%s AND id > %s ORDER BY id LIMIT %s"
HELD_NOW = (
    f"SELECT c.job_id, c.server_id FROM job_claims c JOIN jobs j ON j.{ID_COLUMN} = c.job_id WHERE c.open "
    f"AND c.server_id IS NOT NULL AND j.{STATUS_COLUMN}={_IN_PROGRESS} ORDER BY c.seq"
)
HELD_BY = "SELECT job_id, server_id FROM job_claims WHERE server_id IS NOT NULL AND job_id = ANY(%s)"
RECONNECT_GAP_S = 1.0  # after a failed reconnect, calls fail at once for this long instead of each waiting on one
LISTEN_WAKE_S = 1.0  # how often the listener looks whether it should stop (notices wake it at once)
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
    f"SELECT j.{STATUS_COLUMN}, c.server_id FROM job_claims c JOIN jobs j ON j.{ID_COLUMN} = c.job_id "
    "WHERE c.job_id=%s FOR UPDATE OF c"
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


def connect(url: str, timeout: int = CONNECT_TIMEOUT_S):
    """A psycopg connection in autocommit mode (each write opens its transaction explicitly); PostgresStoreError in
    the driver's words, never the password, when it cannot be had."""
    import psycopg

    try:
        return psycopg.connect(url, autocommit=True, connect_timeout=timeout, application_name="h3serve")
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
        self._dsn = url  # kept to reconnect (it may hold a password: never shown, never logged)
        self.problem: str | None = None  # why the database does not answer now (`/health`); None while it does
        self._retry_at = 0.0  # monotonic time before which a reconnect is not tried again
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

    # ---- the connection, and its loss ---------------------------------------------------------------------------
    # A lost connection (PostgreSQL restarted, the network cut) is reopened at the next use, with this server's name
    # lock taken again; until it is, every call raises StoreUnreachable (the API's 503) and `problem` says why. A
    # statement whose connection was found lost before it ran (the first use after a restart fails at BEGIN) is run
    # again once on a new connection; one lost while it ran was rolled back by the server, and is not retried (its
    # caller gets StoreUnreachable); one lost during its COMMIT may or may not have been made (`unknown`).
    def _connected(self) -> Any:
        """The open connection (under `_lock`), reopened if it was lost; StoreUnreachable when it cannot be."""
        if not (self._db.closed or self._db.broken):
            return self._db
        now = time.monotonic()
        if now < self._retry_at:
            raise StoreUnreachable(self.url, self.problem or "reconnecting")
        try:
            db = connect(self._dsn)
        except PostgresStoreError as err:
            self._retry_at, self.problem = now + RECONNECT_GAP_S, err.reason
            raise StoreUnreachable(self.url, err.reason) from None
        try:
            named = db.execute(TAKE_NAME, (LOCK_CLASS, self.server_id)).fetchone()[0]
        except Exception as err:
            db.close()
            self._retry_at, self.problem = now + RECONNECT_GAP_S, _words(err, self._dsn)
            raise StoreUnreachable(self.url, self.problem) from None
        if not named:  # another process took this server's name while the connection was down
            db.close()
            self._retry_at = now + RECONNECT_GAP_S
            self.problem = f"another running server holds this server's name {self.server_id!r} (H3_SERVER_ID)"
            raise StoreUnreachable(self.url, self.problem)
        self._db.close()
        self._db = db
        log.warning("job store %s: connected again (server %s)", self.url, self.server_id)
        return db

    def _lost(self, db: Any, err: BaseException) -> StoreUnreachable | None:
        """StoreUnreachable if `err` came with the loss of the connection (then marked for reopening), else None."""
        if not (db.closed or db.broken):
            return None
        self.problem = f"the connection was lost: {_words(err, self._dsn)}"
        log.warning("job store %s: %s; reconnecting at its next use", self.url, self.problem)
        return StoreUnreachable(self.url, self.problem)

    @property
    def reachable(self) -> bool:
        return self.problem is None

    @contextmanager
    def _transaction(self) -> Iterator[Any]:
        import psycopg

        with self._lock:
            for attempt in (0, 1):
                db = self._connected()
                tx = db.transaction()
                try:
                    tx.__enter__()  # BEGIN: where a connection lost while idle is found out
                except psycopg.OperationalError as err:
                    lost = self._lost(db, err)
                    if lost is None:
                        raise
                    if attempt:
                        raise lost from None
                    continue
                break
            try:
                yield db
            except BaseException as err:
                with contextlib.suppress(psycopg.OperationalError):  # (the connection lost: nothing to roll back)
                    tx.__exit__(type(err), err, err.__traceback__)  # ROLLBACK
                lost = self._lost(db, err) if isinstance(err, psycopg.OperationalError) else None
                if lost is not None:
                    raise lost from None
                raise
            try:
                tx.__exit__(None, None, None)  # COMMIT
            except psycopg.OperationalError as err:
                lost = self._lost(db, err)
                if lost is None:
                    raise
                raise StoreUnreachable(self.url, lost.reason, unknown=True) from None
            self.problem = None

    def _read(self, sql: str, params: tuple | list = ()) -> list[tuple]:
        import psycopg

        with self._lock:
            for attempt in (0, 1):
                db = self._connected()
                try:
                    rows = db.execute(sql, params).fetchall()
                except psycopg.OperationalError as err:
                    lost = self._lost(db, err)
                    if lost is None:
                        raise
                    if attempt:
                        raise lost from None
                    continue  # a read is run again on a new connection: it changes nothing
                self.problem = None
                return rows
        raise AssertionError("unreachable")

    def probe(self) -> None:
        """One round trip (reconnecting if need be): clears `problem`, or raises StoreUnreachable."""
        self._read("SELECT 1")

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
            if rows:  # the server whose folder holds its MP4 and preview removes them (`Scheduler._noticed`)
                db.execute(NOTIFY, (DELETED_CHANNEL, job_id))
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
            ahead = db.execute(QUEUED_COUNT).fetchone()[0]
            if ahead + waiting >= limit:
                raise QueueLimit(limit)
            db.execute(INSERT, values)
            db.execute(ENQUEUE, (job.id, queued_at, request, needs.build, needs.task, list(needs.adapters),
                                 needs.rows, self.server_id))  # fmt: skip
            # Its first event, as one server's queue gives it; its holder's log continues from it (`Claim.history`).
            db.execute(PUT_EVENT, (job.id, 1, "queued", json.dumps({"ahead": ahead})))

    def queued_count(self) -> int:
        return self._read(QUEUED_COUNT)[0][0]

    def claim(
        self, capabilities: Capabilities, before: float, lease_s: float
    ) -> tuple[str, int, bytes, tuple[StoredEvent, ...]] | None:
        """Claim the oldest job this server can render (queued, or in progress with its lease run out) queued before
        `before`: (id, generation, the stored request, its events stored so far), or None. SKIP LOCKED: servers
        claiming at once each get another job, none waits on another's claim."""
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
            history = db.execute(EVENTS_SINCE, (job_id, 0, KEEP_PROGRESS * 4)).fetchall()
        return job_id, generation, bytes(request), tuple(_stored(row) for row in history)

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

    def write_held(
        self, job_id: str, generation: int, ending: bool, event: tuple[str, dict] | None = None, **changes: Any
    ) -> bool:
        """Write a held job's record, only while this server holds its claim of `generation` (the claim row locked
        for the write, so no claim slips in between); `ending`: the job has finished and its lease is let go;
        `event` (name, data): one for its streams, stored with it (a job that has no log on any server). False: not
        held (claimed again, or deleted); nothing written."""
        assign, values = self._assign(changes)
        with self._transaction() as db:
            if db.execute(HOLDS, (job_id, self.server_id, generation)).fetchone() is None:
                return False
            db.execute(f"UPDATE jobs SET {assign} WHERE {ID_COLUMN}=%s", (*values, job_id))
            if ending:
                db.execute("UPDATE job_claims SET lease_until=NULL, open=false WHERE job_id=%s", (job_id,))
            if event is not None:
                self._put_next(db, job_id, *event)
        return True

    @staticmethod
    def _put_next(db: Any, job_id: str, name: str, data: dict[str, Any]) -> None:
        """One event after the job's last stored one, and the notice that wakes its streams (at commit)."""
        db.execute(NEXT_EVENT, (job_id, name, json.dumps(data, separators=(",", ":")), job_id))
        db.execute(NOTIFY, (EVENTS_CHANNEL, job_id))

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
                self._put_next(db, job_id, *_ending_event(changes))
                return "cancelled"
            db.execute("UPDATE job_claims SET cancel_reason=%s WHERE job_id=%s", (reason, job_id))
            # The holder is told now (`listen`), not at its next heartbeat (which still reads the reason, should the
            # notice be missed: the holder's listener reconnecting).
            notice = {"job": job_id, "server": row[1], "reason": (reason or "cancelled")[:MAX_REASON]}
            db.execute(NOTIFY, (CANCEL_CHANNEL, json.dumps(notice)))
            return "held"

    def fail_unreadable(self, job_id: str, generation: int, changes: dict[str, Any]) -> None:
        """A claimed job whose stored request does not decode: failed (its holder's write), never claimed again."""
        if not self.write_held(job_id, generation, True, event=_ending_event(changes), **changes):
            return
        log.error("job %s: its stored request cannot be read; failed (%s)", job_id, changes["error"].message)

    def queue(self) -> list[tuple[str, int]]:
        """The fleet's queued jobs in claim order, each with how many live servers can render it."""
        return [(job_id, takers) for job_id, takers in self._read(QUEUE)]

    # ---- one API across the fleet: events, previews, holders, notices ------------------------------------------
    def publish(self, batch: list[Relayed]) -> None:
        """Store events a holder relays (`events.Relay`), in one transaction, each job's only while this server holds
        its claim of that generation (the claim row shared-locked, so a DELETE waits for the commit), with its latest
        preview, and one notice per job (at commit) for the servers whose streams watch it. A job's progress events
        beyond the latest KEEP_PROGRESS go, as a server's own log drops them."""
        jobs: dict[tuple[str, int], list[Relayed]] = {}
        for item in batch:
            jobs.setdefault((item.job_id, item.generation), []).append(item)
        with self._transaction() as db:
            for (job_id, generation), items in jobs.items():
                if db.execute(HOLDS_SHARE, (job_id, self.server_id, generation)).fetchone() is None:
                    continue  # claimed again, given back or deleted: this server relays nothing more of it
                rows = [(job_id, i.event.id, i.event.name, json.dumps(i.event.data, separators=(",", ":")))
                        for i in items]  # fmt: skip
                with db.cursor() as cursor:
                    cursor.executemany(PUT_EVENT, rows)
                png = next((i.png for i in reversed(items) if i.png is not None), None)
                if png is not None:
                    db.execute(PUT_PREVIEW, (job_id, png))
                if any(i.event.name == "progress" for i in items):
                    db.execute(PRUNE_PROGRESS, (job_id, job_id, KEEP_PROGRESS))
                db.execute(NOTIFY, (EVENTS_CHANNEL, job_id))

    def events_since(self, job_id: str, last: int) -> list[StoredEvent]:
        return [_stored(row) for row in self._read(EVENTS_SINCE, (job_id, last, KEEP_PROGRESS * 4))]

    def preview(self, job_id: str) -> bytes | None:
        rows = self._read("SELECT png FROM job_previews WHERE job_id=%s", (job_id,))
        return bytes(rows[0][0]) if rows else None

    def holders(self, job_ids: list[str] | None = None) -> dict[str, str]:
        """{job id: server}: for `job_ids`, the server that holds or last held each (and rendered it, once ended);
        for None, the jobs held now (in progress)."""
        if job_ids is None:
            return dict(self._read(HELD_NOW))
        return dict(self._read(HELD_BY, (list(job_ids),))) if job_ids else {}

    def listen(self, on_notice: Callable[[Notice], None], stop: threading.Event) -> None:
        """The fleet's notices, on a connection of their own (LISTEN), each handed to `on_notice` as it comes, until
        `stop` is set. A lost connection is opened again (every RECONNECT_GAP_S while the database is down); after
        such a gap a RECONNECTED notice says that notices may have been missed, so that its receiver looks again."""
        import psycopg

        db, was_lost = None, False
        while not stop.is_set():
            if db is None:
                try:
                    db = connect(self._dsn)
                    for channel in CHANNELS:
                        db.execute(f"LISTEN {channel}")
                except (PostgresStoreError, psycopg.Error) as err:
                    if db is not None:
                        db.close()
                        db = None
                    if not was_lost:
                        why = err.reason if isinstance(err, PostgresStoreError) else _words(err, self._dsn)
                        log.warning("job store %s: the fleet's notices cannot be listened to (%s); retrying",
                                    self.url, why)  # fmt: skip
                    was_lost = True
                    stop.wait(RECONNECT_GAP_S)
                    continue
                if was_lost:
                    log.warning("job store %s: listening to the fleet's notices again", self.url)
                    _hand(on_notice, Notice(NoticeKind.RECONNECTED))
                was_lost = False
            try:
                for n in db.notifies(timeout=LISTEN_WAKE_S):
                    notice = _notice(n.channel, n.payload)
                    if notice is not None:
                        _hand(on_notice, notice)
            except psycopg.Error as err:
                log.warning("job store %s: the fleet's notices' connection was lost (%s)", self.url,
                            _words(err, self._dsn))  # fmt: skip
                db.close()
                db, was_lost = None, True
        if db is not None:
            db.close()


def _stored(row: tuple) -> StoredEvent:
    return StoredEvent(int(row[0]), row[1], json.loads(row[2]))


def _ending_event(changes: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The end event of a job ended in the store (cancelled while queued, failed unread), as a holder's would be."""
    status = str(changes["status"])
    return status, {"status": status, "error": changes["error"].model_dump()}


def _notice(channel: str, payload: str) -> Notice | None:
    """A NOTIFY as the notice it is; None for one that is not (logged)."""
    kind = CHANNELS.get(channel)
    if kind is NoticeKind.CANCEL:
        try:
            body = json.loads(payload)
            return Notice(kind, str(body["job"]), body.get("server"), body.get("reason"))
        except (ValueError, KeyError, TypeError):
            log.warning("a cancel notice that is not one was ignored: %r", payload[:200])
            return None
    return Notice(kind, payload) if kind is not None else None


def _hand(on_notice: Callable[[Notice], None], notice: Notice) -> None:
    """A notice to its receiver; the receiver's error is logged, and the listener goes on."""
    try:
        on_notice(notice)
    except Exception:
        log.exception("a fleet notice (%s, job %s) could not be handled", notice.kind, notice.job_id)


def _is_driver_error(err: BaseException) -> bool:
    import psycopg

    return isinstance(err, psycopg.Error)
