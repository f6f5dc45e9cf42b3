"""Issue 58's "Show", its last part: a fleet soaked by random clients through failures. Three `h3serve serve` processes
(the tiny model, on the CPU) on one PostgreSQL of this module's own (tests/fleet_fixtures.py: it is stopped in a test)
and one `rclone serve s3` of its own (stopped in a test), beside a fourth `serve` alone (SQLite, no bucket) that
renders each distinct request once as the single-server reference.

- Random clients (threads) create async jobs, poll, list, download, DELETE (queued, running and finished jobs) and
  read event streams through random servers for a bounded time, while two servers holding running jobs are killed
  with SIGKILL and restarted under their own H3_SERVER_ID. A ledger of what the clients were told: every accepted job
  ends completed (its MP4 bitwise the single-server render of its request), cancelled or deleted by a client, or
  failed with a documented reason; none is completed twice (its claim's generation is raised only by a kill of its
  holder, the database holds at most one end event of it, every stream saw the end its record has); a job whose
  DELETE answered `deleted` never appears again, through any server; the bucket's objects and the completed records
  are one to one.
- PostgreSQL stopped under the soak: every server's /health says not ready and a submit gets 503; started again, they
  are ready and the ledger holds as above.
- The S3 server stopped while jobs render: those jobs fail with `upload_failed` (docs/fleet.md), /content never
  answers 200 meanwhile (a completed job's is a 503, a failed one's a 409), no object is left for them; started again,
  new jobs complete.

H3TEST_FLEET_SOAK_SECONDS sets the first soak's client time (60 s by default; the second soak's is half of it).
Waits poll what they wait for; their bounds only end a test that would otherwise hang."""

from __future__ import annotations

import math
import os
import random
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import pytest

from fleet_fixtures import Gated, Restartable, Serve, claims, restartable_postgres, serve_fleet
from pg_fixtures import fresh_database
from s3_fixtures import S3Server, aws_env, s3_server_at, s3_server_fixture  # noqa: F401 (the session's `s3_server`)
from service_fixtures import FormClient, free_port, live_server, settings, tiny_engine, until

NAMES = ("a", "b", "c")
# A lease a busy 2-core machine renews in time (a heartbeat every second): a job moves on only when its holder dies.
# At 4 s one run saw a live server's lease run out (its heartbeat late by more than 3 s while three servers and the
# clients shared 2 cores; the fleet did right: the late holder's writes were refused and the job completed once), so
# the test's "claimed again only after its holder died" did not hold: 8 s leaves seven heartbeats of slack.
LEASE_S, HEARTBEAT_S = 8, 1
PREFIX = "soak"
SOAK_S = float(os.environ.get("H3TEST_FLEET_SOAK_SECONDS", "60"))
CLIENTS = 6
MAX_QUEUE = 16  # the fleet's queue: the clients submit faster than three CPU servers render, and meet 429s
MAX_JOBS = 200  # accepted jobs per soak, at most
TERMINAL = {"completed", "failed", "cancelled"}
ACTIVE = {"queued", "in_progress"}
STREAM_READ_S = 8.0  # how long a client reads one event stream before it closes it
SETTLE_BOUND_S = 240.0
# The clients' requests (a render of a fraction of a second each on a CPU), then the kills' long one and the S3 test's.
SMALL = [
    {"prompt": prompt, "width": width, "height": height, "num_inference_steps": "2", "seed": str(seed),
     "extra_params": '{"duration": 0.9}'}
    for prompt, width, height, seed in (
        ("a kettle on a stove", "224", "128", 1),
        ("rain on a tin roof", "128", "224", 2),
        ("a lighthouse at dusk", "160", "160", 3),
        ("two cranes over a harbour", "224", "128", 4),
    )
]  # fmt: skip
LONG = {"prompt": "a long kettle", "num_inference_steps": "60", "width": "224", "height": "128", "seed": "11",
        "extra_params": '{"duration": 0.9}'}  # fmt: skip
MEDIUM = {"prompt": "a kettle, no bucket", "num_inference_steps": "16", "width": "224", "height": "128", "seed": "12",
          "extra_params": '{"duration": 0.9}'}  # fmt: skip
REQUESTS = [*SMALL, LONG, MEDIUM]
LONG_INDEX, MEDIUM_INDEX = len(SMALL), len(SMALL) + 1


