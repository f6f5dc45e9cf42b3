"""A real PostgreSQL server for the job store's tests (../shared/h3/TEST_SERVERS.md's tested recipe): Debian's
`initdb`/`pg_ctl` in a fresh folder on a free loopback port, run as the `postgres` user when the tests run as root
(initdb refuses root), fsync off, stopped at the end of the session. With H3_TEST_DATABASE_URL set, that server is used
instead (its user needs CREATEDB). Each test gets a database of its own (`fresh_database`), dropped after it.

Where no `initdb` is installed the PostgreSQL variants skip, naming the package; with H3TEST_REQUIRE_POSTGRES=1 (as
CI sets it) they fail instead.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import socket
import sqlite3
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from h3serve.service.store import STORE_FILE

INSTALL = "apt-get install -y postgresql"
START_WAIT_S = 60  # pg_ctl -w's bound on the server's start (it polls the server, not the clock)


def _bin() -> Path | None:
    version = lambda p: int(Path(p).parents[1].name) if Path(p).parents[1].name.isdigit() else 0  # noqa: E731
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=version)
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).resolve().parent if initdb else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _unavailable(why: str):
    if os.environ.get("H3TEST_REQUIRE_POSTGRES") == "1":
        pytest.fail(f"{why} (H3TEST_REQUIRE_POSTGRES=1: the PostgreSQL store's tests must run)")
    pytest.skip(why)


@contextlib.contextmanager
def postgres_server() -> Iterator[str]:
    """The URL of a server's `postgres` database, as its superuser: a started one, or H3_TEST_DATABASE_URL."""
    try:
        import psycopg  # noqa: F401
    except ImportError:
        _unavailable("psycopg is not installed: pip install 'psycopg[binary]' (the test extra has it)")
    given = os.environ.get("H3_TEST_DATABASE_URL")
    if given:
        yield given
        return
    pgbin = _bin()
    if pgbin is None:
        _unavailable(f"PostgreSQL's initdb is not installed: {INSTALL}")
    as_postgres = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    # Not pytest's tmp_path: /tmp/pytest-of-root is 0700, and the server runs as `postgres`.
    root = Path(tempfile.mkdtemp(prefix="h3test-pg-"))
    root.chmod(0o755)
    home = root / "pg"
    home.mkdir()
    if as_postgres:
        shutil.chown(home, "postgres", "postgres")
    data = home / "data"
    run = lambda *args: subprocess.run([*as_postgres, *map(str, args)], check=True, capture_output=True, text=True)  # noqa: E731
    started = False
    try:
        run(pgbin / "initdb", "-D", data, "-U", "postgres", "-A", "trust", "--no-sync")
        for _ in range(3):  # a free port can be taken between our look and the server's bind: try another
            port = _free_port()
            options = (
                f"-p {port} -k {home} -c listen_addresses=127.0.0.1 -c fsync=off -c synchronous_commit=off "
                "-c full_page_writes=off"
            )
            try:
                run(pgbin / "pg_ctl", "-D", data, "-l", home / "log", "-w", "-t", START_WAIT_S, "-o", options, "start")
            except subprocess.CalledProcessError:
                continue
            started = True
            break
        if not started:
            log = (home / "log").read_text(errors="replace")[-2000:] if (home / "log").exists() else ""
            raise RuntimeError(f"PostgreSQL did not start on three free ports; its log ends:\n{log}")
        yield f"postgresql://postgres@127.0.0.1:{port}/postgres"
    finally:
        if started:
            run(pgbin / "pg_ctl", "-D", data, "-m", "immediate", "-w", "stop")
        shutil.rmtree(root, ignore_errors=True)


@contextlib.contextmanager
def fresh_database(admin_url: str) -> Iterator[str]:
    """A new, empty database on the server of `admin_url`: its URL, the database dropped afterwards."""
    import psycopg

    name = f"h3test_{uuid.uuid4().hex[:16]}"
    with psycopg.connect(admin_url, autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {name}")
    try:
        yield _with_database(admin_url, name)
    finally:
        with psycopg.connect(admin_url, autocommit=True) as admin:
            admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def _with_database(url: str, name: str) -> str:
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, f"/{name}", parts.query, ""))


@dataclass
class Backend:
    """One store kind: `url` None for SQLite, else the PostgreSQL database of this test."""

    name: str
    url: str | None

    def open(self, output_dir: Path, **options: Any):
        if self.url is None:
            from h3serve.service.store import JobStore

            return JobStore(output_dir, **options)
        from h3serve.service.store.postgres import PostgresJobStore

        return PostgresJobStore(self.url, output_dir, **options)

    def execute(self, output_dir: Path, sql: str, params: tuple = ()) -> int:
        """Raw SQL against the store's table, as a person with a database shell would (`?` placeholders)."""
        if self.url is None:
            db = sqlite3.connect(output_dir / STORE_FILE)
            try:
                n = db.execute(sql, params).rowcount
                db.commit()
                return n
            finally:
                db.close()
        import psycopg

        with psycopg.connect(self.url, autocommit=True) as db:
            return db.execute(sql.replace("?", "%s"), params).rowcount
