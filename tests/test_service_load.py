"""Bounded load tests on loopback. Many concurrent submissions against a small queue: the server stays up, answers
429 (with Retry-After) when the queue is full, finishes every job it accepted, and loses none. A mix of valid, invalid,
cancelled and disconnecting clients at once: every accepted job ends as asked, none is lost, every refusal is a 4xx,
and the log holds no traceback."""

from __future__ import annotations

import logging
import socket
import threading
import time

import httpx

from service_fixtures import live_server, png_bytes, settings, wait_status

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


MIXED_CLIENTS = 8
ROUNDS = 5
CUT = b'--b\r\nContent-Disposition: form-data; name="prompt"\r\n\r\nhalf a prompt'


def _disconnect(port: int, i: int) -> None:
    """An upload abandoned halfway: the headers promise more body than is ever sent."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/videos HTTP/1.1\r\nHost: x\r\nContent-Type: multipart/form-data; boundary=b\r\n"
            b"Content-Length: 100000\r\n\r\n" + CUT[: 20 + i]
        )


def test_valid_invalid_cancelled_and_disconnecting_clients_at_once(tmp_path, caplog):
    invalid = [
        {"json": {"prompt": "x", "aspect_ratio": None}},
        {"json": {"prompt": "x", "seed": "1" * 400}},
        {"content": b'{"prompt": "\\ud800"}', "headers": {"content-type": "application/json"}},
        {"content": b"prompt=x", "headers": {"content-type": "application/x-www-form-urlencoded"}},
        {"content": CUT, "headers": {"content-type": "multipart/form-data; boundary=b"}},
        {"data": {"prompt": "x"}, "files": {"input_reference": ("k.png", b"\x89PNG broken", "image/png")}},
    ]
    with caplog.at_level(logging.INFO), live_server(settings(tmp_path, max_queue=64)) as server:
        accepted: dict[str, str] = {}  # job id -> the status it must end in
        refusals: list[httpx.Response] = []
        lock = threading.Lock()
        go = threading.Event()

        def client(i: int) -> None:
            with server.client(timeout=120) as c:
                go.wait()
                for round_ in range(ROUNDS):
                    kind = (i + round_) % 4
                    if kind == 0:  # a valid job, kept
                        r = c.post("/v1/videos", data={"prompt": f"mix {i}.{round_}", "num_inference_steps": "3"})
                        assert r.status_code == 200, r.text
                        with lock:
                            accepted[r.json()["id"]] = "completed"
                    elif kind == 1:  # a valid job with a keyframe, cancelled at once
                        files = {"input_reference": ("k.png", png_bytes(224, 128, seed=i), "image/png")}
                        r = c.post("/v1/videos", data={"prompt": "cancel me", "width": "224", "height": "128",
                                                       "num_inference_steps": "40"}, files=files)  # fmt: skip
                        assert r.status_code == 200, r.text
                        job = c.delete(f"/v1/videos/{r.json()['id']}").json()
                        with lock:
                            accepted[r.json()["id"]] = "cancelled" if job.get("status") == "cancelled" else "gone"
                    elif kind == 2:  # invalid
                        r = c.post("/v1/videos", **invalid[(i + round_) % len(invalid)])
                        with lock:
                            refusals.append(r)
                    else:
                        _disconnect(server.port, i)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(MIXED_CLIENTS)]
        for t in threads:
            t.start()
        go.set()
        for t in threads:
            t.join(300)
        assert not any(t.is_alive() for t in threads)

        assert refusals and all(400 <= r.status_code < 500 for r in refusals), [r.text for r in refusals]
        assert all(r.json()["error"]["message"] for r in refusals)
        with server.client() as c:
            listed = {j["id"]: j for j in c.get("/v1/videos", params={"limit": 100}).json()["data"]}
            for job_id, end in accepted.items():
                if end == "gone":  # it had finished before the DELETE, which removed it
                    assert job_id not in listed
                    continue
                job = wait_status(c, job_id, {"completed", "failed", "cancelled"}, timeout=240)
                assert job["status"] == end, job
            kept = {i for i, end in accepted.items() if end != "gone"}
            assert set(listed) == kept  # none lost, none extra
            assert c.post("/v1/videos/sync", data={"prompt": "after", "num_inference_steps": "2"}).status_code == 200
    tracebacks = [r.getMessage() for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert not tracebacks, tracebacks
    assert sum("disconnected" in r.getMessage() for r in caplog.records) >= MIXED_CLIENTS