@dataclass
class SoakFleet:
    pg: Restartable
    url: str  # the fleet's database
    s3: S3Server
    bucket: str
    servers: dict[str, Serve]
    references: dict[int, bytes]  # REQUESTS index -> the single server's MP4
    # {job id: how many times another server may have claimed it again}: once for each kill of its holder, and once
    # for a database stopped while it was held (its lease may run out meanwhile). Nothing else moves a job.
    reclaims: Counter = field(default_factory=Counter)

    def running(self) -> list[Serve]:
        return [s for s in self.servers.values() if s.running]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory) -> Iterator[SoakFleet]:
    root = tmp_path_factory.mktemp("soak")
    with (
        restartable_postgres() as pg,
        fresh_database(pg.url) as url,
        s3_server_at(root / "s3data", free_port()) as s3,
    ):
        bucket = s3.bucket()
        settings = {"H3_LEASE_S": str(LEASE_S), "H3_HEARTBEAT_S": str(HEARTBEAT_S), "H3_MAX_QUEUE": str(MAX_QUEUE)}
        with serve_fleet(NAMES, root, s3, url, bucket, PREFIX, **settings) as (servers, single):
            references = {}
            with single.client(timeout=300) as c:
                for index, fields in enumerate(REQUESTS):
                    answer = c.post("/v1/videos/sync", data=fields)
                    assert answer.status_code == 200 and answer.content[4:8] == b"ftyp", answer.text[:300]
                    references[index] = answer.content
            single.stop()  # its work is done: the CPU is the fleet's
            yield SoakFleet(pg, url, s3, bucket, servers, references)


# ---- the database, as a person with psql sees it ------------------------------------------------------------------
def query(url: str, sql: str, params: tuple = ()) -> list[tuple]:
    import psycopg

    with psycopg.connect(url, autocommit=True) as db:
        return db.execute(sql, params).fetchall()


def records(url: str) -> dict[str, tuple[str, str | None]]:
    """{job id: (status, error code)} of every job record."""
    return {job: (status, code) for job, status, code in query(url, "SELECT id, status, error_code FROM jobs")}


def held(url: str, server: str | None = None) -> dict[str, str]:
    """{job id: holder} of the jobs in progress (those of `server` only, if given)."""
    rows = query(url, "SELECT c.job_id, c.server_id FROM job_claims c JOIN jobs j ON j.id = c.job_id "
                      "WHERE j.status = 'in_progress' AND c.server_id IS NOT NULL")  # fmt: skip
    return {job: holder for job, holder in rows if server is None or holder == server}


def stored_ends(url: str) -> dict[str, list[str]]:
    """{job id: its end events stored in job_events, in order}."""
    rows = query(url, "SELECT job_id, name FROM job_events WHERE name IN ('completed', 'failed', 'cancelled') "
                      "ORDER BY job_id, id")  # fmt: skip
    out: dict[str, list[str]] = {}
    for job, name in rows:
        out.setdefault(job, []).append(name)
    return out


