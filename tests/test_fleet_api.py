"""One API across the fleet (issue 58, item 4; docs/fleet.md): servers on one PostgreSQL store (a real server,
tests/pg_fixtures.py), each with its own tiny engine, answer for every job. A job's events and previews stream through
a server that does not render it, with the holder's ids, to its end; a DELETE through another server stops the holder
by a notice, not at its heartbeat; without shared storage /content elsewhere names the server that holds the MP4 (with
H3_OUTPUT_URL, a real rclone S3, any server serves it); /health, the records and /metrics say who holds what; a
PostgreSQL restarted under running servers is reconnected, with a 503 and not ready meanwhile, and nothing accepted is
lost.

Who renders is decided, not raced: server `a` serves the default build and `b` another one (its served model name), so
jobs submitted to a (its build) are a's alone; a's engine waits at a gate (`Gated`) where a test needs the job
held. Waits poll what they wait for (`until`); the cancel's promptness is shown by a heartbeat too far off to have
carried it (H3_HEARTBEAT_S 1800), and by the count of cancels that came by notice."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from fleet_fixtures import Gated, Restartable, restartable_postgres
from h3serve.accel.profile import Profile
from h3serve.pipeline.engine import Engine
from pg_fixtures import fresh_database
from s3_fixtures import aws_env, s3_server_fixture  # noqa: F401 (the session's `s3_server`)
from service_fixtures import live_server, settings, until, wait_status

# No heartbeat within a test's time: what a cancel or a lost claim does here, a notice did.
FAR = {"lease_s": 3600, "heartbeat_s": 1800}
JOB = {"prompt": "a kettle on a stove", "num_inference_steps": "6", "width": "224", "height": "128", "seed": "3"}


@pytest.fixture(scope="module")
def engines() -> list[Engine]:
    return [Engine.load(None, Profile()) for _ in range(2)]


@pytest.fixture(scope="module")
def pg_db(pg_server) -> Iterator[str]:
    with fresh_database(pg_server) as url:
        yield url


@dataclass
class Fleet:
    a: Any  # LiveServer: renders the default build
    b: Any  # LiveServer: another build (renders none of a's jobs)
    gate: Gated  # a's engine
    root: Path
    url: str


@contextmanager
def two_servers(url: str, root: Path, engines: list[Engine], **values: Any) -> Iterator[Fleet]:
    gated = Gated(engines[0], opened=True)
    with ExitStack() as stack:
        sa = settings(root / "a", startup_warmup=False, store=url, server_id="a", preview_min_every=1, **values)
        sb = settings(root / "b", startup_warmup=False, store=url, server_id="b", served_model_name="other-model",
                      preview_min_every=1, **values)  # fmt: skip
        a = stack.enter_context(live_server(sa, gated))
        b = stack.enter_context(live_server(sb, engines[1]))
        yield Fleet(a, b, gated, root, url)


@pytest.fixture(scope="module")
def fleet(pg_db, tmp_path_factory, engines) -> Iterator[Fleet]:
    with two_servers(pg_db, tmp_path_factory.mktemp("fleet"), engines, **FAR) as f:
        yield f


def submit(client: httpx.Client, **fields: Any) -> str:
    answer = client.post("/v1/videos", data={**JOB, **{k: str(v) for k, v in fields.items()}})
    assert answer.status_code == 200, answer.text
    return answer.json()["id"]


def read_events(client: httpx.Client, job_id: str, last: int | None = None) -> list[tuple[int, str, dict]]:
    headers = {"Last-Event-ID": str(last)} if last is not None else {}
    out, current = [], {}
    with client.stream("GET", f"/v1/videos/{job_id}/events", headers=headers) as stream:
        assert stream.status_code == 200, stream.read()
        for line in stream.iter_lines():
            if not line:
                if current:
                    out.append((int(current["id"]), current["event"], json.loads(current["data"])))
                current = {}
            elif not line.startswith(":"):
                key, _, value = line.partition(": ")
                current[key] = value
    return out


def metric(server, name: str, labels: dict[str, str] | None = None) -> float:
    return server.app.state.metrics.registry.get_sample_value(name, labels or {}) or 0.0


def test_a_jobs_events_and_previews_stream_through_a_server_that_does_not_render_it(fleet):
    with fleet.a.client() as ca, fleet.b.client() as cb:
        fleet.gate.close()
        job = submit(ca, preview_every=2)  # a's build: a renders it, whichever server is asked
        until(fleet.gate.entered.is_set, "a holding the job")
        seen: list = []
        reader = threading.Thread(target=lambda: seen.extend(read_events(cb, job)), daemon=True)
        reader.start()  # b's stream, open while a holds the job at its gate: all that follows comes live
        until(lambda: fleet.b.app.state.streams.open == 1, "b's stream open")
        fleet.gate.open()
        reader.join(120)
        assert not reader.is_alive()
        here = read_events(ca, job)  # the holder's own log, after the end
        assert seen == here  # the same events, ids and data, through either server
        names = [name for _, name, _ in seen]
        assert names[0] == "queued" and names[-1] == "completed" and "progress" in names
        assert [d["forward"] for _, n, d in seen if n == "preview"] == [1, 3]  # 5 forwards, every 2nd
        assert [i for i, _, _ in seen] == list(range(1, len(seen) + 1))
        # A preview through b (the holder relayed it), the same PNG as a's.
        url = next(d["url"] for _, n, d in seen if n == "preview")
        assert cb.get(url).content == ca.get(url).content and cb.get(url).headers["content-type"] == "image/png"
        # Resumed through b after any event it names: the rest, as a gives it.
        middle = seen[len(seen) // 2][0]
        assert read_events(cb, job, last=middle) == read_events(ca, job, last=middle) == seen[middle:]
        # The records say who rendered it, through either server.
        assert cb.get(f"/v1/videos/{job}").json()["server_id"] == "a"
        assert {j["id"]: j["server_id"] for j in cb.get("/v1/videos").json()["data"]}[job] == "a"


def test_a_delete_through_another_server_stops_the_holder_by_notice(fleet):
    with fleet.a.client() as ca, fleet.b.client() as cb:
        fleet.gate.close()
        job = submit(ca)
        until(fleet.gate.entered.is_set, "a holding the job")
        assert cb.get("/health").json()["fleet_jobs"] == {job: "a"} == ca.get("/health").json()["fleet_jobs"]
        assert (metric(fleet.a, "h3serve_jobs_held"), metric(fleet.b, "h3serve_jobs_held")) == (1, 0)
        assert metric(fleet.b, "h3serve_fleet_jobs_held", {"server": "a"}) == 1
        cancels = metric(fleet.a, "h3serve_fleet_cancels_total", {"via": "notify"})
        seen: list = []
        reader = threading.Thread(target=lambda: seen.extend(read_events(cb, job)), daemon=True)
        reader.start()
        start = time.monotonic()
        answer = cb.delete(f"/v1/videos/{job}")  # a's next heartbeat is half an hour off: a notice carries it
        took = time.monotonic() - start
        assert (answer.status_code, answer.json()["status"]) == (200, "cancelled"), answer.text
        assert answer.json()["server_id"] == "a"
        print(f"DELETE through b of a job a holds answered in {took * 1000:.0f} ms")
        assert metric(fleet.a, "h3serve_fleet_cancels_total", {"via": "notify"}) == cancels + 1
        assert metric(fleet.a, "h3serve_fleet_cancels_total", {"via": "heartbeat"}) == 0
        reader.join(60)
        assert seen[-1][1] == "cancelled" and seen[-1][2]["error"]["code"] == "cancelled"  # b's stream ended with it
        assert ca.get("/health").json()["fleet_jobs"] == {}
        fleet.gate.open()


def test_a_queued_job_cancelled_through_any_server_ends_its_streams_everywhere(fleet):
    with fleet.a.client() as ca, fleet.b.client() as cb:
        fleet.gate.close()
        busy = submit(ca, seed=1)
        until(fleet.gate.entered.is_set, "a busy")
        queued = submit(ca, seed=2)  # waits behind it: a is the only server of its build
        seen: list = []
        reader = threading.Thread(target=lambda: seen.extend(read_events(ca, queued)), daemon=True)
        reader.start()  # through a, which has no log of it: the stored events
        until(lambda: fleet.a.app.state.streams.open == 1, "a's stream open")
        assert cb.delete(f"/v1/videos/{queued}").json()["status"] == "cancelled"
        reader.join(60)
        assert [(i, n) for i, n, _ in seen] == [(1, "queued"), (2, "cancelled")]
        assert seen[-1][2]["error"]["code"] == "cancelled" and set(seen[-1][2]) == {"status", "error"}  # stored, as a
        # holder's end event is (not the record a stream falls back on when a job ended with no stored end)
        assert cb.delete(f"/v1/videos/{busy}").json()["status"] == "cancelled"
        fleet.gate.open()


def test_without_shared_storage_content_elsewhere_names_the_server_that_holds_the_mp4(fleet):
    with fleet.a.client() as ca, fleet.b.client() as cb:
        job = submit(ca, seed=9)
        assert wait_status(cb, job, {"completed", "failed"})["status"] == "completed"
        mine = ca.get(f"/v1/videos/{job}/content")
        assert mine.status_code == 200 and mine.content[4:8] == b"ftyp"
        elsewhere = cb.get(f"/v1/videos/{job}/content")
        error = elsewhere.json()["error"]
        assert (elsewhere.status_code, error["code"], error["param"]) == (421, "on_another_server", "video_id")
        assert elsewhere.headers["x-h3-server-id"] == "a" and "'a'" in error["message"], error
        assert "H3_OUTPUT_URL" in error["message"]
        mp4 = fleet.root / "a" / "videos" / f"{job}.mp4"
        assert mp4.exists()
        assert cb.delete(f"/v1/videos/{job}").json()["deleted"] is True  # through b: a removes its own MP4
        until(lambda: not mp4.exists(), "a removing the deleted job's MP4")
        assert ca.get(f"/v1/videos/{job}/content").status_code == 404


def test_with_shared_storage_any_server_serves_the_mp4(pg_server, s3_server, tmp_path, engines):
    bucket = s3_server.bucket()
    with (
        fresh_database(pg_server) as url,
        aws_env(s3_server),
        two_servers(url, tmp_path, engines, output_url=f"s3://{bucket}/h3", s3_endpoint=s3_server.endpoint) as f,
        f.a.client() as ca,
        f.b.client() as cb,
    ):
        job = submit(ca, seed=4)
        assert wait_status(cb, job, {"completed", "failed"})["status"] == "completed"
        theirs, mine = cb.get(f"/v1/videos/{job}/content"), ca.get(f"/v1/videos/{job}/content")
        assert theirs.status_code == mine.status_code == 200 and theirs.content == mine.content
        assert cb.get(f"/v1/videos/{job}").json()["server_id"] == "a"
        assert cb.delete(f"/v1/videos/{job}").json()["deleted"] is True
        assert s3_server.keys(bucket, "h3/") == []


# ---- a PostgreSQL restarted under running servers ---------------------------------------------------------------
@pytest.fixture(scope="module")
def restartable() -> Iterator[Restartable]:
    with restartable_postgres() as server:
        yield server


def test_a_restarted_database_is_reconnected_and_nothing_accepted_is_lost(restartable, tmp_path, engines):
    with (
        fresh_database(restartable.url) as url,
        two_servers(url, tmp_path, engines, **FAR) as f,
        f.a.client() as ca,
        f.b.client() as cb,
    ):
        before = submit(cb, seed=21)
        assert wait_status(cb, before, {"completed", "failed"})["status"] == "completed"
        f.gate.close()
        held = submit(ca, seed=22)  # accepted, then rendered across the outage
        until(f.gate.entered.is_set, "a holding the job")
        restartable.stop()
        try:
            for c in (ca, cb):  # each server says so at once
                health = c.get("/health").json()
                assert health["ready"] is False and "job store does not answer" in health["problem"], health
                assert health["fleet_jobs"] is None
            refused = cb.post("/v1/videos", data=JOB)
            assert refused.status_code == 503 and refused.headers["retry-after"], refused.text
            assert "job store does not answer" in refused.json()["error"]["message"]
            read = cb.get(f"/v1/videos/{before}")
            assert (read.status_code, read.json()["error"]["code"]) == (503, "store_unavailable"), read.text
            assert ca.get("/metrics").status_code == 200  # a scrape still answers (h3serve_ready 0)
            f.gate.open()  # a finishes its render while the database is down: its end waits to be written
            until(lambda: held not in f.a.scheduler.live(), "a's render and encode finished")
            assert f.a.scheduler.held() == []
        finally:
            restartable.start()
        for c in (ca, cb):
            until(lambda c=c: c.get("/health").json()["ready"], "ready again")
        done = wait_status(cb, held, {"completed", "failed"})
        assert done["status"] == "completed", done  # rendered across the outage, written after it
        assert ca.get(f"/v1/videos/{held}/content").content[4:8] == b"ftyp"
        assert cb.get(f"/v1/videos/{before}").json()["status"] == "completed"
        events = read_events(cb, held)  # its events, relayed once the database answered again
        assert events[0][1] == "queued" and events[-1][1] == "completed", events
        after = submit(cb, seed=23)  # a new job, accepted and rendered as before the outage
        assert wait_status(ca, after, {"completed", "failed"})["status"] == "completed"
