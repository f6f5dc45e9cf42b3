"""A bounded load test on loopback: many concurrent submissions against a small queue. The server stays up, answers
429 (with Retry-After) when the queue is full, finishes every job it accepted, and loses none."""

from __future__ import annotations

import threading
import time

import httpx

from service_fixtures import live_server, settings, wait_status

CLIENTS = 16
QUEUE = 3


def test_many_concurrent_submissions_against_a_small_queue(tmp_path):
    with live_server(settings(tmp_path, max_queue=QUEUE)) as server:
        answers: list[httpx.Response] = []
        lock = threading.Lock()
        go = threading.Event()

        def submit(i: int) -> None:
            route = "/v1/videos/sync" if i % 4 == 0 else "/v1/videos"  # sync and async share the queue
            with server.client(timeout=120) as c:
                go.wait()
                r = c.post(route, data={"prompt": f"load {i}", "num_inference_steps": "6", "seed": str(i)})
            with lock:
                answers.append(r)

        threads = [threading.Thread(target=submit, args=(i,)) for i in range(CLIENTS)]
        for t in threads:
            t.start()
        go.set()
        for t in threads:
            t.join(300)
        assert len(answers) == CLIENTS

        statuses = sorted(r.status_code for r in answers)
        assert set(statuses) <= {200, 429}, statuses
        full = [r for r in answers if r.status_code == 429]
        assert full, "a queue of 3 must overflow under 16 simultaneous submissions"
        for r in full:
            assert r.json()["error"]["code"] == "queue_full" and r.headers["Retry-After"]
        accepted = [
            r.json()["id"] for r in answers if r.status_code == 200 and r.headers["content-type"] != "video/mp4"
        ]
        syncs = [r for r in answers if r.status_code == 200 and r.headers["content-type"] == "video/mp4"]
        assert accepted or syncs

        with server.client() as c:
            for job_id in accepted:
                assert (
                    wait_status(c, job_id, {"completed", "failed", "cancelled"}, timeout=240)["status"] == "completed"
                )
            listed = {j["id"]: j for j in c.get("/v1/videos", params={"limit": 100}).json()["data"]}
            assert set(listed) == set(accepted)  # every accepted job is on record, none extra, none lost
            assert all(c.get(f"/v1/videos/{i}/content").status_code == 200 for i in accepted)
            # Still up, and the queue drained: a new render is taken at once.
            deadline = time.monotonic() + 30
            while server.scheduler.depth:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            assert c.get("/health").json()["queue_depth"] == 0
            assert c.post("/v1/videos/sync", data={"prompt": "after", "num_inference_steps": "2"}).status_code == 200
            metrics = c.get("/metrics").text
        assert f'h3serve_rejected_requests_total{{reason="queue_full"}} {float(len(full))}' in metrics
