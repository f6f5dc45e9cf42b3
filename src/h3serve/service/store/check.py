"""Damage: the store is checked before it is opened (`inspect_store`: SQLite's integrity check, the `jobs` table's
columns, every row decoded) and a damaged one is refused (`StoreDamaged`), as is a store that lacks jobs the folder
holds (an empty store beside MP4s). The same report is what `h3serve store check` prints.

A `.json` in videos/ whose name is not a job id is no job's record: listed, never read.

With H3_OUTPUT_URL (`objects.S3Outputs`) the MP4s are in the bucket, and `store check` lists it: a completed record
whose object is missing, an object no record names (left in the bucket) and the uploads never completed (a server
stopped mid-upload) are reported; a bucket that cannot be listed fails the check. The records beside the MP4s
(videos/<id>.json) stay in the output folder either way. The start's check does not list the bucket (a start checks
that it answers and takes an upload: `objects.check_outputs`).
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass, field
from pathlib import Path

from h3serve.errors import shown
from h3serve.service.schemas import JobStatus, VideoJob
from h3serve.service.store.lock import START_CHECK, FolderLock, os_reason
from h3serve.service.store.objects import ObjectsUnavailable, S3Outputs
from h3serve.service.store.rows import COLUMNS, JOB_ID, KEY, MP4, STORE_FILE, decode_row, decode_text, row_id
from h3serve.service.store.sidecars import SIDECAR

# How long the start's probe of SQLite's write lock waits for a transaction another process holds open. No h3serve
# process can hold one (the folder's lock keeps them out): whoever does is a person's sqlite3 shell or a backup.
SQLITE_LOCK_WAIT_S = 1.0


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
    missing_mp4s: list[str] = field(default_factory=list)  # completed records whose MP4 is not on disk (or in bucket)
    bucket: str | None = None  # H3_OUTPUT_URL's s3://BUCKET/PREFIX/, where the MP4s are (None: videos/)
    objects: list[str] = field(default_factory=list)  # ids of the MP4s in the bucket
    objects_problem: str | None = None  # why the bucket could not be listed
    incomplete_uploads: list[str] = field(default_factory=list)  # keys of uploads never completed nor aborted

    @property
    def unrecorded_mp4s(self) -> list[str]:
        return [i for i in self.mp4s if i not in self.ids]

    @property
    def unrecorded_objects(self) -> list[str]:
        """MP4s in the bucket that no record of the store names (a stop between an upload and its record)."""
        return [i for i in self.objects if i not in self.ids]

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
        if self.objects_problem:
            out.append(self.objects_problem)
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
        if self.bucket is not None:
            if self.objects_problem:
                out.append(f"bucket: {self.objects_problem}")
            else:
                out.append(f"objects: {len(self.objects)} MP4(s) in {self.bucket}")
            out += [f"  object without a record in the store: {self.bucket}{i}{MP4}" for i in self.unrecorded_objects]
            out += [
                f"  upload never completed (a server stopped mid-upload; a lifecycle rule aborts it): {k}"
                for k in self.incomplete_uploads
            ]
        out += [f"  completed record whose MP4 is missing: {i}" for i in self.missing_mp4s]
        out += [f"  ignored: {in_videos(name)} (its name is no job id: no job's record)" for name in self.ignored]
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


def in_videos(name: str) -> str:
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
        report.folder_problem = f"{videos} cannot be listed ({os_reason(err)})"
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
            job = decode_row(row[1:])
        except ValueError as err:
            report.damaged.append(DamagedRow(row[0], row_id(row[0], row[1]), str(err)))
            if isinstance(row[1], str):
                report.ids.add(row[1])  # a damaged row is still a record of that id: its files are not "unrecorded"
            continue
        report.ids.add(job.id)
        jobs.append(job)
    return jobs


def inspect_store(
    output_dir: Path, rows: list[VideoJob] | None = None, outputs: S3Outputs | None = None
) -> StoreReport:
    """`inspect_file`'s report; with `outputs` (H3_OUTPUT_URL's bucket) the records' MP4s are looked for there, and
    the bucket's own findings added (`objects_in`)."""
    read: list[VideoJob] = rows if rows is not None else []
    report = inspect_file(output_dir, read)
    if outputs is not None:
        objects_in(report, outputs, read)
    return report


def objects_in(report: StoreReport, outputs: S3Outputs, jobs: list[VideoJob]) -> None:
    """The bucket's MP4s into `report`: which are there, which completed records lack theirs (instead of videos/'s
    files), and the uploads never completed; `objects_problem` when it cannot be listed."""
    report.bucket = f"s3://{outputs.bucket}/{outputs.prefix}"
    try:
        listing = outputs.listing()
    except ObjectsUnavailable as err:
        report.objects_problem = f"the bucket {outputs.where} cannot be listed ({err.reason})"
        return
    report.objects, report.incomplete_uploads = listing.ids, listing.incomplete
    stored = set(listing.ids)
    report.missing_mp4s = [
        j.id for j in jobs if j.status == JobStatus.COMPLETED and j.file_name and j.file_name[: -len(MP4)] not in stored
    ]


def inspect_file(output_dir: Path, rows: list[VideoJob] | None = None) -> StoreReport:
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
    db.text_factory = decode_text
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
    report = refuse_damage(output_dir)
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


def refuse_damage(output_dir: Path) -> StoreReport:
    """StoreDamaged if the store must not be opened as it is; else its report."""
    report = inspect_store(output_dir)
    if report.refusals():
        raise StoreDamaged(report)
    return report
