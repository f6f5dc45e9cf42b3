"""`h3serve serve` and `h3serve render` with a render split over 2 gloo worker processes (the tiny model, loopback):
the same MP4 bytes as one process, the GPU count in /health, the job record and the sync headers; a killed worker
turns the server not ready with the reason, then the workers restart and it is ready again; the CLI's refusals."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from h3serve.accel.profile import Profile
from h3serve.cli import main
from h3serve.media.mp4 import probe_mp4
from h3serve.parallel.workers import ParallelEngine, WorkerSpec
from h3serve.pipeline.engine import Engine
from service_fixtures import live_server, settings, wait_status

SMALL = {"prompt": "a lighthouse at dusk, waves below", "num_inference_steps": "4", "seed": "7"}


@pytest.fixture(scope="module")
def one_thread():
    """Each gloo worker runs one thread; the one-process server is compared at one thread too (tests/test_parallel)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def split(one_thread):
    engine = ParallelEngine(WorkerSpec(None, Profile.for_device("cpu"), 2, cpu_threads=1))
    yield engine
    engine.close()


def test_a_split_server_renders_the_one_process_bytes_and_says_how_many_gpus(tmp_path, split):
    with (
        live_server(settings(tmp_path / "one"), Engine.load(None, Profile.for_device("cpu"))) as one,
        one.client() as c,
    ):
        reference = c.post("/v1/videos/sync", data=SMALL)
        assert reference.status_code == 200, reference.text
        assert reference.headers["x-num-gpus"] == "1"
    with live_server(settings(tmp_path / "two"), split) as server, server.client() as c:
        health = c.get("/health").json()
        assert (health["ready"], health["num_gpus"], health["problem"]) == (True, 2, None)
        r = c.post("/v1/videos/sync", data=SMALL)
        assert r.status_code == 200, r.text
        assert r.headers["x-num-gpus"] == "2"
        assert r.content == reference.content
        job = c.post("/v1/videos", data=SMALL).json()
        done = wait_status(c, job["id"], {"completed", "failed"})
        assert (done["status"], done["num_gpus"]) == ("completed", 2), done
        assert c.get(f"/v1/videos/{job['id']}/content").content == reference.content


def test_a_killed_worker_turns_the_server_not_ready_with_the_reason_until_the_workers_are_back(tmp_path, split):
    with live_server(settings(tmp_path), split) as server, server.client() as c:
        os.kill(split.pool.procs[0].pid, signal.SIGKILL)
        deadline = time.monotonic() + 60  # a bound on a broken server only: polled, not waited out
        while (health := c.get("/health").json())["ready"]:
            assert time.monotonic() < deadline, health
            time.sleep(0.05)
        assert "rank 0" in health["problem"] and "SIGKILL" in health["problem"], health
        ready = c.get("/ready")
        assert ready.status_code == 503 and "rank 0" in ready.json()["problem"]
        deadline = time.monotonic() + 120
        while not (health := c.get("/health").json())["ready"]:
            assert time.monotonic() < deadline and "did not restart" not in (health["problem"] or ""), health
            time.sleep(0.1)
        assert c.post("/v1/videos/sync", data=SMALL).status_code == 200


def test_render_splits_over_gloo_processes_and_refuses_a_count_the_heads_do_not_divide(tmp_path, capsys):
    out = tmp_path / "two.mp4"
    args = ["render", SMALL["prompt"], "--steps", "3", "--no-progress", "--device", "cpu"]
    assert main([*args, "-o", str(out), "--num-gpus", "2"]) == 0
    err = capsys.readouterr().err
    header = next(line for line in err.splitlines() if line.startswith("h3serve: "))
    assert "| 2 GPUs" in header, header
    assert probe_mp4(out).frame_count == 22
    bad = tmp_path / "three.mp4"
    assert main([*args, "-o", str(bad), "--num-gpus", "3"]) == 1
    assert "H3_NUM_GPUS (--num-gpus): 3: the DiT's 4 attention heads do not divide by it (allowed: 1, 2, 4)" in (
        capsys.readouterr().err
    )
    assert not bad.exists()
