"""The fleet's claims (issue 58, step 2; docs/fleet.md): several servers on one PostgreSQL store (a real server,
tests/pg_fixtures.py), each with its own tiny engine and output folder. A job submitted to one is claimed by whichever
server is free and rendered once; a server killed with SIGKILL while it renders loses the job to another after its
lease, whose MP4 is the single-server render byte for byte; a stale holder's late completion is refused; a job only
other servers can render waits, shown with no takers, until one comes; the queue's limit is the fleet's.

Order, not the clock: a server is kept busy by a gate in front of its real engine (`Gated`), so which server can claim
the next job is known; waits poll what they wait for (`until`)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from fleet_fixtures import Gated, Serve, claims
from h3serve.accel.profile import Profile
from h3serve.media.encoding import Encoding
from h3serve.pipeline.engine import Engine
from h3serve.pipeline.request import RequestFields
from h3serve.service.metrics import Metrics
from h3serve.service.scheduler import Scheduler, Work
from h3serve.service.schemas import JobStatus
from h3serve.service.store import Fleet, LeaseLost, job_record, new_job_id
from h3serve.service.store.claims import Capabilities, Claim, decode_request, encode_request
from h3serve.service.store.postgres import PostgresJobStore
from h3serve.settings import SettingsError, load_settings
from service_fixtures import live_server, png_bytes, settings, until, wait_status

LEASE = {"lease_s": 2, "heartbeat_s": 0.5}  # short leases: a dead server's job moves on within seconds
JOB = {"prompt": "a kettle on a stove", "num_inference_steps": "2", "width": "224", "height": "128"}
# A render of a few seconds on a CPU (199 forwards at 256x256), long enough to be killed in the middle of.
LONG = {"prompt": "a long kettle", "num_inference_steps": "200", "width": "256", "height": "256", "seed": "11",
        "extra_params": '{"duration": 2.3}'}  # fmt: skip


@pytest.fixture(scope="module")
def engines() -> list[Engine]:
    """Three tiny engines, one per server (two servers never share one engine's caches); the same weights."""
    return [Engine.load(None, Profile()) for _ in range(3)]


def expire(url: str, job_id: str) -> None:
    """The job's lease as a holder that stopped renewing it leaves it: run out."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as db:
        db.execute("UPDATE job_claims SET lease_until = clock_timestamp() - interval '1 second' WHERE job_id=%s",
                   (job_id,))  # fmt: skip


def completed_renders(server) -> float:
    return server.app.state.metrics.registry.get_sample_value("h3serve_renders_total", {"outcome": "completed"}) or 0


@contextmanager
def fleet(url: str, root: Path, engines: list, names: list[str], **values: Any) -> Iterator[list]:
    """Live servers on one store, each with its own folder, name and engine."""
    with ExitStack() as stack:
        servers = []
        for name, engine in zip(names, engines, strict=False):
            s = settings(root / name, startup_warmup=False, store=url, server_id=name, **{**LEASE, **values})
            servers.append(stack.enter_context(live_server(s, engine)))
        yield servers


def submit(client: httpx.Client, **fields: str) -> str:
    answer = client.post("/v1/videos", data={**JOB, **fields})
    assert answer.status_code == 200, answer.text
    return answer.json()["id"]


def test_a_job_submitted_to_one_server_is_claimed_by_whichever_is_free_and_rendered_once(pg_url, tmp_path, engines):
    gated = [Gated(e) for e in engines]
    with fleet(pg_url, tmp_path, gated, ["a", "b", "c"]) as servers, servers[0].client() as c:
        held: list[str] = []
        jobs = []
        for seed in range(3):  # each to server a; each claimed by a server not yet held busy at its gate
            jobs.append(submit(c, seed=str(seed)))
            holder = until(lambda j=jobs[-1]: claims(pg_url).get(j, (None, 0))[0], f"job {seed} claimed")
            assert holder not in held
            held.append(holder)
            until(lambda h=holder: gated["abc".index(h)].entered.is_set(), f"server {holder} rendering")
        assert sorted(held) == ["a", "b", "c"]  # every server took one: any server takes the next job
        health = c.get("/health").json()
        assert health["fleet"] == {"server_id": "a", "lease_s": 2, "heartbeat_s": 0.5}
        for g in gated:
            g.gate.set()
        done = [wait_status(c, j, {"completed", "failed"}) for j in jobs]
        assert [d["status"] for d in done] == ["completed"] * 3, done
        assert claims(pg_url) == {j: (h, 1) for j, h in zip(jobs, held, strict=True)}  # each claimed once
        assert [completed_renders(s) for s in servers] == [1, 1, 1]  # each rendered once, by its holder
        for j, holder in zip(jobs, held, strict=True):
            # Its MP4 is in its holder's folder alone, and it is the same request's single-server render.
            where = [name for name in "abc" if (tmp_path / name / "videos" / f"{j}.mp4").exists()]
            assert where == [holder]
            seed = str(jobs.index(j))
            sync = servers[0].client().post("/v1/videos/sync", data={**JOB, "seed": seed}).content
            assert (tmp_path / holder / "videos" / f"{j}.mp4").read_bytes() == sync
        assert c.get(f"/v1/videos/{jobs[0]}").json()["status"] == "completed"  # every server reads every record


def test_a_killed_servers_job_is_claimed_again_after_its_lease_and_its_mp4_is_the_single_server_render(
    pg_url, tmp_path, engines
):
    env = {k: v for k, v in os.environ.items() if not k.startswith("H3_")}
    env.update(H3_STORE=pg_url, H3_SERVER_ID="victim", H3_LEASE_S="2", H3_HEARTBEAT_S="0.5", H3_STARTUP_WARMUP="false")
    victim = Serve("victim", tmp_path / "victim", env)
    victim.start()
    try:
        victim.wait_ready()
        with victim.client() as c:
            job = c.post("/v1/videos", data=LONG).json()["id"]
            until(lambda: c.get(f"/v1/videos/{job}").json()["progress"] > 0, "the victim rendering the job")
        assert claims(pg_url)[job] == ("victim", 1)
        victim.kill()  # mid-render: no shutdown, no last write, its lease simply stops
    finally:
        if victim.running:
            victim.process.kill()
    s = settings(tmp_path / "heir", startup_warmup=False, store=pg_url, server_id="heir", **LEASE)
    with live_server(s, engines[0]) as heir, heir.client() as c:
        assert c.get(f"/v1/videos/{job}").json()["status"] == "in_progress"  # the dead holder's, until its lease ends
        done = wait_status(c, job, {"completed", "failed"}, timeout=120)
        assert done["status"] == "completed", done
        assert claims(pg_url)[job] == ("heir", 2)  # claimed again once, by the heir
        assert completed_renders(heir) == 1
        mp4 = c.get(f"/v1/videos/{job}/content").content
        assert mp4 == (tmp_path / "heir" / "videos" / f"{job}.mp4").read_bytes()
        single = c.post("/v1/videos/sync", data=LONG).content  # the same request, rendered by one server
        assert mp4[4:8] == b"ftyp" and mp4 == single
    assert not list((tmp_path / "victim" / "videos").glob("*.mp4"))  # the victim finished nothing


class HeldEncode(Scheduler):
    """The real scheduler whose encoder waits inside the encode until the test lets it write the MP4."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.in_encode, self.release = threading.Event(), threading.Event()

    def _write(self, work: Work):
        self.in_encode.set()
        assert self.release.wait(60), "the test never released the encoder"
        return super()._write(work)


def test_a_stale_holders_late_completion_is_refused_and_another_finishes_the_job(pg_url, tmp_path, engines):
    """A holder that stalls past its lease (its heartbeat far off) while another server claims the job again: its
    completion writes nothing and its MP4 goes; the second holder's completion is the record."""
    engine = engines[0]
    s = settings(tmp_path / "stale", store=pg_url)
    store = PostgresJobStore(pg_url, tmp_path / "stale", server_id="stale")
    caps = Capabilities.of(s, engine)
    stale = HeldEncode(engine, store, max_queue=8, warmup=False, encoding=Encoding(threads=1), metrics=Metrics(),
                       fleet=Fleet(store, caps, engine, lease_s=60, heartbeat_s=30))  # fmt: skip
    other_store = PostgresJobStore(pg_url, tmp_path / "other", server_id="other")
    other = Fleet(other_store, caps, engine, lease_s=60, heartbeat_s=30)
    stale.start()
    try:
        request = engine.validate(RequestFields("a kettle", steps=2, seed=5))
        work = Work(new_job_id(), request, persist=True)
        stale.submit(work, job_record(work.id, request, s.model_id))
        assert stale.in_encode.wait(30)  # rendered, its MP4 being written
        expire(pg_url, work.id)
        second = other.claim()
        assert (second.job_id, second.generation) == (work.id, 2)
        stale.release.set()
        until(lambda: not stale.live().get(work.id), "the stale holder to let go of the job")
        record = store.get(work.id)
        assert (record.status, record.file_name) == (JobStatus.IN_PROGRESS, None)  # nothing written by the stale one
        assert not (tmp_path / "stale" / "videos" / f"{work.id}.mp4").exists()
        assert other.renew([second]).lost == frozenset()
        assert stale.fleet.renew([Claim(work.id, 1, request)]).lost == {work.id}  # its heartbeat would say so too
        with pytest.raises(LeaseLost):  # any later write of the stale claim is refused
            stale.fleet.write(Claim(work.id, 1, request), True, status=JobStatus.FAILED)
        other.write(second, True, status=JobStatus.COMPLETED, progress=100, file_name=f"{work.id}.mp4")
        assert store.get(work.id).status == JobStatus.COMPLETED
        assert claims(pg_url)[work.id] == ("other", 2)
    finally:
        stale.stop()
        store.close()
        other_store.close()


def test_a_job_only_other_servers_can_render_waits_shown_with_no_takers_until_one_comes(pg_url, tmp_path, engines):
    # A job queued by a server of another build (its served name differs: other weights), which then stops.
    s_other = settings(tmp_path / "gone", store=pg_url, served_model_name="other-model")
    gone = PostgresJobStore(pg_url, tmp_path / "gone", server_id="gone")
    request = engines[2].validate(RequestFields("another model's job", steps=2, seed=3))
    foreign = job_record(new_job_id(), request, s_other.model_id)
    Fleet(gone, Capabilities.of(s_other, engines[2]), engines[2], 2, 0.5).enqueue(foreign, request, time.time(), 8, 0)
    gone.close()
    with fleet(pg_url, tmp_path, engines[:1], ["tiny"]) as (tiny,), tiny.client() as c:
        mine = submit(c, seed="4")  # queued after the foreign job: claimed first all the same
        assert wait_status(c, mine, {"completed", "failed"})["status"] == "completed"
        shown = c.get(f"/v1/videos/{foreign.id}").json()
        assert shown["status"] == "queued" and shown["live"]["takers"] == 0, shown  # no live server can take it
        assert claims(pg_url)[foreign.id] == (None, 0)
        s = settings(tmp_path / "other", startup_warmup=False, store=pg_url, server_id="other",
                     served_model_name="other-model", **LEASE)  # fmt: skip
        with live_server(s, engines[1]):
            done = wait_status(c, foreign.id, {"completed", "failed"})
        assert done["status"] == "completed" and claims(pg_url)[foreign.id] == ("other", 1)
        assert (tmp_path / "other" / "videos" / f"{foreign.id}.mp4").exists()


def test_the_queue_limit_counts_the_fleets_queued_jobs(pg_url, tmp_path, engines):
    gated = [Gated(e) for e in engines[:2]]
    with fleet(pg_url, tmp_path, gated, ["a", "b"], max_queue=2) as (a, b), a.client() as ca, b.client() as cb:
        busy = [submit(ca, seed="1"), submit(cb, seed="2")]  # one on each worker, held at its gate
        until(lambda: all(claims(pg_url).get(j, (None, 0))[0] for j in busy), "both claimed")
        waiting = [submit(ca, seed="3"), submit(cb, seed="4")]  # the fleet's queue: 2 waiting
        assert cb.get("/health").json()["queue_depth"] == 2 == ca.get("/health").json()["queue_depth"]
        full = cb.post("/v1/videos", data={**JOB, "seed": "5"})
        assert (full.status_code, full.json()["error"]["code"]) == (429, "queue_full"), full.text
        assert ca.post("/v1/videos/sync", data=JOB).status_code == 429  # a sync render waits in the same line
        ahead = [ca.get(f"/v1/videos/{j}").json()["live"] for j in waiting]
        assert [(x["ahead"], x["takers"]) for x in ahead] == [(0, 2), (1, 2)]
        for g in gated:
            g.gate.set()
        for j in busy + waiting:
            assert wait_status(ca, j, {"completed", "failed"})["status"] == "completed"
        assert completed_renders(a) + completed_renders(b) == 4
        assert all(generation == 1 for _, generation in claims(pg_url).values())


def test_a_delete_cancels_a_queued_job_at_once_and_one_another_server_renders(pg_url, tmp_path, engines):
    gated = [Gated(e) for e in engines[:2]]
    with fleet(pg_url, tmp_path, gated, ["a", "b"]) as servers, servers[0].client() as ca, servers[1].client() as cb:
        held = {}
        for seed in ("1", "2"):  # one held on each server
            job = submit(ca, seed=seed)
            held[until(lambda j=job: claims(pg_url).get(j, (None, 0))[0], f"job {seed} claimed")] = job
        queued = submit(ca, seed="3")
        answer = cb.delete(f"/v1/videos/{queued}")  # held by nobody: cancelled in the store, never claimed
        assert (answer.status_code, answer.json()["status"]) == (200, "cancelled"), answer.text
        assert claims(pg_url)[queued] == (None, 0)
        # Held by a: cancelled through b, whose DELETE a's heartbeat passes on; it answers once the job has stopped.
        answer = cb.delete(f"/v1/videos/{held['a']}")
        assert (answer.status_code, answer.json()["status"]) == (200, "cancelled"), answer.text
        assert ca.get(f"/v1/videos/{held['a']}").json()["error"]["code"] == "cancelled"
        gated[1].gate.set()
        assert wait_status(ca, held["b"], {"completed", "failed"})["status"] == "completed"
        assert [completed_renders(s) for s in servers] == [0, 1]


def test_a_stopped_server_gives_the_job_it_holds_back_to_the_queue_and_another_renders_it(pg_url, tmp_path, engines):
    gated = Gated(engines[0])
    with fleet(pg_url, tmp_path, [gated], ["leaving"]) as (leaving,), leaving.client() as c:
        job = submit(c, seed="6")
        until(gated.entered.is_set, "its render held")
    # Stopped (as SIGTERM stops `serve`): not failed `interrupted` as on one server, but queued again, unheld.
    with psycopg_connection(pg_url) as db:
        assert db.execute("SELECT status FROM jobs WHERE id=%s", (job,)).fetchone()[0] == "queued"
    assert claims(pg_url)[job] == (None, 1)
    with fleet(pg_url, tmp_path, engines[1:2], ["staying"]) as (staying,), staying.client() as c:
        assert wait_status(c, job, {"completed", "failed"})["status"] == "completed"
    assert claims(pg_url)[job] == ("staying", 2)


@contextmanager
def psycopg_connection(url: str):
    import psycopg

    with psycopg.connect(url, autocommit=True) as db:
        yield db


def test_a_restarted_server_of_the_same_name_queues_its_jobs_again_at_once(pg_url, tmp_path, engines):
    engine = engines[0]
    s = settings(tmp_path / "a", store=pg_url)
    caps = Capabilities.of(s, engine)
    first = PostgresJobStore(pg_url, tmp_path / "a", server_id="same")
    request = engine.validate(RequestFields("a kettle", steps=2, seed=1))
    job = job_record(new_job_id(), request, s.model_id)
    crashed = Fleet(first, caps, engine, 30, 10)
    crashed.enqueue(job, request, time.time(), 8, 0)
    assert crashed.claim().job_id == job.id
    first.close()  # as a crash leaves it: the claim held, its lease 30 s long
    again = PostgresJobStore(pg_url, tmp_path / "a", server_id="same")
    try:
        assert (again.released, again.recovered) == (1, 0)
        assert again.get(job.id).status == JobStatus.QUEUED and claims(pg_url)[job.id] == (None, 1)
        claim = Fleet(again, caps, engine, 30, 10).claim()
        assert (claim.job_id, claim.generation) == (job.id, 2)
    finally:
        again.close()


def test_the_stored_request_renders_the_same_request(engines):
    """The codec keeps what a render reads: keyframes' pixels, the sampler, the adapters; bytes that are not a stored
    request are refused."""
    engine = engines[0]
    keyframes = [png_bytes(96, 64, 1), png_bytes(64, 96, 2)]
    fields = RequestFields("two keyframes", task="fl2va", keyframes=keyframes, steps=3, seed=2**62, audio_shift=2.5)
    request = engine.validate(fields)
    back = decode_request(encode_request(request))
    for name in ("task", "prompt", "width", "height", "num_frames", "steps", "seed", "video_shift", "audio_shift",
                 "quality", "preview_every", "notices", "positions", "adapters"):  # fmt: skip
        assert getattr(back, name) == getattr(request, name), name
    assert [k.tobytes() for k in back.keyframes] == [k.tobytes() for k in request.keyframes]
    assert [k.size for k in back.keyframes] == [k.size for k in request.keyframes]
    with pytest.raises(ValueError, match="stored request cannot be read"):
        decode_request(b"not a request")


def test_the_lease_settings_are_checked_before_anything_loads():
    url = "postgresql://h3@db.example/jobs"
    assert load_settings(env={"H3_STORE": url}).lease == 30
    assert load_settings(env={"H3_STORE": url, "H3_LEASE_S": "6"}).heartbeat == 2
    for env, setting, words in (
        ({"H3_LEASE_S": "10"}, "lease_s", "no fleet to lease in"),
        ({"H3_STORE": url, "H3_LEASE_S": "4", "H3_HEARTBEAT_S": "3"}, "heartbeat_s", "at most half of H3_LEASE_S"),
        ({"H3_STORE": url, "H3_LEASE_S": "1"}, "lease_s", "greater than or equal to 2"),
        ({"H3_SERVER_ID": "a b"}, "server_id", "1 to 64 of"),
    ):
        with pytest.raises(SettingsError) as refused:
            load_settings(env=env)
        assert refused.value.settings == [setting] and words in str(refused.value), str(refused.value)