# ---- the clients and their ledger ---------------------------------------------------------------------------------
class Ledger:
    """What the clients were told, under a lock: the jobs accepted (with their request), the DELETEs' answers, the
    end events the streams saw, and every answer that breaks the contract. `stir`/`calm` mark a kill or an outage
    (from just before it until every server is ready again): a 503 or a cut connection is no fault then, and a
    request begun in one calm stretch and answered in the next is judged as one of the storm."""

    def __init__(self):
        self.lock = threading.Lock()
        self.accepted: dict[str, int] = {}  # job id -> REQUESTS index
        self.order: list[str] = []
        self.protected: set[str] = set()  # the kills' long jobs: no client deletes them
        self.deleted: dict[str, float] = {}  # job id -> monotonic time its DELETE answered `deleted`
        self.cancelled: set[str] = set()  # its DELETE answered `cancelled` (200) or 202 (asked, not yet stopped)
        self.unsure: set[str] = set()  # a DELETE in flight, or never answered (its server killed, a 503): maybe done
        self.deletes: Counter = Counter()  # what the DELETEs met: finished, queued, running, or still running (202)
        self.ends: dict[str, set[str]] = {}  # job id -> the end events its streams ended with
        self.running: set[str] = set()  # jobs a poll or a list last saw in progress (a DELETE aims at one at times)
        self.broken: list[str] = []
        self.counts: Counter = Counter()
        self.storms = 0  # kills and outages under way
        self.epoch = 0  # raised at each storm's start and end

    def stir(self) -> None:
        with self.lock:
            self.storms += 1
            self.epoch += 1

    def calm(self) -> None:
        with self.lock:
            self.storms -= 1
            self.epoch += 1

    def moment(self) -> int | None:
        """The epoch now if calm, else None (a request begun now is no fault of the fleet's if it fails)."""
        with self.lock:
            return self.epoch if self.storms == 0 else None

    def calm_throughout(self, began: int | None) -> bool:
        with self.lock:
            return began is not None and self.storms == 0 and self.epoch == began

    def note(self, what: str) -> None:
        with self.lock:
            self.counts[what] += 1

    def fault(self, what: str) -> None:
        with self.lock:
            self.broken.append(what)

    def may_be_gone(self, job: str) -> bool:
        """A 404 (or 410) for this job is its DELETE's doing: answered `deleted`, in flight, or never answered."""
        with self.lock:
            return job in self.deleted or job in self.unsure

    def accept(self, job: str, index: int, protected: bool = False) -> None:
        with self.lock:
            self.accepted[job] = index
            self.order.append(job)
            if protected:
                self.protected.add(job)


