"""A job's events as server-sent events and its previews, through the real app on loopback with the tiny model:
the stream's order and content (queued, stages, progress, previews, the end), resumption with Last-Event-ID, a client
that never reads, renders with and without previews giving the same MP4 bytes, the refusals; and the bounded log
(`service.events`) on its own."""

from __future__ import annotations

import io
import json
import socket

import pytest
from PIL import Image

from h3serve.service.events import TERMINAL, JobEvents
from service_fixtures import live_server, settings, wait_status

PROMPT = "a lighthouse at dusk, waves on the rocks"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with live_server(settings(tmp_path_factory.mktemp("out"), preview_min_every=1)) as server:
        yield server


def read_events(client, job_id: str, last: int | None = None) -> list[tuple[int, str, dict]]:
    headers = {"Last-Event-ID": str(last)} if last is not None else {}
    out, current = [], {}
    with client.stream("GET", f"/v1/videos/{job_id}/events", headers=headers) as stream:
        assert stream.status_code == 200 and stream.headers["content-type"].startswith("text/event-stream")
        for line in stream.iter_lines():
            if not line:
                if current:
                    out.append((int(current["id"]), current["event"], json.loads(current["data"])))
                current = {}
                continue
            if line.startswith(":"):
                continue
            key, _, value = line.partition(": ")
            current[key] = value
    return out


def submit(client, **fields) -> str:
    answer = client.post("/v1/videos", json={"prompt": PROMPT, "num_inference_steps": 8, "seed": 3, **fields})
    assert answer.status_code == 200, answer.text
    return answer.json()["id"]


def test_the_stream_tells_a_job_from_queued_to_completed_with_its_previews(server):
    with server.client() as client:
        job_id = submit(client, preview_every=2)
        events = read_events(client, job_id)
        ids = [i for i, _, _ in events]
        assert ids == sorted(ids) and len(set(ids)) == len(ids)
        names = [name for _, name, _ in events]
        assert names[0] == "queued" and names[-1] == "completed"
        # the audio before the video: the frames stream into the MP4 as they are decoded, the audio muxed beside them
        assert [d["stage"] for _, n, d in events if n == "stage"] == ["text", "keyframes", "layout", "tables",
                                                                      "denoise", "audio", "video"]  # fmt: skip
        percents = [d["progress"] for _, n, d in events if n in ("stage", "progress")]
        assert percents == sorted(percents) and percents[-1] <= 100  # never backwards, whatever the stages' order
        denoise = [d["done"] for _, n, d in events if n == "progress" and d["stage"] == "denoise"]
        assert denoise == list(range(1, 8))  # 8 grid points: 7 forwards, each reported
        previews = [(i, d) for i, n, d in events if n == "preview"]
        assert [d["forward"] for _, d in previews] == [1, 3, 5] and all(d["forwards"] == 7 for _, d in previews)
        for i, d in previews:  # each after its forward's progress, before the next forward's
            progress_of = {e[2]["done"]: e[0] for e in events if e[1] == "progress" and e[2]["stage"] == "denoise"}
            assert progress_of[d["forward"]] < i < progress_of[d["forward"] + 1]
        png = client.get(previews[-1][1]["url"])
        assert png.status_code == 200 and png.headers["content-type"] == "image/png"
        assert Image.open(io.BytesIO(png.content)).size == (previews[-1][1]["width"], previews[-1][1]["height"])
        assert events[-1][2]["url"] == f"/v1/videos/{job_id}/content"
        assert client.get(f"/v1/videos/{job_id}").json()["preview_every"] == 2


