"""The service against hostile clients, fourth round (issue 54): event streams, previews and routes. Each finding as a
test that fails on the code before the fix; the real app on loopback with the tiny model, raw sockets where a client
must send what httpx will not (header bytes that are not UTF-8) or hold a stream without reading it.

Nothing here times a request: the event streams' cost is asserted through what the app exposes (`Streams.open`, the
wake-ups the loop ran), and every wait is bounded by what it polls."""

from __future__ import annotations

import json
import socket

import pytest

from h3serve.service import events as service_events
from h3serve.service.schemas import JobStatus
from h3serve.service.store import new_job_id
from service_fixtures import live_server, settings, until, wait_status

PROMPT = "a lighthouse at dusk, waves on the rocks"
SMALL = {"prompt": PROMPT, "num_inference_steps": 2, "seed": 1}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with live_server(settings(tmp_path_factory.mktemp("hostile4"))) as s:
        yield s


@pytest.fixture
def client(server):
    with server.client() as c:
        yield c


@pytest.fixture(scope="module")
def finished(server) -> dict:
    """One completed job's record, the model for the held jobs below."""
    with server.client() as c:
        answer = c.post("/v1/videos", json=SMALL)
        assert answer.status_code == 200, answer.text
        return wait_status(c, answer.json()["id"], {"completed"})


def held_job(server, finished: dict) -> str:
    """A queued job that no render will ever take: its record in the store and its `queued` event, so that its event
    streams stay open until the test publishes its end (`end_held`)."""
    store, job_id = server.app.state.store, new_job_id()
    record = store.get(finished["id"]).model_copy(
        update={"id": job_id, "status": JobStatus.QUEUED, "progress": 0, "file_name": None, "completed_at": None}
    )
    store.insert(record)
    server.scheduler.events.publish(job_id, "queued", {"ahead": 0})
    return job_id


def end_held(server, job_id: str) -> None:
    server.scheduler.events.publish(job_id, "cancelled", {"status": "cancelled"})
    server.app.state.store.update(job_id, status=JobStatus.CANCELLED)


def error_of(response, status: int, param: str | None) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    return error["message"]


# ---- raw sockets ----------------------------------------------------------------------------------------------------
def open_stream(port: int, job_id: str, extra: bytes = b"", rcvbuf: int | None = None) -> tuple[socket.socket, bytes]:
    """GET the job's events over a socket; returns it once the response head is in, with what came so far."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(60)
    sock.connect(("127.0.0.1", port))
    sock.sendall(f"GET /v1/videos/{job_id}/events HTTP/1.1\r\nHost: x\r\n".encode() + extra + b"\r\n")
    seen = b""
    while b"\r\n\r\n" not in seen:
        chunk = sock.recv(65536)
        assert chunk, seen
        seen += chunk
    return sock, seen


def read_until(sock: socket.socket, seen: bytes, marker: bytes) -> bytes:
    while marker not in seen:
        chunk = sock.recv(65536)
        assert chunk, seen[-500:]
        seen += chunk
    return seen


def raw_answer(port: int, request: bytes) -> tuple[int, dict]:
    """One request with `Connection: close`: the status and the JSON body."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(request)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


# ---- 7: Last-Event-ID ----------------------------------------------------------------------------------------------
def test_a_last_event_id_of_5000_digits_is_a_400_naming_it(client, finished):
    """Before: int() past Python's 4,300-digit limit raised, a 500 with a traceback in the log per request."""
    answer = client.get(f"/v1/videos/{finished['id']}/events", headers={"Last-Event-ID": "7" * 5000})
    message = error_of(answer, 400, "Last-Event-ID")
    assert "20 ASCII digits" in message and len(message) < 300


@pytest.mark.parametrize(
    "value", [b"\xb2", b"1\xb9", b"\xff\xfe", "\u00b2".encode()], ids=["b2", "1b9", "fffe", "utf8-sup2"]
)
def test_a_last_event_id_of_bytes_that_are_not_ascii_digits_is_a_400(server, finished, value):
    """Before: a latin-1 byte such as 0xB2 (read as '²', which str.isdigit takes) passed the check and int() raised."""
    request = (
        f"GET /v1/videos/{finished['id']}/events HTTP/1.1\r\nHost: x\r\nConnection: close\r\n".encode()
        + b"Last-Event-ID: "
        + value
        + b"\r\n\r\n"
    )
    status, body = raw_answer(server.port, request)
    assert status == 400 and body["error"]["param"] == "Last-Event-ID", body
    assert "ASCII digits" in body["error"]["message"]


