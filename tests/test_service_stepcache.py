"""Step caching through the HTTP service, with real tiny-model servers on loopback: one started with a step cache
(a DBCache profile that caches on the tiny model) and one without. The sync route reports the cached forwards in its
headers, quality=lossless turns the cache off for one request (the same MP4 bytes as the server without a cache),
quality=high is refused where there is no cache, an async job's record lists the cached forwards, and /metrics
counts them."""

from __future__ import annotations

import re
import sqlite3

import pytest

from h3serve.accel.profile import Profile
from h3serve.accel.stepcache import parse_cache_config
from h3serve.pipeline.engine import Engine
from h3serve.service.store import JobStore
from service_fixtures import live_server, settings, tiny_engine, wait_status

# Caches every other forward after two warmup forwards on the tiny model (forwards 2, 4, 6, 8 of a 10-step render).
CACHE_CONFIG = (
    '{"Fn_compute_blocks":1,"Bn_compute_blocks":0,"max_warmup_steps":2,"residual_diff_threshold":0.5,'
    '"max_continuous_cached_steps":1}'
)
REQUEST = {"prompt": "a lighthouse in fog, foghorn", "num_inference_steps": "10", "seed": "7", "num_frames": "9"}


@pytest.fixture(scope="module")
def cached(tmp_path_factory):
    engine = Engine.load(None, Profile(), step_cache=parse_cache_config(CACHE_CONFIG))
    with live_server(settings(tmp_path_factory.mktemp("cached")), engine) as s:
        yield s


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    with live_server(settings(tmp_path_factory.mktemp("plain")), tiny_engine()) as s:
        yield s


def cached_steps(header: str) -> list[int]:
    return [int(i) for i in header.split(",")] if header else []


def metric(text: str, name: str) -> float:
    match = re.search(rf"^{name} (\S+)$", text, re.M)
    assert match, f"{name} not in /metrics"
    return float(match[1])


def test_sync_render_reports_the_cached_forwards(cached):
    with cached.client() as c:
        r = c.post("/v1/videos/sync", data=REQUEST)
    assert r.status_code == 200, r.text
    assert r.headers["X-H3-Step-Cache"] == "server"
    assert r.headers["X-H3-DiT-Forwards"] == "9"  # 10 steps: 9 DiT forwards
    steps = cached_steps(r.headers["X-H3-Cached-Steps"])
    assert steps == [2, 4, 6, 8], steps


def test_lossless_runs_uncached_and_matches_the_server_without_a_cache(cached, plain):
    with cached.client() as c, plain.client() as p:
        lossless = c.post("/v1/videos/sync", data={**REQUEST, "quality": "lossless"})
        reference = p.post("/v1/videos/sync", data=REQUEST)
    assert lossless.status_code == reference.status_code == 200, (lossless.text, reference.text)
    assert lossless.headers["X-H3-Step-Cache"] == "off" and lossless.headers["X-H3-Cached-Steps"] == ""
    assert lossless.headers["X-H3-DiT-Forwards"] == "9"
    # Without a cache the server says off, lists nothing, and has no forward count (nothing counts them).
    assert reference.headers["X-H3-Step-Cache"] == "off" and reference.headers["X-H3-Cached-Steps"] == ""
    assert "X-H3-DiT-Forwards" not in reference.headers
    assert lossless.content == reference.content


def test_quality_high_without_a_step_cache_is_a_400_naming_quality(plain):
    with plain.client() as p:
        r = p.post("/v1/videos/sync", data={**REQUEST, "quality": "high"})
        bad = p.post("/v1/videos/sync", data={**REQUEST, "quality": "best"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "quality" and "without step caching" in error["message"], error
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "quality"


def test_quality_high_runs_the_conservative_profile(cached):
    with cached.client() as c:
        r = c.post("/v1/videos/sync", data={**REQUEST, "quality": "high"})
    assert r.status_code == 200, r.text
    assert r.headers["X-H3-Step-Cache"] == "high"
    assert all(4 <= i < 9 for i in cached_steps(r.headers["X-H3-Cached-Steps"]))  # HIGH_QUALITY: 4 warmup forwards


def test_async_job_record_lists_the_cached_forwards(cached, plain):
    with cached.client() as c, plain.client() as p:
        job = c.post("/v1/videos", data=REQUEST).json()
        assert job["step_cache"] is None and job["cached_steps"] is None  # known once it has run
        done = wait_status(c, job["id"], {"completed", "failed"})
        listed = c.get("/v1/videos").json()["data"]
        other = wait_status(p, p.post("/v1/videos", data=REQUEST).json()["id"], {"completed", "failed"})
    assert done["status"] == "completed", done
    assert (done["step_cache"], done["cached_steps"]) == ("server", [2, 4, 6, 8])
    assert next(j for j in listed if j["id"] == job["id"])["cached_steps"] == [2, 4, 6, 8]
    assert (other["status"], other["step_cache"], other["cached_steps"]) == ("completed", "off", [])


def test_metrics_count_forwards_run_and_cached(cached, plain):
    with cached.client() as c, plain.client() as p:
        before = c.get("/metrics").text
        assert c.post("/v1/videos/sync", data=REQUEST).status_code == 200
        after = c.get("/metrics").text
        plain_text = p.get("/metrics").text
    ran = metric(after, "h3serve_dit_forwards_total") - metric(before, "h3serve_dit_forwards_total")
    skipped = metric(after, "h3serve_dit_forwards_cached_total") - metric(before, "h3serve_dit_forwards_cached_total")
    assert (ran, skipped) == (9, 4)
    assert metric(plain_text, "h3serve_dit_forwards_cached_total") == 0


def test_an_older_job_store_gains_the_step_cache_columns(tmp_path):
    db = sqlite3.connect(tmp_path / "jobs.sqlite3")
    db.execute(
        "CREATE TABLE jobs (id TEXT PRIMARY KEY, status TEXT NOT NULL, progress INTEGER, model TEXT, prompt TEXT, "
        "size TEXT, seconds TEXT, quality TEXT, created_at INTEGER, completed_at INTEGER, error_code TEXT, "
        "error_message TEXT, file_name TEXT, inference_time_s REAL, stage_durations TEXT, peak_memory_mb REAL, "
        "task TEXT, num_frames INTEGER, num_inference_steps INTEGER, seed INTEGER)"
    )
    db.execute(
        "INSERT INTO jobs VALUES ('video_gen_old', 'completed', 100, 'h3serve-tiny', 'p', '224x128', '1', NULL, 1, 2, "
        "NULL, NULL, 'video_gen_old.mp4', 1.0, '{\"denoise\": 1.0}', 10.0, 't2va', 9, 4, 3)"
    )
    db.commit()
    db.close()
    store = JobStore(tmp_path)
    try:
        old = store.get("video_gen_old")
        assert old is not None and (old.step_cache, old.cached_steps) == (None, None)
        store.update("video_gen_old", step_cache="server", cached_steps=[1, 3])
        assert store.get("video_gen_old").cached_steps == [1, 3]
    finally:
        store.close()