def test_last_event_id_resumes_after_the_event_it_names(server):
    with server.client() as client:
        job_id = submit(client, preview_every=3)
        whole = read_events(client, job_id)
        middle = whole[len(whole) // 2][0]
        assert read_events(client, job_id, last=middle) == [e for e in whole if e[0] > middle]
        assert read_events(client, job_id, last=whole[-1][0]) == []
        bad = client.get(f"/v1/videos/{job_id}/events", headers={"Last-Event-ID": "seven"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "Last-Event-ID"


def test_a_client_that_never_reads_costs_the_render_nothing(server):
    """A stream asked for and never read: the render still runs to its end while the connection stays open (the
    render only appends to the job's log), and every event it made is there for a reader that comes later."""
    with server.client() as client:
        job_id = submit(client, preview_every=1)
        with socket.create_connection(("127.0.0.1", server.port)) as stuck:  # asks, then never reads a byte
            stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            stuck.sendall(f"GET /v1/videos/{job_id}/events HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            job = wait_status(client, job_id, {"completed", "failed", "cancelled"}, timeout=120)
            assert job["status"] == "completed"  # reached while the stuck stream is still open
            events = read_events(client, job_id)
        assert [n for _, n, _ in events].count("preview") == 6 and events[-1][1] == "completed"


def test_previews_leave_the_video_the_same_bytes(server):
    with server.client() as client:
        plain, shown = submit(client), submit(client, preview_every=2)
        for job_id in (plain, shown):
            wait_status(client, job_id, {"completed"})
        a = client.get(f"/v1/videos/{plain}/content").content
        b = client.get(f"/v1/videos/{shown}/content").content
        assert a == b and len(a) > 1000
        missing = client.get(f"/v1/videos/{plain}/preview")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "no_preview"


def test_multipart_takes_preview_every_and_a_deleted_job_has_no_events_or_preview(server):
    with server.client() as client:
        answer = client.post("/v1/videos", data={"prompt": PROMPT, "num_inference_steps": "8", "preview_every": "3"})
        assert answer.status_code == 200, answer.text
        job_id = answer.json()["id"]
        assert answer.json()["preview_every"] == 3
        wait_status(client, job_id, {"completed"})
        assert client.get(f"/v1/videos/{job_id}/preview").status_code == 200
        assert client.delete(f"/v1/videos/{job_id}").status_code == 200
        assert client.get(f"/v1/videos/{job_id}/preview").status_code == 404
        assert client.get(f"/v1/videos/{job_id}/events").status_code == 404


@pytest.mark.parametrize(
    ("path", "fields", "param", "words"),
    [
        ("/v1/videos", {"preview_every": 7}, "preview_every", "or 1..6"),  # 8 points: 7 forwards
        ("/v1/videos", {"preview_every": "often"}, "preview_every", "must be an integer"),
        ("/v1/videos/sync", {"preview_every": 2}, "preview_every", "previews come with async jobs"),
    ],
)
def test_a_preview_interval_that_cannot_run_is_refused_naming_it(server, path, fields, param, words):
    with server.client() as client:
        answer = client.post(path, json={"prompt": PROMPT, "num_inference_steps": 8, **fields})
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["param"] == param and words in answer.json()["error"]["message"]


def test_the_servers_minimum_interval_is_enforced_and_its_default_applies(tmp_path):
    with live_server(settings(tmp_path, preview_every=3, preview_min_every=3)) as server, server.client() as client:
        low = client.post("/v1/videos", json={"prompt": PROMPT, "num_inference_steps": 8, "preview_every": 2})
        assert low.status_code == 400 and "H3_PREVIEW_MIN_EVERY" in low.json()["error"]["message"]
        job_id = submit(client)  # leaves it out: the server's default
        assert client.get(f"/v1/videos/{job_id}").json()["preview_every"] == 3
        assert [d["forward"] for _, n, d in read_events(client, job_id) if n == "preview"] == [1, 4]
        few = client.post("/v1/videos", json={"prompt": PROMPT, "num_inference_steps": 3})  # 2 forwards: no room
        assert few.status_code == 200 and few.json()["preview_every"] == 0


def test_the_settings_refuse_a_default_below_the_minimum():
    from h3serve.settings import SettingsError, load_settings

    with pytest.raises(SettingsError) as err:
        load_settings(env={"H3_PREVIEW_EVERY": "2", "H3_PREVIEW_MIN_EVERY": "5"}, check_profile=False)
    assert "H3_PREVIEW_EVERY" in str(err.value)


# ---- the log on its own ---------------------------------------------------------------------------------------------
def test_the_log_drops_the_oldest_progress_first_and_never_the_end():
    log = JobEvents(limit=8)
    log.publish("queued", {})
    log.publish("preview", {"forward": 1})
    for done in range(1, 1001):
        log.publish("progress", {"done": done})
    log.publish("completed", {})
    events, ended = log.since(0)
    assert ended and len(events) == 8 and log.dropped == 1002 + 1 - 8
    assert [e.name for e in events[:2]] == ["queued", "preview"] and events[-1].name == "completed"
    assert [e.data["done"] for e in events[2:-1]] == list(range(996, 1001))  # the newest progress
    for _ in range(20):  # nothing but non-progress: the oldest of those goes, the end stays
        log.publish("preview", {})
    events, _ = log.since(0)
    assert len(events) == 8 and any(e.name in TERMINAL for e in events)
