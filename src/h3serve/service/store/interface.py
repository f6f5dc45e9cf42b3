"""`JobRecords`: what the service asks of a job store, whichever holds the records: `jobs.JobStore` (SQLite in the
output folder, the embedded default) or `postgres.PostgresJobStore` (H3_STORE, a postgresql:// URL). The MP4s are in
`videos` in the output folder for both.

Both keep one contract (tests/test_store_backends.py runs the same tests against each): a record reads back as it was
written, field for field; `update` refuses a name that is no VideoJob field; the list is newest first (or oldest
first) by creation time, then insertion order, paged by the id of the previous page's last job; `counts` has every
state; `delete` removes the record and the job's own MP4; a row that does not decode is a DamagedRecord in the list and
RecordDamaged from `get`, never the failure of the list; a store opened again marks the jobs a previous process left
active failed (interrupted).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from h3serve.service.schemas import VideoJob
from h3serve.service.store.check import check_store
from h3serve.service.store.jobs import DamagedRecord, JobStore
from h3serve.service.store.lock import START_CHECK, FolderLock


class JobRecords(Protocol):
    output_dir: Path
    videos: Path
    recovered: int  # jobs the open found active and marked failed (interrupted)

    def insert(self, job: VideoJob) -> None: ...

    def update(self, job_id: str, **changes: Any) -> None: ...

    def entry(self, job_id: str) -> VideoJob | DamagedRecord | None: ...

    def get(self, job_id: str) -> VideoJob | None: ...

    def list(
        self, limit: int, after: str | None = None, oldest_first: bool = False
    ) -> tuple[list[VideoJob | DamagedRecord], bool]: ...

    def delete(self, job_id: str) -> None: ...

    def counts(self) -> dict[str, int]: ...

    def path(self, job: VideoJob) -> Path | None: ...

    def close(self) -> None: ...


def open_store(
    output_dir: Path, url: str | None, *, lock: FolderLock | None = None, server_id: str | None = None
) -> JobRecords:
    """The store H3_STORE names: SQLite in `output_dir` when `url` is None, else PostgreSQL (psycopg imported only
    then), whose claims carry `server_id` (H3_SERVER_ID; None: a new name). `lock`: the output folder's, held by the
    caller (see JobStore)."""
    if url is None:
        return JobStore(output_dir, lock=lock)
    from h3serve.service.store.postgres import PostgresJobStore

    return PostgresJobStore(url, output_dir, lock=lock, server_id=server_id)


def check_job_store(output_dir: Path, url: str | None, server_id: str | None = None) -> None:
    """The start's check of the store H3_STORE names, before any weight loads (`check.check_store` for SQLite,
    `postgres.check_postgres_store`, with the server's name where H3_SERVER_ID gives one); a ValueError naming the
    store and what is wrong."""
    if url is None:
        check_store(output_dir)
        return
    from h3serve.service.store.postgres import check_postgres_store

    if output_dir.is_dir():
        FolderLock(output_dir, START_CHECK).release()  # as check_store: free now; the server's store takes it
    check_postgres_store(url, output_dir, server_id)
