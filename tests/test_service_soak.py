"""A soak: jobs submitted, deleted (which cancels an active one and deletes a finished one) and downloaded at random
by 8 clients for a bounded time against a real `h3serve serve` process on loopback, which is killed with SIGKILL
twice in the middle and started again on the same folder. Afterwards nothing is lost and nothing dangles: every job
the server accepted and nobody deleted is listed, in a terminal state or still queued; every completed job's MP4
decodes whole; no MP4 is left without a record and no record points at a missing MP4; no half-written file is left.

The time is bounded by `H3_SOAK_SECONDS` (25 s of clients unless set; a longer soak:
`H3_SOAK_SECONDS=300 pytest tests/test_service_soak.py`), the submissions by `JOBS` (200)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import av
import httpx

from service_fixtures import form_parts

JOBS = 200
CLIENTS = 8
KILLS = 2
TERMINAL = {"completed", "failed", "cancelled"}
REQUEST = {"prompt": "a soak", "num_inference_steps": "2"}  # a tiny render of a second or two on a CPU


def _port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(out: Path, port: int, log: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("H3_")}
    cmd = [sys.executable, "-m", "h3serve.cli", "serve", "--output-dir", str(out), "--api-port", str(port),
           "--max-queue", "64"]  # fmt: skip
    with log.open("ab") as sink:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=sink)
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).json()["ready"]:
                return proc
        except (httpx.HTTPError, ValueError):
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"the server did not become ready: {log.read_text()[-3000:]}")
        time.sleep(0.2)


class Ledger:
    """What the clients were told, under a lock: the jobs accepted, the ones whose DELETE was answered 200, and every
    answer that breaks the contract (a 5xx, a short body)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.accepted: list[str] = []
        self.deleted: set[str] = set()
        self.unsure: set[str] = set()  # a DELETE under way: the server may have done it
        # A DELETE left unanswered (the server killed under it): it may have been done, whatever a later one answers
        # (a 404 then is that deletion, not a lost job).
        self.unanswered: set[str] = set()
        self.broken: list[str] = []
        self.generation = 0  # bumped around each kill and restart: a transfer cut across one is no fault
        self.counts: dict[str, int] = {}
        self.history: dict[str, list[str]] = {}  # per job: what was asked of it and the answer, for a failure's message

    def note(self, what: str, job_id: str | None = None) -> None:
        with self.lock:
            self.counts[what] = self.counts.get(what, 0) + 1
            if job_id is not None:
                self.history.setdefault(job_id, []).append(f"{time.monotonic():.2f} gen {self.generation}: {what}")


def _get_once_more(c: httpx.Client, path: str) -> httpx.Response:
    """GET, and once more on a new connection when the server closed the kept-alive one before any response (an idle
    connection's close crossing the request: HTTP clients retry an idempotent request then, RFC 9112 9.3.1). A body
    cut short after a response began is not retried: the caller judges it."""
    try:
        return c.get(path)
    except httpx.RemoteProtocolError as err:
        if "without sending a response" not in str(err):
            raise
        return c.get(path)


def _client(url: str, ledger: Ledger, stop: threading.Event, seed: int) -> None:
    rng = random.Random(seed)
    with httpx.Client(base_url=url, timeout=30) as c:
        while not stop.is_set():
            with ledger.lock:
                known = list(ledger.accepted)
                room = len(ledger.accepted) < JOBS
            # Deletes are rarer than downloads, so that jobs live long enough to complete and be downloaded.
            action = rng.choice(["submit"] * (3 if room else 0) + ["delete"] + ["download"] * 4 + ["list"])
            job_id = None
            try:
                if action == "submit" or not known:
                    if not room:
                        time.sleep(0.05)
                        continue
                    r = c.post("/v1/videos", files=form_parts({**REQUEST, "seed": str(rng.randrange(1 << 30))}))
                    if r.status_code == 200:
                        job_id = r.json()["id"]
                        with ledger.lock:
                            ledger.accepted.append(job_id)
                elif action == "delete":
                    job_id = rng.choice(known)
                    with ledger.lock:
                        ledger.unsure.add(job_id)
                    r = c.delete(f"/v1/videos/{job_id}")
                    with ledger.lock:
                        ledger.unsure.discard(job_id)
                    if r.status_code == 200 and r.json().get("deleted") is True:  # else an active job, cancelled
                        with ledger.lock:
                            ledger.deleted.add(job_id)
                elif action == "download":
                    generation = ledger.generation
                    job_id = rng.choice(known)
                    try:
                        r = _get_once_more(c, f"/v1/videos/{job_id}/content")
                    except httpx.RemoteProtocolError as err:  # a body cut short: broken unless a kill cut it
                        if generation == ledger.generation:
                            with ledger.lock:
                                ledger.broken.append(f"download cut short with no kill: {err}")
                        raise
                    length = int(r.headers.get("content-length", -1))
                    if r.status_code == 200 and len(r.content) != length:
                        with ledger.lock:
                            ledger.broken.append(f"short body: {len(r.content)} of {length}")
                else:
                    r = c.get("/v1/videos", params={"limit": 100})
                ledger.note(f"{action} {r.status_code}", job_id)
                if r.status_code >= 500 and r.status_code != 503:  # 503: not ready yet (a restart's warmup)
                    with ledger.lock:
                        ledger.broken.append(f"{action}: {r.status_code} {r.text[:200]}")
            except httpx.TransportError:  # the server is down (killed) or restarting: try again
                ledger.note(f"{action} down", job_id)
                if action == "delete" and job_id is not None:
                    with ledger.lock:
                        ledger.unanswered.add(job_id)
                time.sleep(0.2)