class Soak:
    """CLIENTS threads of random requests through random running servers until `stop`."""

    ACTIONS = ("submit", "poll", "list", "download", "delete", "events")
    WEIGHTS = (3, 3, 1, 3, 1, 1)

    def __init__(self, fleet: SoakFleet, ledger: Ledger, seed: int, max_jobs: int = MAX_JOBS):
        self.fleet, self.ledger, self.max_jobs = fleet, ledger, max_jobs
        self.halt = threading.Event()
        self.threads = [threading.Thread(target=self._client, args=(seed * 100 + i,), daemon=True)
                        for i in range(CLIENTS)]  # fmt: skip

    def __enter__(self) -> Soak:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *_) -> None:
        self.halt.set()
        for t in self.threads:
            t.join(120)
        assert not any(t.is_alive() for t in self.threads), "a client did not stop"

    def _client(self, seed: int) -> None:
        rng = random.Random(seed)
        pool: dict[str, httpx.Client] = {}  # one client per server address (a restarted server has a new port)
        try:
            while not self.halt.is_set():
                time.sleep(rng.uniform(0.01, 0.08))
                server = self.fleet.servers[rng.choice(NAMES)]
                url = server.url
                if url not in pool:
                    pool[url] = FormClient(base_url=url, timeout=90)
                action = rng.choices(self.ACTIONS, self.WEIGHTS)[0]
                began = self.ledger.moment()
                try:
                    getattr(self, f"_{action}")(pool[url], rng, began)
                except httpx.TransportError as err:  # the server killed (or not yet up) under the request
                    self.ledger.note(f"{action} cut")
                    if self.ledger.calm_throughout(began):
                        self.ledger.fault(f"{action} through {server.name}: {type(err).__name__} {err} with no kill")
                    time.sleep(0.1)
                except Exception as err:  # a client's own bug is the test's failure, not a silent thread
                    self.ledger.fault(f"{action}: {type(err).__name__}: {err}")
        finally:
            for c in pool.values():
                c.close()

    def _pick(self, rng: random.Random, recent: bool = False) -> str | None:
        """A job the clients know of: any, or (`recent`) half the time one of the last 8 submitted (mostly queued)."""
        with self.ledger.lock:
            known = self.ledger.order[-8:] if recent and rng.random() < 0.5 else self.ledger.order
            return rng.choice(known) if known else None

    def _saw(self, job: dict) -> None:
        with self.ledger.lock:
            if job["status"] == "in_progress":
                self.ledger.running.add(job["id"])
            else:
                self.ledger.running.discard(job["id"])

    def _judge(self, action: str, job: str | None, r: httpx.Response, began: int | None, fine: set[int]) -> None:
        """The status codes any answer may have: `fine`, a 404 of a job a DELETE may have removed, a 503 in a storm."""
        ledger = self.ledger
        ledger.note(f"{action} {r.status_code}")
        if r.status_code in fine:
            return
        if r.status_code in (404, 410) and job is not None and ledger.may_be_gone(job):
            return
        if r.status_code == 503 and not ledger.calm_throughout(began):
            return
        what = "lost: an accepted job not deleted answered 404" if r.status_code == 404 else "unexpected"
        ledger.fault(f"{action} {job}: {r.status_code} ({what}) {r.text[:200]}")

    def _resurrected(self, job: str, sent: float) -> bool:
        with self.ledger.lock:
            return job in self.ledger.deleted and self.ledger.deleted[job] < sent

    def _submit(self, c: httpx.Client, rng: random.Random, began: int | None) -> None:
        with self.ledger.lock:
            full = len(self.ledger.order) >= self.max_jobs
        if full:
            return
        index = rng.randrange(len(SMALL))
        r = c.post("/v1/videos", data=SMALL[index])
        self._judge("submit", None, r, began, {200, 429})
        if r.status_code == 200:
            self.ledger.accept(r.json()["id"], index)

    def _poll(self, c: httpx.Client, rng: random.Random, began: int | None) -> None:
        if (job := self._pick(rng)) is None:
            return
        sent = time.monotonic()
        r = c.get(f"/v1/videos/{job}")
        self._judge("poll", job, r, began, {200})
        if r.status_code == 200:
            self._saw(r.json())
        if r.status_code == 200 and self._resurrected(job, sent):
            self.ledger.fault(f"poll {job}: a job whose DELETE answered `deleted` is back: {r.text[:200]}")

    def _list(self, c: httpx.Client, rng: random.Random, began: int | None) -> None:
        sent = time.monotonic()
        r = c.get("/v1/videos", params={"limit": 100})
        self._judge("list", None, r, began, {200})
        if r.status_code == 200:
            for j in r.json()["data"]:
                self._saw(j)
            back = [j["id"] for j in r.json()["data"] if self._resurrected(j["id"], sent)]
            if back:
                self.ledger.fault(f"list: jobs whose DELETE answered `deleted` are listed again: {back}")

    def _download(self, c: httpx.Client, rng: random.Random, began: int | None) -> None:
        if (job := self._pick(rng)) is None:
            return
        r = c.get(f"/v1/videos/{job}/content")
        self._judge("download", job, r, began, {200, 409})
        if r.status_code == 200:
            expected = self.fleet.references[self.ledger.accepted[job]]
            if r.content != expected:  # a half object, or another request's
                self.ledger.fault(f"download {job}: {len(r.content)} bytes, not the single-server render's "
                                  f"{len(expected)}")  # fmt: skip

    def _delete(self, c: httpx.Client, rng: random.Random, began: int | None) -> None:
        ledger = self.ledger
        with ledger.lock:  # a third of the time a job last seen rendering
            running = sorted(ledger.running - ledger.protected) if rng.random() < 1 / 3 else []
        if (job := rng.choice(running) if running else self._pick(rng, recent=True)) is None:
            return
        with ledger.lock:
            if job in ledger.protected:
                return
            ledger.unsure.add(job)
        r = c.delete(f"/v1/videos/{job}")  # a TransportError leaves it unsure: the server may have done it
        self._judge("delete", job, r, began, {200, 202})
        body = r.json() if r.status_code in (200, 202) else {}
        with ledger.lock:
            if r.status_code == 200 and body.get("deleted") is True:
                ledger.deleted.setdefault(job, time.monotonic())
                ledger.deletes["finished"] += 1
            elif r.status_code == 200 and body.get("status") == "cancelled":
                ledger.cancelled.add(job)
                ledger.deletes["running" if body.get("server_id") else "queued"] += 1
            elif r.status_code == 202:
                ledger.cancelled.add(job)
                ledger.deletes["still running"] += 1
            if r.status_code in (200, 202) or (r.status_code == 404 and job in ledger.deleted):
                ledger.unsure.discard(job)

    def _events(self, c: httpx.Client, rng: random.Random, began: int | None) -> None:
        if (job := self._pick(rng, recent=True)) is None:
            return
        events, status, deadline = [], 0, time.monotonic() + STREAM_READ_S
        with c.stream("GET", f"/v1/videos/{job}/events") as stream:
            status, current = stream.status_code, {}
            if status == 200:
                for line in stream.iter_lines():
                    if not line:
                        if "id" in current:
                            events.append((int(current["id"]), current["event"]))
                        current = {}
                    elif not line.startswith(":"):
                        key, _, value = line.partition(": ")
                        current[key] = value
                    if time.monotonic() > deadline:
                        break
            else:
                stream.read()
        self._judge("events", job, stream, began, {200, 429})
        ids = [i for i, _ in events]
        ends = [(k, name) for k, (_, name) in enumerate(events) if name in TERMINAL]
        if ids != sorted(set(ids)):
            self.ledger.fault(f"events {job}: ids not increasing: {ids}")
        if len(ends) > 1 or (ends and ends[0][0] != len(events) - 1):
            self.ledger.fault(f"events {job}: more than one end, or events after it: {events}")
        if ends:
            with self.ledger.lock:
                self.ledger.ends.setdefault(job, set()).add(ends[0][1])