# ---- 8: a preview stays until its job is deleted --------------------------------------------------------------------
def test_a_preview_outlives_256_later_jobs_and_a_restart_and_goes_with_its_job(tmp_path):
    """Before: the preview went with the job's log once 256 later jobs had finished (events.KEEP), and with any
    restart, though the docs said it stays until the job is deleted."""
    s = settings(tmp_path)
    with live_server(s) as server, server.client() as c:
        answer = c.post("/v1/videos", json={**SMALL, "num_inference_steps": 12, "preview_every": 5})
        assert answer.status_code == 200, answer.text
        job_id = answer.json()["id"]
        wait_status(c, job_id, {"completed"})
        png = c.get(f"/v1/videos/{job_id}/preview")
        assert png.status_code == 200 and png.content.startswith(b"\x89PNG")
        for i in range(server.scheduler.events.keep + 1):  # what each later job's end does to the logs kept
            server.scheduler.events.publish(f"later_{i}", "completed", {"status": "completed"})
        assert server.scheduler.events.log(job_id) is None  # its log has gone, as documented
        later = c.get(f"/v1/videos/{job_id}/preview")
        assert later.status_code == 200 and later.content == png.content
    with live_server(s) as server, server.client() as c:  # a restart on the same folder
        again = c.get(f"/v1/videos/{job_id}/preview")
        assert again.status_code == 200 and again.content == png.content
        assert c.delete(f"/v1/videos/{job_id}").status_code == 200
        assert error_of(c.get(f"/v1/videos/{job_id}/preview"), 404, "video_id")
        assert not list((tmp_path / "previews").glob(f"{job_id}*"))


# ---- warts: preview_every's range, methods and paths ----------------------------------------------------------------
def test_a_preview_interval_past_the_forwards_offers_the_servers_range(client):
    """Before: 'must be 0 (none) or 1..10' on a server whose least interval is 5 (H3_PREVIEW_MIN_EVERY)."""
    answer = client.post("/v1/videos", json={"prompt": PROMPT, "num_inference_steps": 12, "preview_every": 20})
    message = error_of(answer, 400, "preview_every")
    assert "0 (none) or 5..10" in message and "1..10" not in message
    few = client.post("/v1/videos", json={"prompt": PROMPT, "num_inference_steps": 6, "preview_every": 5})
    message = error_of(few, 400, "preview_every")  # 4 forwards before the last: none can hold an interval of 5
    assert "H3_PREVIEW_MIN_EVERY" in message and "1..4" not in message


@pytest.mark.parametrize("method", ["GET", "DELETE", "PUT"])
def test_the_sync_path_with_another_method_is_a_405_naming_post(client, method):
    """Before: GET and DELETE /v1/videos/sync were taken as the job 'sync' (404 'no video job sync')."""
    answer = client.request(method, "/v1/videos/sync")
    message = error_of(answer, 405, None)
    assert answer.headers["allow"] == "POST" and "POST" in message and method in message
    assert answer.json()["error"]["code"] == "method_not_allowed"


@pytest.mark.parametrize(
    ("method", "path", "allowed"),
    [
        ("PUT", "/v1/videos", "GET, POST"),
        ("PATCH", "/v1/videos/video_gen_x", "DELETE, GET"),
        ("POST", "/health", "GET, HEAD"),
        ("POST", "/v1/videos/video_gen_x/events", "GET"),
    ],
)
def test_a_path_with_the_wrong_method_is_a_405_naming_every_method_it_takes(client, method, path, allowed):
    """Before: 'Method Not Allowed', with an Allow header naming only the first route registered at the path."""
    answer = client.request(method, path)
    message = error_of(answer, 405, None)
    assert answer.headers["allow"] == allowed and allowed in message


@pytest.mark.parametrize("method", ["POST", "GET"])
def test_a_trailing_slash_is_a_404_naming_the_path_not_an_empty_redirect(client, method):
    """Before: a 307 with an empty body to /v1/videos, which a POST's client rarely follows."""
    answer = client.request(method, "/v1/videos/", json={"prompt": PROMPT} if method == "POST" else None)
    message = error_of(answer, 404, None)
    assert "/v1/videos" in message and "trailing slash" in message
    assert "location" not in answer.headers
    assert "trailing slash" not in error_of(client.get("/v1/nothing"), 404, None)


