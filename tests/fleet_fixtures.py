"""Helpers for the fleet's tests with real processes (tests/test_fleet_show.py, tests/test_fleet_soak.py) and a
PostgreSQL a test may stop (tests/test_fleet_api.py, tests/test_fleet_soak.py): `Serve`, one `h3serve serve` process
on a free loopback port; `server_env`, its environment; `claims`, the claim rows as psql shows them; `Gated`, a real
engine whose renders wait at a gate (tests/test_fleet_claims.py too); `Restartable`, a PostgreSQL server of a module's
own (never the session's shared one), stopped and started again on its port."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from pg_fixtures import _bin, _free_port, _unavailable
from s3_fixtures import S3Server
from service_fixtures import FormClient, free_port

START_BOUND_S = 180.0  # a `serve` imports torch and builds the tiny model: seconds, more on a busy 2-core machine


@dataclass
class Serve:
    """One `h3serve serve` process on a free loopback port, its log in a file."""

    name: str
    out: Path
    env: dict[str, str]
    port: int = 0
    process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log(self) -> Path:
        return self.out.parent / f"{self.name}.log"

    def start(self) -> None:
        self.port = free_port()
        cmd = [sys.executable, "-m", "h3serve.cli", "serve", "--output-dir", str(self.out),
               "--api-port", str(self.port)]  # fmt: skip
        with self.log.open("ab") as sink:
            self.process = subprocess.Popen(cmd, env=self.env, stdout=subprocess.DEVNULL, stderr=sink)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_BOUND_S
        while True:
            with contextlib.suppress(httpx.HTTPError, ValueError):
                if httpx.get(f"{self.url}/health", timeout=5).json()["ready"]:
                    return
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.process.kill()
                raise AssertionError(f"server {self.name} did not become ready: {self.tail()}")
            time.sleep(0.1)

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL: no shutdown, no last write; its leases simply stop being renewed."""
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(30)

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)  # as a container stop: the jobs it holds go back to the queue
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def client(self, timeout: float = 60) -> httpx.Client:
        return FormClient(base_url=self.url, timeout=timeout)

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:] if self.log.exists() else "(no log)"

    def completed_renders(self) -> int:
        """The renders this server completed, from its /metrics (async jobs only here: no sync render is sent)."""
        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        found = re.search(r'^h3serve_renders_total\{outcome="completed"\} (\S+)$', text, re.MULTILINE)
        return int(float(found.group(1))) if found else 0


def claims(url: str) -> dict[str, tuple[str | None, int]]:
    """{job id: (holder, generation)} from the claim rows, as a person with psql sees them: the holder of a finished
    job is the server that rendered it."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as db:
        return {row[0]: (row[1], row[2]) for row in db.execute("SELECT job_id, server_id, generation FROM job_claims")}


@contextlib.contextmanager
def serve_fleet(
    names: tuple[str, ...], root: Path, s3: S3Server, url: str, bucket: str, prefix: str, **settings: str
) -> Iterator[tuple[dict[str, Serve], Serve]]:
    """The fleet's servers (`names`: each its H3_SERVER_ID) on the database at `url` and the bucket's `prefix`, with
    `settings` (H3_* variables) besides, and one stand-alone server on SQLite (the single-server reference): all
    started together, then each waited for, and stopped at the end (whichever process each runs then)."""
    shared = {"H3_STORE": url, "H3_OUTPUT_URL": f"s3://{bucket}/{prefix}", "H3_S3_ENDPOINT": s3.endpoint, **settings}
    servers = {n: Serve(n, root / n, server_env(s3, H3_SERVER_ID=n, **shared)) for n in names}
    single = Serve("single", root / "single", server_env(s3))
    everyone = [*servers.values(), single]
    try:
        for s in everyone:
            s.start()
        for s in everyone:
            s.wait_ready()
        yield servers, single
    finally:
        for s in everyone:
            s.stop()


class Gated:
    """A real engine behind a gate: `render` waits until the gate opens (its server holds the job it claimed
    meanwhile) or its render is cancelled, then renders (a cancelled one stops at its first check). `opened`: the
    gate at the start; `close` makes the next render wait. Everything else is the engine's own."""

    def __init__(self, engine: Any, opened: bool = False):
        self._engine = engine
        self.gate = threading.Event()
        self.entered = threading.Event()
        if opened:
            self.gate.set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def close(self) -> None:
        self.gate.clear()
        self.entered.clear()

    def open(self) -> None:
        self.gate.set()

    def render(self, request, ctx):
        self.entered.set()
        deadline = time.monotonic() + 120  # a bound on the test, not on the code: the test never opened the gate
        while not self.gate.wait(0.02) and not ctx.cancelled:
            assert time.monotonic() < deadline, "the test never opened the gate"
        return self._engine.render(request, ctx)


def server_env(s3: S3Server, **settings: str) -> dict[str, str]:
    """The process environment of a server: this one's without H3_* and AWS_* variables, then the S3 server's
    credentials and `settings`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("H3_", "AWS_"))}
    return {**env, **s3.env(), "H3_STARTUP_WARMUP": "false", **settings}


@dataclass
class Restartable:
    """A PostgreSQL server of a module's own, stopped and started again on the same port by the tests."""

    pgbin: Path
    home: Path
    port: int
    as_postgres: list[str]

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def run(self, tool: str, *args: Any) -> None:
        command = [*self.as_postgres, str(self.pgbin / tool), *map(str, args)]
        subprocess.run(command, check=True, capture_output=True, text=True)

    def start(self) -> None:
        options = (f"-p {self.port} -k {self.home} -c listen_addresses=127.0.0.1 -c fsync=off "
                   "-c synchronous_commit=off -c full_page_writes=off")  # fmt: skip
        self.run("pg_ctl", "-D", self.home / "data", "-l", self.home / "log", "-w", "-o", options, "start")

    def stop(self, mode: str = "fast") -> None:
        """As an operator's restart stops it (fast: every session is ended)."""
        self.run("pg_ctl", "-D", self.home / "data", "-m", mode, "-w", "stop")


@contextlib.contextmanager
def restartable_postgres() -> Iterator[Restartable]:
    """A started PostgreSQL server of the caller's own on a free port (its superuser's `postgres` database at `url`),
    stopped and removed afterwards. Skipped (or failed, H3TEST_REQUIRE_POSTGRES=1) as tests/pg_fixtures.py's; skipped
    with H3_TEST_DATABASE_URL, whose server is not a test's to restart."""
    if os.environ.get("H3_TEST_DATABASE_URL"):
        pytest.skip("a PostgreSQL server of H3_TEST_DATABASE_URL is not this test's to restart")
    pgbin = _bin()
    if pgbin is None:
        _unavailable("PostgreSQL's initdb is not installed: apt-get install -y postgresql")
    as_postgres = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    root = Path(tempfile.mkdtemp(prefix="h3test-pgr-"))  # (not tmp_path: the server runs as `postgres`)
    root.chmod(0o755)
    home = root / "pg"
    home.mkdir()
    if as_postgres:
        shutil.chown(home, "postgres", "postgres")
    server = Restartable(pgbin, home, _free_port(), as_postgres)
    server.run("initdb", "-D", home / "data", "-U", "postgres", "-A", "trust", "--no-sync")
    server.start()
    try:
        yield server
    finally:
        with contextlib.suppress(subprocess.CalledProcessError):  # (already stopped by a test that failed)
            server.stop("immediate")
        shutil.rmtree(root, ignore_errors=True)