def _frames(path: Path) -> int:
    with av.open(str(path)) as container:
        return sum(1 for _ in container.decode(video=0))


def test_killed_twice_under_random_clients_nothing_is_lost_and_nothing_dangles(tmp_path):
    seconds = float(os.environ.get("H3_SOAK_SECONDS", "25"))
    out, log = tmp_path / "out", tmp_path / "serve.log"
    port = _port()
    url = f"http://127.0.0.1:{port}"
    ledger, stop = Ledger(), threading.Event()
    proc = _start(out, port, log)
    clients = [threading.Thread(target=_client, args=(url, ledger, stop, i), daemon=True) for i in range(CLIENTS)]
    try:
        for t in clients:
            t.start()
        for _ in range(KILLS):
            time.sleep(seconds / (KILLS + 1))
            ledger.generation += 1
            proc.send_signal(signal.SIGKILL)  # a crash: no chance to clean up, mid-render and mid-encode
            proc.wait(30)
            proc = _start(out, port, log)
            ledger.generation += 1
        time.sleep(seconds / (KILLS + 1))
        stop.set()
        for t in clients:
            t.join(60)
        # What is still active is cancelled (DELETE), then one more job is rendered whole: after two kills the server
        # still renders, and at least one completed MP4 is checked end to end below.
        with httpx.Client(base_url=url, timeout=120) as c:
            active = [j["id"] for j in c.get("/v1/videos", params={"limit": 100}).json()["data"]
                      if j["status"] in ("queued", "in_progress")]  # fmt: skip
            for job_id in active:
                c.delete(f"/v1/videos/{job_id}")
            last = c.post("/v1/videos", files=form_parts({**REQUEST, "seed": "7"})).json()["id"]
            ledger.accepted.append(last)
            deadline = time.monotonic() + 120
            while c.get(f"/v1/videos/{last}").json()["status"] not in TERMINAL and time.monotonic() < deadline:
                time.sleep(0.2)
            assert c.get(f"/v1/videos/{last}").json()["status"] == "completed"
            listed, after = {}, None
            while True:
                page = c.get("/v1/videos", params={"limit": 100, **({"after": after} if after else {})}).json()
                listed.update({j["id"]: j for j in page["data"]})
                if not page["has_more"]:
                    break
                after = page["data"][-1]["id"]
    finally:
        stop.set()
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)

    assert ledger.broken == [], ledger.broken[:10]
    assert len(ledger.accepted) - CLIENTS <= JOBS and len(ledger.accepted) >= 20, ledger.counts  # the soak did soak
    kept = set(ledger.accepted) - ledger.deleted - ledger.unsure - ledger.unanswered
    lost = sorted(kept - set(listed))
    assert not lost, f"accepted, never deleted, not listed: {[(i, ledger.history.get(i)) for i in lost[:3]]}"
    assert not (ledger.deleted & set(listed)), "a job whose DELETE answered `deleted` is listed again"
    assert {j["status"] for j in listed.values()} <= TERMINAL | {"queued", "in_progress"}

    from h3serve.service.store import JobStore

    store = JobStore(out)  # after the graceful stop: every job is terminal now
    try:
        jobs, _ = store.list(10_000)
    finally:
        store.close()
    assert {j.id for j in jobs} == set(listed)
    assert {j.status for j in jobs} <= TERMINAL, {j.id: j.status for j in jobs if j.status not in TERMINAL}
    videos = out / "videos"
    mp4s = {p.name for p in videos.glob("*.mp4")}
    completed = [j for j in jobs if j.status == "completed"]
    assert {j.file_name for j in completed} == mp4s, "an MP4 without a record, or a record without its MP4"
    assert not [p.name for p in videos.iterdir() if p.name.startswith(".")], "a half-written file was left"
    assert completed, "no job completed: nothing was checked end to end"
    for job in completed:
        assert _frames(videos / job.file_name) == job.num_frames, job.id
    print(f"soak: {len(ledger.accepted)} accepted, {len(ledger.deleted)} deleted, {len(completed)} completed; "
          f"{ledger.counts}")  # fmt: skip
