"""The real server on loopback for tests: `create_app` over the built-in tiny engine, run by uvicorn in a thread on a
free port, driven over HTTP with httpx. Nothing is mocked: the renders are real tiny-model renders."""

from __future__ import annotations

import io
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np
import uvicorn
from PIL import Image

from h3serve.accel.profile import Profile
from h3serve.pipeline.engine import Engine
from h3serve.service.app import create_app
from h3serve.service.http import head_deadline_protocol
from h3serve.settings import Settings

_ENGINE: Engine | None = None


def tiny_engine() -> Engine:
    """One tiny engine per test process (building it takes about a second)."""
    global _ENGINE
    if _ENGINE is None:
        _ENGINE = Engine.load(None, Profile())
    return _ENGINE


def free_port() -> int:
    """A loopback port free now, for a command that checks or opens one: never the default 8000, which a user's own
    `h3serve serve` on the same machine may hold."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def settings(output_dir: Path, **values) -> Settings:
    """Validated settings for a test server (the fields exactly as an operator would set them)."""
    return Settings(output_dir=output_dir, **values)


def form_parts(fields: dict, files=None) -> list:
    """Form fields (a value or a list of values each) as multipart parts, then the files: httpx sends `data=` alone
    urlencoded, which the server refuses (it takes multipart/form-data and JSON, as curl -F and --json send them)."""
    parts = [(k, (None, v)) for k, vs in fields.items() for v in (vs if isinstance(vs, list) else [vs])]
    return parts + list(files.items() if isinstance(files, dict) else files or [])


class FormClient(httpx.Client):
    """httpx's client, with a `data=` form sent as multipart/form-data (`form_parts`)."""

    def request(self, method, url, *, data=None, files=None, **kwargs):
        if isinstance(data, dict):
            data, files = None, form_parts(data, files)
        return super().request(method, url, data=data, files=files, **kwargs)


class LiveServer:
    def __init__(self, app, sock: socket.socket):
        self.app = app
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        # As `h3serve serve` runs it: with the request head deadline (service/http.py).
        http = head_deadline_protocol(app.state.settings.body_timeout)
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=10, http=http))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)

    @property
    def scheduler(self):
        return self.app.state.scheduler

    def start(self) -> None:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)

    def client(self, key: str | None = None, timeout: float = 120) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return FormClient(base_url=self.url, headers=headers, timeout=timeout)

    def wait_ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        with self.client() as c:
            while not c.get("/health").json()["ready"]:
                if time.monotonic() > deadline:
                    raise AssertionError(f"not ready after {timeout} s: {c.get('/health').json()}")
                time.sleep(0.05)


@contextmanager
def live_server(s: Settings, engine: Engine | None = None, ready: bool = True) -> Iterator[LiveServer]:
    """Start the real app on a free loopback port; by default wait until the warmup has passed."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # As uvicorn's own bind ends up: without TCP_NODELAY on a socket handed to it, every response waits ~40 ms for the
    # client's delayed ACK (Nagle), which made each loopback request here 44 ms instead of 1.3 ms.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind(("127.0.0.1", 0))
    server = LiveServer(create_app(s, engine or tiny_engine()), sock)
    server.start()
    try:
        if ready:
            server.wait_ready()
        yield server
    finally:
        server.stop()


def wait_status(client: httpx.Client, job_id: str, statuses: set[str], timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        job = client.get(f"/v1/videos/{job_id}").json()
        if job.get("status") in statuses:
            return job
        if time.monotonic() > deadline:
            raise AssertionError(f"job {job_id} never reached {statuses}: {job}")
        time.sleep(0.05)


def until(check, what: str = "the condition", bound: float = 60.0):
    """Poll `check` until it returns something true, and return that; `bound` only ends a test that would otherwise
    hang (every wait ends as soon as what it polls has happened)."""
    deadline = time.monotonic() + bound
    while not (value := check()):
        assert time.monotonic() < deadline, f"{what}: not within {bound:g} s (last {value!r})"
        time.sleep(0.02)
    return value


def png_bytes(width: int = 96, height: int = 64, seed: int = 0) -> bytes:
    rgb = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(rgb).save(buffer, format="PNG")
    return buffer.getvalue()


# The seed's smoke request, at the tiny model's canvas (the released 768x448 is above the tiny area cap).
SMOKE = {
    "prompt": "Macro soldering a PCB under warm bench light, soft room tone.",
    "width": "224",
    "height": "128",
    "fps": "24",
    "num_inference_steps": "20",
    "flow_shift": "12",
    "seed": "42",
    "extra_params": '{"task":"t2va","duration":2.0,"audio_flow_shift":3.0}',
}
