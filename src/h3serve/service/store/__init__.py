"""The job store: typed job records (`schemas.VideoJob`) in an embedded SQLite database next to the outputs.

The store lives in `output_dir/jobs.sqlite3`, the MP4s in `output_dir/videos/<id>.mp4` (server-chosen names: nothing a
client sends becomes a path). One module for each part of the work:

    rows       a record as a row of the `jobs` table: the table derived from VideoJob, encoding and decoding
    jobs       JobStore, the records read and written by the service; a row that does not decode is a DamagedRecord
    sidecars   each finished job's record beside its MP4 (videos/<id>.json), what a rebuild is made from
    check      the check before a store is opened (inspect_store, check_store) and the report `store check` prints
    rebuild    rebuild_store: a new store from the folder, the old one moved aside
    lock       FolderLock: one h3serve process per output folder
    base       RecordStore: what both stores share (reads, the list, counts, the start's recovery)
    claims     the fleet's claims on a PostgreSQL store: a job's needs, a server's capabilities, the stored request
    postgres   PostgresJobStore: the same records in PostgreSQL (H3_STORE=postgresql://...), psycopg imported only then
    interface  JobRecords, what the service asks of either store; open_store and check_job_store choose by H3_STORE

The modules import each other in that order from the bottom (rows, lock, sidecars, check, jobs, rebuild); this file
names what the rest of h3serve uses.
"""

from h3serve.service.store.check import StoreDamaged, StoreReport, StoreUnavailable, check_store, inspect_store
from h3serve.service.store.claims import Fleet, LeaseLost, QueueLimit, new_server_id
from h3serve.service.store.interface import JobRecords, check_job_store, open_store
from h3serve.service.store.jobs import ACTIVE, DamagedRecord, JobStore, RecordDamaged, job_record
from h3serve.service.store.lock import REBUILD, SERVER, FolderBusy, FolderLock
from h3serve.service.store.rebuild import Rebuilt, rebuild_store
from h3serve.service.store.rows import COLUMNS, FIELDS, PLAIN_ID, STORE_FILE, ValueRefused, new_job_id

__all__ = [
    "ACTIVE",
    "COLUMNS",
    "FIELDS",
    "PLAIN_ID",
    "REBUILD",
    "SERVER",
    "STORE_FILE",
    "DamagedRecord",
    "Fleet",
    "FolderBusy",
    "FolderLock",
    "JobRecords",
    "JobStore",
    "LeaseLost",
    "QueueLimit",
    "Rebuilt",
    "RecordDamaged",
    "StoreDamaged",
    "StoreReport",
    "StoreUnavailable",
    "ValueRefused",
    "check_job_store",
    "check_store",
    "inspect_store",
    "job_record",
    "new_job_id",
    "new_server_id",
    "open_store",
    "rebuild_store",
]
