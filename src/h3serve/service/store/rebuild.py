"""`rebuild_store`: a new store made from the folder, from the job records beside the MP4s (`sidecars`) and the old
store's readable rows, with the old store moved aside and never deleted."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import stat
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from h3serve.files import FileRefused
from h3serve.service.schemas import JobStatus, VideoJob
from h3serve.service.store.check import DamagedRow, in_videos, inspect_store
from h3serve.service.store.lock import REBUILD, FolderLock, os_reason
from h3serve.service.store.objects import S3Outputs
from h3serve.service.store.rows import CREATE, FIELDS, INSERT, MP4, STORE_FILE, encode
from h3serve.service.store.sidecars import SIDECAR, read_sidecar


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
    bucket: str | None = None  # H3_OUTPUT_URL's s3://BUCKET/PREFIX/, where the MP4s are (None: videos/)
    missing_objects: list[str] = field(default_factory=list)  # completed jobs of the new store without their object
    unrecorded_objects: list[str] = field(default_factory=list)  # objects no record names: left in the bucket

    def lines(self, store: Path) -> list[str]:
        out = [f"moved aside: {p}" for p in self.moved]
        out.append(
            f"rebuilt {store}: {self.from_sidecars + self.from_rows} job(s), {self.from_sidecars} from the records in "
            f"videos/, {self.from_rows} from the old store's readable rows"
        )
        out += [f"  not recovered: row {d.rowid} (id {d.job_id[:80]}): {d.why}" for d in self.lost]
        out += [f"  record skipped: {in_videos(s.name)}: {s.why}" for s in self.bad_sidecars]
        out += [f"  ignored: {in_videos(name)} (its name is no job id: no job's record)" for name in self.ignored]
        if self.unrecorded is not None:
            out.append(f"MP4s with no record anywhere, and records that were skipped, moved to {self.unrecorded}")
        out += [f"  not moved: {in_videos(s.name)}: {s.why}" for s in self.not_moved]
        out += [
            f"  completed record whose MP4 is missing from {self.bucket}: {i} (its download answers 410)"
            for i in self.missing_objects
        ]
        out += [f"  object no record names, left in the bucket: {self.bucket}{i}{MP4}" for i in self.unrecorded_objects]
        return out


def rebuild_store(
    output_dir: Path, now: float | None = None, *, lock: FolderLock | None = None, outputs: S3Outputs | None = None
) -> Rebuilt:
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
    already). FileRefused, with nothing changed, when videos/ is there and no folder.

    With `outputs` (H3_OUTPUT_URL's bucket, where the MP4s are): the bucket is listed first (a ValueError, nothing
    changed, when it cannot be), and the completed records whose object is missing and the objects no record names
    are listed in the result; nothing in the bucket is moved or deleted."""
    with contextlib.nullcontext(lock) if lock is not None else FolderLock(output_dir, REBUILD):
        return _rebuild(output_dir, now, outputs)


def _rebuild(output_dir: Path, now: float | None, outputs: S3Outputs | None = None) -> Rebuilt:
    videos = output_dir / "videos"
    if (videos.exists() or videos.is_symlink()) and not videos.is_dir():
        raise FileRefused(videos, "is not a folder: move it aside; the MP4s and their records belong in a folder there")
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))
    taken = (f"{STORE_FILE}.damaged-{stamp}", f"unrecorded-{stamp}")
    if any((output_dir / name).exists() for name in taken):  # a second rebuild within the second: never replace
        stamp = f"{stamp}-{uuid.uuid4().hex[:8]}"
    videos.mkdir(parents=True, exist_ok=True)
    rows: list[VideoJob] = []
    report = inspect_store(output_dir, rows, outputs)
    if report.objects_problem:
        raise ValueError(f"{report.objects_problem}: the rebuild lists the bucket first")
    records, bad = _read_sidecars(videos, report.sidecars)
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
    _build(building, records.values())
    moved = _swap(output_dir, building, stamp)

    stray = [f"{i}{MP4}" for i in report.mp4s if f"{i}{MP4}" not in named]
    stray += [s.name for s in bad]
    unrecorded, not_moved = _move_unrecorded(output_dir, stray, stamp) if stray else (None, [])
    rebuilt = Rebuilt(moved, from_sidecars, from_rows, lost, bad, report.ignored, unrecorded, not_moved)
    if outputs is not None:
        stored = set(report.objects)
        rebuilt.bucket = report.bucket
        rebuilt.missing_objects = sorted(
            j.id for j in records.values() if j.status == JobStatus.COMPLETED and j.file_name and j.id not in stored
        )
        rebuilt.unrecorded_objects = [i for i in report.objects if i not in records]
    return rebuilt


def _read_sidecars(videos: Path, ids: list[str]) -> tuple[dict[str, VideoJob], list[Skipped]]:
    """The records of videos/<id>.json that pass `read_sidecar`'s checks, by id; and the ones skipped, with why."""
    records: dict[str, VideoJob] = {}
    bad: list[Skipped] = []
    for job_id in ids:
        name = f"{job_id}{SIDECAR}"
        try:
            records[job_id] = read_sidecar(videos / name)
        except FileRefused as err:
            bad.append(Skipped(name, err.reason))
        except (ValueError, OSError) as err:
            bad.append(Skipped(name, str(err)))
    return records, bad


def _build(building: Path, records: Iterable[VideoJob]) -> None:
    """A new store at `building` holding `records`, in one transaction; on any failure nothing is left there."""
    building.unlink(missing_ok=True)
    try:
        db = sqlite3.connect(building, isolation_level=None)
        try:
            db.execute("BEGIN")
            db.execute(CREATE)
            for job in sorted(records, key=lambda j: (j.created_at, j.id)):  # rowid order: creation order
                db.execute(INSERT, [v for f in FIELDS for _, v in encode(f, getattr(job, f))])
            db.execute("COMMIT")
        finally:
            db.close()
    except BaseException:
        for leftover in (building, building.with_name(f"{building.name}-journal")):
            leftover.unlink(missing_ok=True)
        raise


def _swap(output_dir: Path, building: Path, stamp: str) -> list[Path]:
    """The old store's files moved aside (`jobs.sqlite3.damaged-<stamp>...`) and the built one renamed into place; the
    files moved aside."""
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
        os.replace(building, output_dir / STORE_FILE)
    except OSError:
        for old, aside in reversed(pairs):
            with contextlib.suppress(OSError):
                os.replace(aside, old)
        building.unlink(missing_ok=True)
        raise
    return [aside for _, aside in pairs]


def _move_unrecorded(output_dir: Path, stray: list[str], stamp: str) -> tuple[Path, list[Skipped]]:
    """Files of videos/ (by name) moved to `unrecorded-<stamp>/`: that folder, and the files that could not be moved
    there, with why (listed, never raised: the new store is in place already)."""
    videos, unrecorded = output_dir / "videos", output_dir / f"unrecorded-{stamp}"
    try:
        unrecorded.mkdir()
    except OSError as err:
        return unrecorded, [Skipped(name, f"{unrecorded} cannot be made ({os_reason(err)})") for name in stray]
    not_moved = []
    for name in stray:
        try:
            os.replace(videos / name, unrecorded / name)  # a rename: the file itself is never opened
        except OSError as err:
            not_moved.append(Skipped(name, os_reason(err)))
    return unrecorded, not_moved


def _regular(path: Path) -> bool:
    """A regular file, not a link to one."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False
