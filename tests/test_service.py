"""The service over HTTP on loopback, with the real tiny engine: sync and async renders, listing, download, cancel,
delete, auth, health and readiness, metrics, a restart that loses nothing, and `h3serve accept` against it."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from h3serve.accel.profile import Profile
from h3serve.cli import main
from h3serve.media.mp4 import decode_frames, verify_mp4
from h3serve.pipeline.engine import Engine
from service_fixtures import SMOKE, FormClient, live_server, settings, tiny_engine, wait_status

KEY = "k" * 16 + "0123456789abcdef-._~"  # 36 characters of the allowed set
LONG = {"prompt": "a slow render", "num_inference_steps": "1000"}  # seconds on the tiny model: time to act on it


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with live_server(settings(tmp_path_factory.mktemp("out"))) as s:
        yield s


def test_seed_smoke_request_verbatim_gives_56_frames(server, tmp_path):
    with server.client() as c:
        r = c.post("/v1/videos/sync", data=SMOKE)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "video/mp4"
    stages = json.loads(r.headers["X-Stage-Durations"])
    assert set(stages) == {"text", "keyframes", "layout", "tables", "denoise", "video", "audio"}
    assert float(r.headers["x-inference-time-s"]) > 0 and float(r.headers["x-peak-memory-mb"]) > 0
    path = tmp_path / "smoke.mp4"
    path.write_bytes(r.content)
    info = verify_mp4(path, width=224, height=128, num_frames=56)
    assert info.audio_profile == "LC" and info.channels == 2


def test_sync_renders_are_deterministic_and_a_json_body_is_the_same_request(server):
    form = {**SMOKE, "num_inference_steps": "4", "extra_params": '{"task":"t2va","duration":0.9}'}
    body = {**form, "extra_params": {"task": "t2va", "duration": 0.9}}
    with server.client() as c:
        one, two = c.post("/v1/videos/sync", data=form), c.post("/v1/videos/sync", json=body)
    assert one.status_code == two.status_code == 200
    assert one.content == two.content  # same request, same seed, same profile: the same bytes


def test_async_job_lifecycle_list_and_download(server):
    with server.client() as c:
        created = c.post("/v1/videos", data={"prompt": "tide pools at dawn", "num_inference_steps": "3", "seed": "5"})
        assert created.status_code == 200, created.text
        job = created.json()
        assert job["id"].startswith("video_gen_") and len(job["id"]) == len("video_gen_") + 32
        assert job["object"] == "video" and job["status"] in ("queued", "in_progress")
        assert (job["size"], job["num_frames"], job["seed"], job["model"]) == ("224x128", 22, 5, "h3serve-tiny")
        done = wait_status(c, job["id"], {"completed", "failed"})
        assert done["status"] == "completed" and done["progress"] == 100, done
        assert done["completed_at"] >= done["created_at"] and done["inference_time_s"] > 0
        assert set(done["stage_durations"]) == {"text", "keyframes", "layout", "tables", "denoise", "video", "audio"}
        content = c.get(f"/v1/videos/{job['id']}/content")
        assert content.status_code == 200 and content.headers["content-type"] == "video/mp4"
        listed = c.get("/v1/videos").json()
        assert listed["object"] == "list" and listed["data"][0]["id"] == job["id"]  # newest first


def test_list_is_paginated_newest_first(server):
    with server.client() as c:
        ids = [
            c.post("/v1/videos", data={"prompt": f"clip {i}", "num_inference_steps": "2"}).json()["id"]
            for i in range(3)
        ]
        for job_id in ids:
            wait_status(c, job_id, {"completed"})
        first = c.get("/v1/videos", params={"limit": 2}).json()
        assert [j["id"] for j in first["data"]] == ids[::-1][:2] and first["has_more"]
        second = c.get("/v1/videos", params={"limit": 2, "after": first["last_id"]}).json()
        assert second["data"][0]["id"] == ids[0]


def test_cancel_a_running_job_then_a_queued_one(server, monkeypatch):
    steps: list[tuple[int, int]] = []  # (done, total) of every denoise step the renders report
    engine = server.scheduler.engine
    render = engine.render

    def counted_render(request, ctx=None, on_step=None):
        report = ctx.on_progress

        def on_progress(p):
            if p.stage == "denoise" and p.done:  # a step done (the stage's start reports 0 of 1)
                steps.append((p.done, p.total))
            report(p)

        ctx.on_progress = on_progress
        return render(request, ctx, on_step)

    monkeypatch.setattr(engine, "render", counted_render)
    with server.client() as c:
        running = c.post("/v1/videos", data=LONG).json()
        queued = c.post("/v1/videos", data={**LONG, "prompt": "second"}).json()
        wait_status(c, running["id"], {"in_progress"})
        # The queued one first: it never starts.
        r = c.delete(f"/v1/videos/{queued['id']}")
        assert r.status_code == 200 and r.json()["status"] == "cancelled"
        deadline = time.monotonic() + 60  # a bound on a broken server only: the first step comes in well under 1 s
        while not steps:  # the running one is inside its denoise
            assert time.monotonic() < deadline, c.get(f"/v1/videos/{running['id']}").json()
            time.sleep(0.01)
        r = c.delete(f"/v1/videos/{running['id']}")
        assert r.status_code == 200 and r.json()["status"] == "cancelled", r.json()
        # It stopped inside the denoise, at a step's check: not after its 999 forwards (the queued one never started).
        done, total = steps[-1]
        assert total == 999 and done < total, steps[-3:]  # 1000 grid points: 999 forwards
        steps.clear()
        assert r.json()["error"]["code"] == "cancelled"
        assert c.get(f"/v1/videos/{running['id']}/content").status_code == 409
        # The worker is free again: a new job completes.
        after = c.post("/v1/videos", data={"prompt": "after the cancel", "num_inference_steps": "2"}).json()
        assert wait_status(c, after["id"], {"completed", "failed"})["status"] == "completed"
        # Deleting a finished job removes its record and its file.
        path = server.app.state.store.videos / f"{after['id']}.mp4"
        assert path.is_file()
        gone = c.delete(f"/v1/videos/{after['id']}").json()
        assert gone == {"id": after["id"], "object": "video.deleted", "deleted": True}
        assert not path.exists() and c.get(f"/v1/videos/{after['id']}").status_code == 404


def test_a_client_that_disconnects_cancels_its_sync_render(server):
    metrics_before = _metric(server, 'h3serve_renders_total{outcome="cancelled"}')
    with pytest.raises(httpx.ReadTimeout), server.client(timeout=1.5) as c:
        c.post("/v1/videos/sync", data=LONG)
    deadline = time.monotonic() + 60  # a bound on a broken server only: polled, not waited out
    while _metric(server, 'h3serve_renders_total{outcome="cancelled"}') == metrics_before:
        assert time.monotonic() < deadline, "the abandoned render was not cancelled"
        time.sleep(0.1)
    with server.client() as c:
        assert c.post("/v1/videos/sync", data={"prompt": "next", "num_inference_steps": "2"}).status_code == 200


def _metric(server, name: str) -> float:
    with server.client() as c:
        text = c.get("/metrics").text
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def test_metrics_expose_queue_jobs_and_stage_histograms(server):
    with server.client() as c:
        assert c.post("/v1/videos/sync", data={"prompt": "m", "num_inference_steps": "2"}).status_code == 200
        text = c.get("/metrics").text
    assert "h3serve_queue_depth 0.0" in text and "h3serve_ready 1.0" in text
    assert 'h3serve_jobs{state="completed"}' in text
    assert 'h3serve_stage_seconds_count{stage="denoise"}' in text and "h3serve_render_seconds_bucket" in text
    assert _metric(server, 'h3serve_renders_total{outcome="completed"}') >= 1


def test_models_lists_the_model_path_as_given_or_the_served_name(tmp_path):
    with live_server(settings(tmp_path / "a", served_model_name="/models/MiniMax-H3/FL2VA")) as s, s.client() as c:
        assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["/models/MiniMax-H3/FL2VA"]
        assert c.post("/v1/videos", data={"prompt": "x", "model": "/models/MiniMax-H3/FL2VA"}).status_code == 200


def test_auth_required_everywhere_but_health(tmp_path):
    with live_server(settings(tmp_path, api_key=KEY)) as s:
        with s.client() as anonymous:
            assert anonymous.get("/health").status_code == 200
            for method, path in [("GET", "/v1/models"), ("GET", "/ready"), ("GET", "/metrics"), ("GET", "/v1/videos"),
                                 ("POST", "/v1/videos/sync"), ("POST", "/v1/videos"), ("GET", "/v1/videos/x"),
                                 ("DELETE", "/v1/videos/x"), ("GET", "/v1/videos/x/content")]:  # fmt: skip
                r = anonymous.request(method, path)
                assert r.status_code == 401, (method, path, r.status_code)
                assert r.json()["error"]["code"] == "unauthorized" and r.headers["www-authenticate"] == "Bearer"
        with s.client(key=KEY[:-1] + "x") as wrong:
            assert wrong.get("/v1/models").status_code == 401
        with s.client(key=KEY) as c:
            assert c.get("/v1/models").status_code == 200
            assert c.post("/v1/videos/sync", data={**SMOKE, "num_inference_steps": "2"}).status_code == 200


def test_readiness_false_until_the_warmup_passes(tmp_path):
    engine = tiny_engine()
    engine.lock.acquire()  # the warmup waits for the engine, exactly as behind a long render
    try:
        with live_server(settings(tmp_path), engine, ready=False) as s, s.client() as c:
            health = c.get("/health").json()
            assert (health["ready"], health["readiness"], health["warmup"]["passed"]) == (False, "warming", None)
            assert c.get("/ready").status_code == 503
            refused = c.post("/v1/videos/sync", data=SMOKE)
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "not_ready"
            assert "Retry-After" in refused.headers
            engine.lock.release()
            s.wait_ready()
            health = c.get("/health").json()
            expected = "t2va 224x128 22 frames, 2 grid points (1 DiT forward)"
            assert health["warmup"]["passed"] and health["warmup"]["request"] == expected
            assert c.get("/ready").status_code == 200
    finally:
        if engine.lock.locked():
            engine.lock.release()


def test_a_failed_warmup_keeps_the_server_not_ready_and_says_why(tmp_path):
    broken = Engine.load(None, Profile())
    with torch.no_grad():
        next(broken.components.dit.parameters()).fill_(float("nan"))
    with live_server(settings(tmp_path), broken, ready=False) as s, s.client() as c:
        deadline = time.monotonic() + 30
        while c.get("/health").json()["readiness"] == "warming":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        health = c.get("/health").json()
        assert health["readiness"] == "failed" and not health["ready"]
        assert "not finite" in health["warmup"]["error"]
        assert c.get("/ready").status_code == 503
        r = c.post("/v1/videos", data={"prompt": "x"})
        assert r.status_code == 503 and "warmup failed" in r.json()["error"]["message"]


def test_warmup_off_means_ready_at_once(tmp_path):
    with live_server(settings(tmp_path, startup_warmup=False), ready=False) as s, s.client() as c:
        health = c.get("/health").json()
        assert health["ready"] and health["warmup"] == {**health["warmup"], "enabled": False, "passed": None}


def test_accept_passes_against_the_server_and_fails_on_a_wrong_identity(server, tmp_path):
    args = [server.url, "--width", "224", "--height", "128", "--duration", "0.9", "--steps", "3"]
    assert main(["accept", *args, "--out", str(tmp_path / "ok"), "--expect-model", "h3serve-tiny"]) == 0
    report = json.loads((tmp_path / "ok" / "accept-report.json").read_text())
    assert report["passed"] and report["comparison"]["frames_identical"]
    assert report["comparison"]["audio_psnr_db"] == "inf"
    assert [r["status"] for r in report["renders"]] == [200, 200]
    frames = decode_frames(tmp_path / "ok" / "accept-1.mp4")
    np.testing.assert_array_equal(frames, decode_frames(tmp_path / "ok" / "accept-2.mp4"))

    assert main(["accept", *args, "--out", str(tmp_path / "bad"), "--expect-model", "/models/other"]) == 1
    failed = json.loads((tmp_path / "bad" / "accept-report.json").read_text())
    assert not failed["passed"] and not failed["renders"]  # no render is sent to the wrong model


def test_accept_keeps_an_error_body_out_of_the_mp4(server, tmp_path):
    # 768x448 is above the tiny model's canvas cap: the server answers 400, which must never become an .mp4.
    # (asked for explicitly: left unset, accept picks the server's default size from /v1/models)
    big = ["--width", "768", "--height", "448"]
    assert main(["accept", server.url, *big, "--steps", "3", "--out", str(tmp_path)]) == 1
    assert (tmp_path / "accept-1.error.json").is_file() and not list(tmp_path.glob("*.mp4"))
    assert json.loads((tmp_path / "accept-1.error.json").read_text())["error"]["param"] == "width"


# ---- a restart loses nothing ---------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(out: Path, port: int) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("H3_")}
    cmd = [sys.executable, "-m", "h3serve.cli", "serve", "--output-dir", str(out), "--api-port", str(port)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).json()["ready"]:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"server did not become ready: {proc.stderr.read().decode()[-2000:]}")
        time.sleep(0.2)


def test_a_restart_keeps_completed_jobs_and_fails_the_interrupted_ones(tmp_path):
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _start(tmp_path, port)
    try:
        with FormClient(base_url=url, timeout=60) as c:
            done = c.post("/v1/videos", data={"prompt": "kept", "num_inference_steps": "2"}).json()
            wait_status(c, done["id"], {"completed"})
            before = c.get(f"/v1/videos/{done['id']}/content").content
            running = c.post("/v1/videos", data=LONG).json()
            queued = c.post("/v1/videos", data={**LONG, "prompt": "queued"}).json()
            wait_status(c, running["id"], {"in_progress"})
    finally:
        proc.send_signal(signal.SIGKILL)  # a crash: no chance to clean up
        proc.wait(30)
    proc = _start(tmp_path, port)
    try:
        with FormClient(base_url=url, timeout=60) as c:
            jobs = {j["id"]: j for j in c.get("/v1/videos", params={"limit": 100}).json()["data"]}
            assert set(jobs) == {done["id"], running["id"], queued["id"]}
            assert jobs[done["id"]]["status"] == "completed"
            assert c.get(f"/v1/videos/{done['id']}/content").content == before
            for job_id in (running["id"], queued["id"]):
                assert jobs[job_id]["status"] == "failed"
                assert jobs[job_id]["error"]["code"] == "interrupted"
                assert "server stopped" in jobs[job_id]["error"]["message"]
    finally:
        proc.terminate()
        proc.wait(30)


def test_a_clean_shutdown_fails_the_running_and_queued_jobs_with_the_reason(tmp_path):
    from h3serve.service.store import JobStore

    with live_server(settings(tmp_path)) as s, s.client() as c:
        running = c.post("/v1/videos", data=LONG).json()
        queued = c.post("/v1/videos", data={**LONG, "prompt": "queued"}).json()
        wait_status(c, running["id"], {"in_progress"})
    # live_server has stopped the server (uvicorn's shutdown runs the app's): nothing is left active.
    store = JobStore(tmp_path)
    try:
        assert store.recovered == 0
        for job_id in (running["id"], queued["id"]):
            job = store.get(job_id)
            assert job.status == "failed" and job.error.code == "interrupted", job
    finally:
        store.close()


def test_sigterm_ends_serve_gracefully_recording_the_running_job_as_interrupted(tmp_path):
    from h3serve.service.store import JobStore

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _start(tmp_path, port)
    try:
        with FormClient(base_url=url, timeout=60) as c:
            running = c.post("/v1/videos", data=LONG).json()
            queued = c.post("/v1/videos", data={**LONG, "prompt": "queued"}).json()
            wait_status(c, running["id"], {"in_progress"})
        proc.send_signal(signal.SIGTERM)
        # uvicorn shuts down gracefully, then re-raises the signal it caught: the exit says "terminated".
        assert proc.wait(60) == -signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
    log = proc.stderr.read().decode()
    assert "Traceback" not in log, log[-3000:]
    store = JobStore(tmp_path)  # the stopping server wrote the records itself: nothing is left to recover
    try:
        assert store.recovered == 0
        for job_id in (running["id"], queued["id"]):
            job = store.get(job_id)
            assert (job.status, job.error.code) == ("failed", "interrupted"), job
    finally:
        store.close()