# ---- the storms -----------------------------------------------------------------------------------------------------
def kill_a_server_holding_a_render(fleet: SoakFleet, ledger: Ledger, rng: random.Random, avoid: str | None) -> str:
    """Submit two long jobs (no client deletes them), wait until a server other than `avoid` renders one, kill that
    server with SIGKILL, and restart it under its own H3_SERVER_ID a moment later. The jobs it held when it died may
    then be claimed once more (`SoakFleet.reclaims`)."""
    jobs = []
    for _ in range(2):
        via = rng.choice(fleet.running())
        with via.client() as c:  # (the queue may be full of the clients' jobs: sent again, as a client would)
            answer = until(lambda c=c: (r := c.post("/v1/videos", data=LONG)).status_code != 429 and r, "room")
        assert answer.status_code == 200, answer.text
        jobs.append(answer.json()["id"])
        ledger.accept(jobs[-1], LONG_INDEX, protected=True)
    rendering = ("SELECT c.server_id FROM job_claims c JOIN jobs j ON j.id = c.job_id WHERE c.job_id = ANY(%s) "
                 "AND j.status = 'in_progress' AND j.progress > 0 AND c.server_id <> %s")  # fmt: skip
    holder = until(lambda: (rows := query(fleet.url, rendering, (jobs, avoid or ""))) and rows[0][0],
                   "a long job rendering", bound=120)  # fmt: skip
    victim = fleet.servers[holder]
    ledger.stir()
    try:
        victim.kill()
        lost = held(fleet.url, victim.name)  # what it held when it died (nothing it held can change now)
        assert set(jobs) & set(lost), (jobs, lost)
        fleet.reclaims.update(list(lost))
        time.sleep(1.0)  # a moment down: its clients meet a closed port
        victim.start()
        victim.wait_ready()
    finally:
        ledger.calm()
    return victim.name


def settle(fleet: SoakFleet) -> dict[str, tuple[str, str | None]]:
    """Wait until no job is queued or in progress anywhere in the fleet; the records then."""

    def settled():
        now = records(fleet.url)
        return now if not any(status in ACTIVE for status, _ in now.values()) else None

    return until(settled, "every job ended", bound=SETTLE_BOUND_S)