# ---- warts: event streams are bounded and cost the render nothing ---------------------------------------------------
def test_event_streams_past_the_bound_are_a_429_naming_it(server, finished, client):
    """Before: no bound (300 streams slowed a render by 30%)."""
    streams = server.app.state.streams
    assert streams.limit == service_events.MAX_STREAMS and streams.open == 0
    job_id = held_job(server, finished)
    socks = []
    try:
        for _ in range(service_events.MAX_STREAMS):
            sock, head = open_stream(server.port, job_id)
            socks.append(sock)
            assert head.startswith(b"HTTP/1.1 200"), head
        assert streams.open == service_events.MAX_STREAMS
        refused = client.get(f"/v1/videos/{job_id}/events")
        message = error_of(refused, 429, None)
        assert str(service_events.MAX_STREAMS) in message and refused.json()["error"]["code"] == "too_many_streams"
        assert refused.headers["retry-after"]
        socks.pop().close()  # a client goes away: its place comes back
        until(lambda: streams.open == service_events.MAX_STREAMS - 1)
        sock, head = open_stream(server.port, job_id)
        socks.append(sock)
        assert head.startswith(b"HTTP/1.1 200"), head
    finally:
        end_held(server, job_id)
        for sock in socks:
            sock.close()
    until(lambda: streams.open == 0)


def test_a_publish_wakes_the_loop_once_however_many_streams_watch(server, finished, client):
    """The render thread's work per event is one hand-off to the loop whether 1 or 40 streams watch the job (10 of
    them never reading, with tiny receive buffers); no stream polls. Before: every stream polled its log 10 times a
    second, with the job's log lock, whether anything was new or not."""
    streams, events = server.app.state.streams, server.scheduler.events
    job_id = held_job(server, finished)
    filler = "x" * 2000  # events big enough that a reader that never reads fills its socket
    readers, stuck = [], []
    try:
        wakes_for = {}
        for count in (1, 30):
            readers += [open_stream(server.port, job_id) for _ in range(count - len(readers))]
            if count > 1:
                stuck += [open_stream(server.port, job_id, rcvbuf=4096)[0] for _ in range(10)]
            watching = len(readers) + len(stuck)
            until(lambda: streams.open == watching)  # noqa: B023 (called here, in this iteration)
            before = streams.wakes
            first = events.log(job_id).since(0)[0][-1].id + 1
            for i in range(200):
                events.publish(job_id, "progress", {"stage": "denoise", "done": i, "total": 200, "x": filler})
            last = f"id: {first + 199}\n".encode()
            readers = [(sock, read_until(sock, seen, last)) for sock, seen in readers]
            # A stream may take the events in one read before their wake-ups have run: wait for them, then a request
            # through the loop, which runs after every wake-up handed to it before.
            until(lambda: streams.wakes - before >= 200)  # noqa: B023 (called here, in this iteration)
            assert client.get("/health").status_code == 200
            wakes_for[len(readers) + len(stuck)] = streams.wakes - before
        assert wakes_for == {1: 200, 40: 200}
        assert (
            len(events.log(job_id).since(0)[0]) <= service_events.LIMIT
        )  # the never-reading streams hold nothing of their own
    finally:
        end_held(server, job_id)
        for sock, _ in readers:
            sock.close()
        for sock in stuck:
            sock.close()
    until(lambda: streams.open == 0)


@pytest.mark.parametrize("kind", ["link out of videos/", "fifo"])
def test_content_serves_no_link_or_fifo_put_where_a_jobs_mp4_was(server, finished, client, tmp_path, kind):
    """A completed job whose `videos/<id>.mp4` is a symbolic link to a file outside the folder, or a FIFO, by hand
    after the render: `/content` answers 410 at once, never the outside file's bytes, never a hang."""
    import os

    store, job_id = server.app.state.store, new_job_id()
    record = store.get(finished["id"]).model_copy(update={"id": job_id, "file_name": f"{job_id}.mp4"})
    store.insert(record)
    mp4 = store.path(store.get(job_id))
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"a file outside videos/")
    if kind == "fifo":
        os.mkfifo(mp4)
    else:
        mp4.symlink_to(victim)
    try:
        answer = client.get(f"/v1/videos/{job_id}/content")
        assert answer.status_code == 410, (answer.status_code, answer.content[:80])
        assert b"outside" not in answer.content
        assert answer.json()["error"]["param"] == "video_id"
    finally:
        mp4.unlink()
        store.delete(job_id)
