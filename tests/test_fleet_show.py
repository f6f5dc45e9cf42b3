"""Issue 58's "Show", with real processes: three `h3serve serve` processes (the tiny model, on the CPU) on one
PostgreSQL database (tests/pg_fixtures.py) and one S3-compatible bucket (`rclone serve s3`, tests/s3_fixtures.py), as
an operator runs a fleet, beside a fourth `serve` alone (SQLite, its own folder: no fleet) that renders each distinct
request once as the single-server reference.

- Jobs submitted round-robin to the three, each polled and downloaded through a server other than the one that
  rendered it (the claim row in PostgreSQL names the renderer: no API field does), every MP4 bitwise the
  single-server render of its request; each server renders some, each job once.
- `kill -9` of the server rendering a long job: another server claims it again once its lease has run out and
  completes it, bitwise the single-server render; the killed server, restarted under its name, joins again.

H3TEST_FLEET_JOBS sets the number of jobs (60 by default, the issue's). The waits poll what they wait for; their
bounds only end a test that would otherwise hang."""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from fleet_fixtures import Serve, claims, serve_fleet
from pg_fixtures import fresh_database
from s3_fixtures import S3Server, s3_server_fixture  # noqa: F401 (the session's `s3_server`)
from service_fixtures import until

JOBS = int(os.environ.get("H3TEST_FLEET_JOBS", "60"))
NAMES = ("a", "b", "c")
LEASE_S, HEARTBEAT_S = 2, 0.5  # short leases: a dead server's job moves on within seconds
PREFIX = "show"
# Six distinct requests (prompt, size, length, seed), each submitted JOBS / 6 times: every copy of one request, on
# whichever server renders it, is the same bytes.
REQUESTS = [
    {"prompt": prompt, "width": width, "height": height, "num_inference_steps": "2", "seed": str(seed),
     "extra_params": f'{{"duration": {duration}}}'}
    for prompt, width, height, duration, seed in (
        ("a kettle on a stove", "224", "128", 0.9, 1),
        ("a kettle on a stove", "224", "128", 0.9, 2),
        ("rain on a tin roof", "128", "224", 0.9, 3),
        ("a lighthouse at dusk", "256", "128", 1.6, 4),
        ("a lighthouse at dusk", "160", "160", 0.9, 5),
        ("two cranes over a harbour", "224", "128", 1.6, 6),
    )
]  # fmt: skip
# A render of a few seconds on a CPU (199 forwards), long enough to be killed in the middle of.
LONG = {"prompt": "a long kettle", "num_inference_steps": "200", "width": "256", "height": "256", "seed": "11",
        "extra_params": '{"duration": 2.3}'}  # fmt: skip


@dataclass
class Fleet:
    url: str  # the PostgreSQL database
    s3: S3Server
    bucket: str
    servers: dict[str, Serve]
    single: Serve  # the single-server reference: SQLite, its own folder, no S3
    references: dict[int, bytes]  # REQUESTS index (or -1: LONG) -> the single server's MP4

    def reference(self, index: int) -> bytes:
        if index not in self.references:
            fields = LONG if index == -1 else REQUESTS[index]
            with self.single.client() as c:
                answer = c.post("/v1/videos/sync", data=fields, timeout=600)
            assert answer.status_code == 200 and answer.content[4:8] == b"ftyp", answer.text[:300]
            self.references[index] = answer.content
        return self.references[index]

    def others(self, name: str | None) -> list[Serve]:
        """The running servers other than `name`."""
        return [s for n, s in self.servers.items() if n != name and s.process.poll() is None]


@pytest.fixture(scope="module")
def fleet(pg_server, s3_server, tmp_path_factory) -> Iterator[Fleet]:
    root = tmp_path_factory.mktemp("fleet")
    bucket = s3_server.bucket()
    with fresh_database(pg_server) as url:
        queue = str(max(8, JOBS + 4))
        settings = {"H3_LEASE_S": str(LEASE_S), "H3_HEARTBEAT_S": str(HEARTBEAT_S), "H3_MAX_QUEUE": queue}
        with serve_fleet(NAMES, root, s3_server, url, bucket, PREFIX, **settings) as (servers, single):
            yield Fleet(url, s3_server, bucket, servers, single, {})