def check_ledger(fleet: SoakFleet, ledger: Ledger, failures: set[str] = frozenset()) -> Counter:
    """The ledger against the settled fleet: every accepted job ended as its clients made it end (or failed with one of
    `failures`, the documented codes the test's storm may cause), none completed twice, none resurrected; then the
    bucket's objects against the completed records. The outcomes, counted."""
    assert ledger.broken == [], ledger.broken[:10]
    now = settle(fleet)
    generations = {job: generation for job, (_, generation) in claims(fleet.url).items()}
    ends = stored_ends(fleet.url)
    outcomes: Counter = Counter()
    problems: list[str] = []
    running = fleet.running()
    for job, index in ledger.accepted.items():
        if job in ledger.deleted:
            outcomes["deleted"] += 1
            if job in now:
                problems.append(f"{job}: its DELETE answered `deleted`, and its record is back: {now[job]}")
            continue
        if job not in now:
            outcomes["deleted (answer lost)"] += 1
            if job not in ledger.unsure:
                problems.append(f"{job}: accepted, never deleted, and its record is gone (lost)")
            continue
        status, code = now[job]
        outcomes[status] += 1
        if status == "cancelled" and job not in ledger.cancelled | ledger.unsure:
            problems.append(f"{job}: cancelled ({code}), and no client asked")
        if status == "failed" and code not in failures:
            problems.append(f"{job}: failed with {code}, not a documented outcome of this test")
        if status == "completed" and job in ledger.cancelled:
            problems.append(f"{job}: its cancel was answered (200 cancelled or 202), and it completed")
        if generations.get(job, 0) > 1 + fleet.reclaims[job]:
            problems.append(f"{job}: claimed {generations[job]} times; its holders died {fleet.reclaims[job]} times")
        if len(ends.get(job, [])) > 1:
            problems.append(f"{job}: {len(ends[job])} end events stored: {ends[job]}")
        if not ledger.ends.get(job, set()) <= {status}:
            problems.append(f"{job}: its streams ended with {ledger.ends[job]}, its record says {status}")
        if status == "completed":
            with running[hash(job) % len(running)].client() as c:
                mp4 = c.get(f"/v1/videos/{job}/content")
            if mp4.status_code != 200 or mp4.content != fleet.references[index]:
                problems.append(f"{job}: /content {mp4.status_code}, {len(mp4.content)} bytes, not the single-server "
                                f"render of request {index}")  # fmt: skip
    assert problems == [], problems[:10]
    # Deleted jobs stay deleted through every server, in a GET and in the list.
    for k, s in enumerate(running):
        with s.client() as c:
            listed, after = set(), None
            while True:
                page = c.get("/v1/videos", params={"limit": 100, **({"after": after} if after else {})}).json()
                listed |= {j["id"] for j in page["data"]}
                if not page["has_more"]:
                    break
                after = page["data"][-1]["id"]
            assert listed == set(now), f"{s.name} lists other jobs than the database holds"
            gone = sorted(ledger.deleted)[k :: len(running)]  # a share of them through each server
            assert all(c.get(f"/v1/videos/{job}").status_code == 404 for job in gone)
    assert_objects_match_records(fleet)
    return outcomes


def assert_objects_match_records(fleet: SoakFleet) -> None:
    """Every object in the bucket is a completed job's MP4 and every completed job has its object: one to one."""
    now = records(fleet.url)
    completed = {job for job, (status, _) in now.items() if status == "completed"}
    keys = set(fleet.s3.keys(fleet.bucket))  # the whole bucket, not only the prefix
    named = {f"{PREFIX}/{job}.mp4": job for job in now}
    extra = {
        key: now.get(named.get(key, ""), "no record") for key in sorted(keys - {f"{PREFIX}/{j}.mp4" for j in completed})
    }
    assert keys == {f"{PREFIX}/{job}.mp4" for job in completed}, (
        f"objects without a completed record (the record): {dict(list(extra.items())[:5])}; completed records "
        f"without an object: {sorted(j for j in completed if f'{PREFIX}/{j}.mp4' not in keys)[:5]}; held by a killed "
        f"server: {[named.get(k) in fleet.reclaims for k in extra]}"
    )


# ---- the tests --------------------------------------------------------------------------------------------------
def test_random_clients_and_two_kills_lose_no_job_complete_none_twice_and_resurrect_none(fleet):
    started = time.monotonic()
    ledger, rng = Ledger(), random.Random(58)
    victims = []
    with Soak(fleet, ledger, seed=1):
        for k in (1, 2):  # at a third and two thirds of the soak
            time.sleep(max(0.0, started + k * SOAK_S / 3 - time.monotonic()))
            victims.append(kill_a_server_holding_a_render(fleet, ledger, rng, avoid=victims[-1] if victims else None))
        time.sleep(max(0.0, started + SOAK_S - time.monotonic()))
    soaked = time.monotonic()
    outcomes = check_ledger(fleet, ledger)
    # The soak did soak: jobs of every kind of end, and DELETEs of queued, running and finished jobs.
    assert outcomes["completed"] >= 20 and outcomes["deleted"] >= 3 and outcomes["cancelled"] >= 3, outcomes
    assert ledger.deletes["queued"] and ledger.deletes["finished"], ledger.deletes
    assert ledger.deletes["running"] + ledger.deletes["still running"], ledger.deletes
    assert len(ledger.ends) >= 3, "the clients read no event stream to its end"
    for job in ledger.protected:  # the kills' long jobs: claimed again and completed (bitwise: `check_ledger`)
        assert records(fleet.url)[job][0] == "completed" and claims(fleet.url)[job][1] == 1 + fleet.reclaims[job]
    print(
        f"\nsoak of {soaked - started:.0f} s, killed {victims}, settled and checked in "
        f"{time.monotonic() - soaked:.1f} s: {len(ledger.accepted)} accepted, {dict(outcomes)}, DELETEs met "
        f"{dict(ledger.deletes)}, {len(ledger.ends)} streams read to their end, "
        f"{sum(fleet.reclaims.values())} jobs held by the killed; answers {dict(sorted(ledger.counts.items()))}"
    )


