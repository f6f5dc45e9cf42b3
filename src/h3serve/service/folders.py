"""The folders a service writes and its start's checks of them: checked once at start (`check_service`, after
`startup.preflight`, before any weight loads) and again by the service's readiness (`scheduler.Scheduler.standing`)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from h3serve.errors import SettingError
from h3serve.service.store import FolderBusy, check_job_store
from h3serve.service.store.objects import check_outputs
from h3serve.settings import Settings
from h3serve.startup import check_port

PROBE_PREFIX = ".h3serve-probe-"


def check_service(settings: Settings) -> None:
    """What a service needs of this machine beyond the engine's preflight: the output folder, its job store and the
    port, and H3_OUTPUT_URL's bucket, each refused as its setting's SettingError. Node 0's only: another node serves
    nothing."""
    check_output_dir(settings.output_dir)
    _check_job_store(settings.output_dir, settings.store, settings.server_id)
    check_outputs(settings)  # H3_OUTPUT_URL's bucket answers and takes an upload (`store.objects`)
    check_port(settings.bind_host, settings.api_port)


def check_output_dir(path: Path) -> None:
    """The output folder, its videos/ and the temporary folder each take a new file now (`folder_problems`)."""
    try:
        (path / "videos").mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise SettingError("output_dir", f"{path}: cannot create it and its videos/ folder ({err})") from err
    if not os.access(path, os.W_OK | os.X_OK):
        raise SettingError("output_dir", f"{path}: not writable")
    folders = service_folders(path)
    if problems := folder_problems(folders):
        raise SettingError("output_dir", describe_folders(problems, folders))


def _check_job_store(path: Path, url: str | None = None, server_id: str | None = None) -> None:
    """The job store in the output folder, checked before any weight loads: the folder not in use by another h3serve
    process (its lock, which a server holds while it runs), the store opened read-only and checked (integrity, its
    table, every record, jobs the folder holds that the store lacks), and SQLite's write lock free. Each refusal is
    H3_OUTPUT_DIR's, naming the file and what is wrong. With H3_STORE (PostgreSQL): the database answers, no other
    running server has this H3_SERVER_ID, its tables and rows are sound (`store.postgres.check_postgres_store`),
    H3_STORE's refusal (H3_SERVER_ID's for a name in use)."""
    try:
        check_job_store(path, url, server_id)
    except ValueError as err:  # FolderBusy, StoreDamaged, StoreUnavailable, PostgresStoreError: each text names it
        setting = "store" if url is not None and not isinstance(err, FolderBusy) else "output_dir"
        if server_id is not None and getattr(err, "busy", False) and url is not None:
            setting = "server_id"  # another running server of the fleet has this name
        raise SettingError(setting, str(err)) from err


def service_folders(output_dir: Path) -> dict[str, Path]:
    """The folders a service writes, by the name /health reports them under: the job store's (jobs.sqlite3 and its
    WAL), videos/ (the async jobs' MP4s, written under a temporary name there and renamed when complete) and the
    temporary folder (tempfile.gettempdir(), TMPDIR), where a sync render's MP4 is encoded before it is sent."""
    return {"output_dir": output_dir, "videos": output_dir / "videos", "temp": Path(tempfile.gettempdir())}


def unwritable(folder: Path) -> str | None:
    """Why a file cannot be created in `folder` now (the OS's words), or None when one can. A file is created and
    removed: permission bits alone would pass for root, and a read-only mount or a file in place of the folder
    refuses root too."""
    try:
        fd, name = tempfile.mkstemp(prefix=PROBE_PREFIX, dir=folder)
    except OSError as err:
        return err.strerror or type(err).__name__
    os.close(fd)
    os.unlink(name)
    return None


def folder_problems(folders: dict[str, Path]) -> dict[str, str]:
    """{name: why} for every folder that cannot be written now; empty when all can."""
    return {name: why for name, path in folders.items() if (why := unwritable(path)) is not None}


def describe_folders(problems: dict[str, str], folders: dict[str, Path] | None = None) -> str:
    """One line naming each unwritable folder by its name, and its path where `folders` is given (a refusal, the log;
    not /health, which answers without a key)."""
    return "; ".join(
        f"the {name} folder{'' if folders is None else f' {folders[name]}'} is not writable ({why})"
        for name, why in problems.items()
    )