def test_jobs_submitted_round_robin_each_fetched_through_another_server_are_the_single_server_renders(fleet):
    started = time.monotonic()
    references = {i: fleet.reference(i) for i in range(len(REQUESTS))}
    servers = list(fleet.servers.values())
    submitted: dict[str, int] = {}  # job id -> REQUESTS index
    for n in range(JOBS):
        with servers[n % len(servers)].client() as c:
            answer = c.post("/v1/videos", data=REQUESTS[n % len(REQUESTS)])
        assert answer.status_code == 200, answer.text
        submitted[answer.json()["id"]] = n % len(REQUESTS)
    # Poll each job through a server that is not its holder (while it renders, and once it has rendered).
    polled: dict[str, str] = {}
    pending = set(submitted)
    deadline = time.monotonic() + 60 + 10 * JOBS  # ends a hung test; the loop ends when the last job has ended
    while pending:
        held = claims(fleet.url)
        for job in sorted(pending):
            holder = held.get(job, (None, 0))[0]
            via = fleet.others(holder)[hash(job) % 2]
            with via.client() as c:
                record = c.get(f"/v1/videos/{job}").json()
            if record["status"] in ("completed", "failed", "cancelled"):
                assert record["status"] == "completed", record
                assert via.name != holder
                polled[job] = via.name
                pending.discard(job)
        assert time.monotonic() < deadline, f"{len(pending)} jobs not finished: {sorted(pending)[:5]}"
        time.sleep(0.1)
    rendered_at = time.monotonic()
    held = claims(fleet.url)
    renderer = {job: held[job][0] for job in submitted}
    assert all(held[job][1] == 1 for job in submitted), "a job was claimed twice"
    for job, index in submitted.items():
        via = fleet.others(renderer[job])[hash(job) % 2]  # downloaded through a server that did not render it
        with via.client() as c:
            record, mp4 = c.get(f"/v1/videos/{job}").json(), c.get(f"/v1/videos/{job}/content")
        if "server_id" in record:  # a record that names its renderer (docs/fleet.md, "Who holds what") names this one
            assert record["server_id"] == renderer[job], record
        assert mp4.status_code == 200, mp4.text
        assert mp4.content == references[index], f"job {job} (request {index}, rendered by {renderer[job]})"
    # Each job is one object in the bucket, none more; each server rendered some, and exactly the ones its claims say.
    keys = fleet.s3.keys(fleet.bucket, f"{PREFIX}/")
    assert set(keys) >= {f"{PREFIX}/{job}.mp4" for job in submitted}
    by_server = Counter(renderer.values())
    assert set(by_server) == set(NAMES), by_server
    assert {n: s.completed_renders() for n, s in fleet.servers.items()} == dict(by_server)
    print(f"\n{JOBS} jobs over {len(NAMES)} servers, rendered by {dict(sorted(by_server.items()))}: all finished "
          f"{rendered_at - started:.1f} s after the first reference render began (6 references included), "
          f"downloads checked {time.monotonic() - rendered_at:.1f} s later")  # fmt: skip


def test_kill_9_of_the_rendering_server_another_completes_the_job_bitwise_the_same(fleet):
    reference = fleet.reference(-1)
    with fleet.servers["a"].client() as c:
        answer = c.post("/v1/videos", data=LONG)
    assert answer.status_code == 200, answer.text
    job = answer.json()["id"]
    victim = fleet.servers[until(lambda: claims(fleet.url).get(job, (None, 0))[0], "the long job claimed")]
    watcher = fleet.others(victim.name)[0]
    with watcher.client() as c:
        until(lambda: c.get(f"/v1/videos/{job}").json()["progress"] > 0, "the long job rendering", bound=120)
    assert claims(fleet.url)[job] == (victim.name, 1)
    victim.kill()
    killed = time.monotonic()
    try:
        with watcher.client() as c:
            heir = until(lambda: (claims(fleet.url)[job][1] == 2) and claims(fleet.url)[job][0], "claimed again",
                         bound=120)  # fmt: skip
            reclaimed = time.monotonic()
            assert heir != victim.name
            done = until(lambda: (r := c.get(f"/v1/videos/{job}").json())["status"] not in ("queued", "in_progress")
                         and r, "the job ended", bound=300)  # fmt: skip
        assert done["status"] == "completed", done
        assert claims(fleet.url)[job] == (heir, 2)  # claimed again once, by the heir, which completed it
        for via in fleet.others(None):  # every live server serves the heir's object: the single-server render
            with via.client() as c:
                assert c.get(f"/v1/videos/{job}/content").content == reference, f"through {via.name}"
        print(f"\nkilled {victim.name}; {heir} claimed its job {reclaimed - killed:.1f} s later (lease {LEASE_S} s) "
              f"and completed it {time.monotonic() - killed:.1f} s after the kill")  # fmt: skip
    finally:
        # The killed server, restarted under its name once its job has moved on: the fleet is whole again.
        victim.start()
        victim.wait_ready()
    with victim.client() as c:
        assert c.get("/health").json()["fleet"]["server_id"] == victim.name
        assert c.get(f"/v1/videos/{job}/content").content == reference