def test_postgresql_stopped_mid_soak_servers_are_not_ready_then_recover_losing_no_job(fleet):
    started = time.monotonic()
    ledger = Ledger()
    with Soak(fleet, ledger, seed=2, max_jobs=100):
        time.sleep(SOAK_S / 4)
        ledger.stir()
        try:
            fleet.reclaims.update(
                list(held(fleet.url))
            )  # held as the database goes: their leases may run out meanwhile
            fleet.pg.stop()
            down = time.monotonic()
            try:
                # Down longer than a lease, so that a job held as it went may be claimed again as it comes back (and
                # its first holder's end refused); the servers asked at its start and at its end.
                for look in (0, 1):
                    if look:
                        time.sleep(LEASE_S + 1)
                    for s in fleet.servers.values():
                        with s.client() as c:
                            health = c.get("/health").json()
                            assert health["ready"] is False and "job store does not answer" in health["problem"]
                            refused = c.post("/v1/videos", data=SMALL[0])
                            assert refused.status_code == 503 and refused.headers["retry-after"], refused.text
            finally:
                fleet.pg.start()
            for s in fleet.servers.values():
                with s.client() as c:
                    until(lambda c=c: c.get("/health").json()["ready"], f"{s.name} ready again")
            back = time.monotonic()
        finally:
            ledger.calm()
        time.sleep(SOAK_S / 4)
    outcomes = check_ledger(fleet, ledger)
    assert outcomes["completed"] >= 5, outcomes
    assert sum(n for what, n in ledger.counts.items() if what.endswith(" 503")), ledger.counts  # (met it too)
    print(
        f"\nPostgreSQL down {back - down:.1f} s (every server not ready, submits 503), soak and checks "
        f"{time.monotonic() - started:.1f} s: {len(ledger.accepted)} accepted, {dict(outcomes)}"
    )


