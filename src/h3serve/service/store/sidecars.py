"""Each finished job's record beside its MP4, `videos/<id>.json`, written atomically, so that `rebuild.rebuild_store`
can make a new store from the folder when the store is lost or damaged.

A record file is read only if it is a regular file, not a link, of at most RECORD_CAP bytes, named by a job id
(JOB_ID), and every field of it passes the checks a row does.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

from pydantic import ValidationError

from h3serve.errors import shown
from h3serve.files import read_regular
from h3serve.service.schemas import JobStatus, VideoJob
from h3serve.service.store.rows import FIELDS, JOB_ID, encode, file_problem

FINISHED = (JobStatus.COMPLETED, JobStatus.FAILED, JobStatus.CANCELLED)  # the states whose record has a sidecar
SIDECAR = ".json"  # a finished job's record beside its MP4: videos/<id>.json
# The most bytes a record file may hold: the longest prompt (100,000 characters, H3_MAX_PROMPT_CHARS's bound) at 6
# bytes each (a control character as JSON writes it, \u0001) is 600 KB; the rest of a record is a few KB.
RECORD_CAP = 4 << 20
# The range of SQLite's INTEGER: a record file's larger integer is refused rather than failing the rebuild's insert.
_INT64 = (-(1 << 63), (1 << 63) - 1)


def write_sidecar(videos: Path, job: VideoJob) -> Path:
    """`videos/<id>.json`, written whole or not at all: a temporary file (named as `JobStore._recover` sweeps),
    fsynced, renamed over the old one, and the folder fsynced so that the rename itself survives a power loss."""
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
    file name that job's MP4 (`file_problem`), its values what the store can hold. ValueError saying what is wrong
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
    for problem in (file_problem(job), _storable(job)):
        if problem is not None:
            raise ValueError(problem)
    return job


def _storable(job: VideoJob) -> str | None:
    """Why a record's values cannot be stored as they are (None: they can): an integer beyond SQLite's 64 bits, text
    that is not UTF-8 (a lone surrogate, which JSON's \\ud800 can spell). Checked before a rebuild's insert, which would
    fail on them."""
    for f in FIELDS:
        for c, value in encode(f, getattr(job, f)):
            if isinstance(value, int) and not _INT64[0] <= value <= _INT64[1]:
                return f"{c.name}: an integer beyond SQLite's 64 bits"
            if isinstance(value, str):
                try:
                    value.encode("utf-8")
                except UnicodeEncodeError:
                    return f"{c.name}: not UTF-8 text (a lone surrogate)"
    return None