def test_the_s3_server_down_fails_the_rendering_jobs_serves_nothing_half_written_then_jobs_complete(fleet):
    servers = list(fleet.servers.values())
    with servers[0].client() as c:  # a job completed before the bucket goes
        before = c.post("/v1/videos", data=SMALL[0]).json()["id"]
        until(lambda: c.get(f"/v1/videos/{before}").json()["status"] == "completed", "a job completed")
        before_mp4 = c.get(f"/v1/videos/{before}/content").content
    assert before_mp4 == fleet.references[0]
    jobs = []
    for k in range(4):  # three render at once, one waits
        with servers[k % len(servers)].client() as c:
            answer = c.post("/v1/videos", data=MEDIUM)
        assert answer.status_code == 200, answer.text
        jobs.append(answer.json()["id"])
    rendering = "SELECT 1 FROM jobs WHERE id = ANY(%s) AND status = 'in_progress' AND progress > 0"
    until(lambda: query(fleet.url, rendering, (jobs,)), "a job rendering")
    fleet.s3.stop()
    ended: dict[str, dict] = {}
    try:

        def all_ended() -> bool:
            for k, job in enumerate(jobs):
                with servers[k % len(servers)].client() as c:
                    record, content = c.get(f"/v1/videos/{job}").json(), c.get(f"/v1/videos/{job}/content")
                # Nothing is served while the bucket is away: not completed (409), or the bucket's 503.
                assert content.status_code in (409, 503), (content.status_code, content.text)
                if record["status"] in TERMINAL:
                    ended[job] = record
            return len(ended) == len(jobs)

        until(all_ended, "the jobs ended with the bucket away", bound=180)
        for s in servers:  # a completed job's MP4 through each server: a 503 with Retry-After, never a body cut short
            with s.client() as c:
                content, deleting = c.get(f"/v1/videos/{before}/content"), c.delete(f"/v1/videos/{before}")
            assert content.status_code == 503 and content.headers["retry-after"], content.text
            assert content.json()["error"]["code"] == "storage_unavailable"
            assert deleting.status_code == 503 and "nothing was deleted" in deleting.text, deleting.text
    finally:
        fleet.s3.start()
    # Each job rendering or queued as the bucket went failed as docs/fleet.md says, no object kept; one whose upload
    # had ended just before it is completed, its object there (`assert_objects_match_records`) and whole.
    failed = [job for job, record in ended.items() if record["status"] != "completed"]
    assert len(failed) >= 2, ended
    for job in failed:
        record = ended[job]
        assert record["status"] == "failed" and record["error"]["code"] == "upload_failed", record
        assert "could not be stored in the output bucket" in record["error"]["message"] and record["file_name"] is None
    assert_objects_match_records(fleet)
    with servers[1].client() as c:
        assert c.get(f"/v1/videos/{before}/content").content == before_mp4  # the DELETEs met 503s: nothing deleted
        assert c.get(f"/v1/videos/{failed[0]}/content").status_code == 409
        for job in set(jobs) - set(failed):
            assert c.get(f"/v1/videos/{job}/content").content == fleet.references[MEDIUM_INDEX]
    # The bucket back: new jobs through each server complete, bitwise the single-server render.
    again = []
    for s in servers:
        with s.client() as c:
            answer = c.post("/v1/videos", data=MEDIUM)
        assert answer.status_code == 200, answer.text
        again.append(answer.json()["id"])
    settle(fleet)
    for k, job in enumerate(again):
        with servers[(k + 1) % len(servers)].client() as c:
            assert c.get(f"/v1/videos/{job}").json()["status"] == "completed"
            assert c.get(f"/v1/videos/{job}/content").content == fleet.references[MEDIUM_INDEX]
    assert_objects_match_records(fleet)
    print(
        f"\nthe bucket stopped under {len(jobs)} jobs: {len(failed)} failed upload_failed, the rest completed; "
        f"{len(again)} jobs after its return completed"
    )


def test_a_job_cancelled_after_a_killed_holders_upload_keeps_no_object(pg_url, s3_server, tmp_path):
    """What the soak found once (an object of a cancelled job, named by no completed record), made to happen: a holder
    whose upload completed dies before its record is written, restarts under its name (its job queued again), and
    the job is cancelled by a DELETE before another server completes it. The DELETE removes the object too."""
    from h3serve.service.store.postgres import PostgresJobStore

    bucket, gated = s3_server.bucket(), Gated(tiny_engine())
    values = {"startup_warmup": False, "store": pg_url, "server_id": "a", "output_url": f"s3://{bucket}/p",
              "s3_endpoint": s3_server.endpoint}  # fmt: skip
    with aws_env(s3_server), live_server(settings(tmp_path / "a", **values), gated) as a, a.client() as c:
        busy = c.post("/v1/videos", data=SMALL[0]).json()["id"]
        until(lambda: a.scheduler.held() == [busy], "a busy at its gate")
        job = c.post("/v1/videos", data=SMALL[1]).json()["id"]  # queued: a is busy
        ghost = PostgresJobStore(pg_url, tmp_path / "ghost", server_id="ghost")
        assert ghost.claim(a.scheduler.fleet.capabilities, math.inf, 60)[0] == job
        s3_server.client().put_object(Bucket=bucket, Key=f"p/{job}.mp4", Body=_an_mp4_head())
        ghost._db.close()  # killed between its upload and its record
        PostgresJobStore(pg_url, tmp_path / "ghost2", server_id="ghost").close()  # restarted: its job queued again
        assert c.get(f"/v1/videos/{job}").json()["status"] == "queued"
        answer = c.delete(f"/v1/videos/{job}")
        assert (answer.status_code, answer.json()["status"]) == (200, "cancelled"), answer.text
        assert s3_server.keys(bucket, "p/") == []  # no object that no completed record names
        gated.gate.set()
        until(lambda: c.get(f"/v1/videos/{busy}").json()["status"] in TERMINAL, "the busy job ended")
        assert s3_server.keys(bucket, "p/") == [f"p/{busy}.mp4"]


def _an_mp4_head() -> bytes:
    """An object's bytes (they do not matter: nothing downloads them)."""
    return b"\x00\x00\x00\x18ftypmp42" + bytes(100)
