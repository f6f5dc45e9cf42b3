"""The service under races, broken folders, a full disk and slow or oversized clients (issue 43, builds 1, 4, 5, 6):
the real app on loopback with the tiny model, real files, real sockets; a server under a file-size limit runs in a
subprocess (the limit is per process)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from h3serve.errors import SettingError
from h3serve.media.mp4 import verify_mp4, write_mp4
from h3serve.pipeline.context import RenderCancelled, RenderContext
from h3serve.service.folders import check_output_dir
from service_fixtures import FormClient, live_server, settings, wait_status

SMALL = {"prompt": "a red ball", "width": "224", "height": "128", "num_inference_steps": "2", "seed": "1"}
LONG = {**SMALL, "num_frames": "90"}  # an MP4 of about 1.5 MB on the tiny model; SMALL's is about 0.4 MB
TESTS = Path(__file__).parent
SRC = TESTS.parent / "src"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with live_server(settings(tmp_path_factory.mktemp("races"), body_timeout=2)) as s:
        yield s


@pytest.fixture
def client(server):
    with server.client() as c:
        yield c


def completed_jobs(client, n: int) -> list[dict]:
    ids = [client.post("/v1/videos", data={**SMALL, "seed": str(i)}).json()["id"] for i in range(n)]
    return [wait_status(client, i, {"completed"}) for i in ids]


def videos_of(server) -> Path:
    return Path(server.app.state.settings.output_dir) / "videos"


# ---- build 1: downloads that cannot race a DELETE --------------------------------------------------------------------
def test_downloads_racing_deletes_are_whole_or_refused_never_short_or_5xx(server, client):
    jobs = completed_jobs(client, 5)
    expected = {j["id"]: (videos_of(server) / j["file_name"]).read_bytes() for j in jobs}
    downloads_per_job = 7  # 35 downloads racing 5 DELETEs
    start = threading.Barrier(len(jobs) * (downloads_per_job + 1))
    results: list[tuple[str, int, int | None, bytes]] = []
    deletes: list[int] = []
    lock = threading.Lock()

    def download(job_id: str, nth: int) -> None:
        with server.client() as c:
            start.wait()
            time.sleep(0.002 * nth)  # spread over the DELETE: some before it, some during, some after
            try:
                with c.stream("GET", f"/v1/videos/{job_id}/content") as r:
                    length = r.headers.get("content-length")
                    status, body = r.status_code, r.read()
            except httpx.RemoteProtocolError:  # the connection closed before the Content-Length was sent
                status, body = -1, b""
            with lock:
                results.append((job_id, status, None if length is None else int(length), body))

    def delete(job_id: str) -> None:
        with server.client() as c:
            start.wait()
            time.sleep(0.006)
            status = c.delete(f"/v1/videos/{job_id}").status_code
            with lock:
                deletes.append(status)

    threads = [threading.Thread(target=delete, args=(j["id"],)) for j in jobs]
    threads += [threading.Thread(target=download, args=(j["id"], n)) for j in jobs for n in range(downloads_per_job)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert deletes == [200] * len(jobs)
    assert len(results) == len(jobs) * downloads_per_job
    statuses = sorted({status for _, status, _, _ in results})
    assert set(statuses) <= {200, 404, 410}, statuses  # -1: a short body
    for job_id, status, length, body in results:
        if status == 200:
            assert length == len(body) == len(expected[job_id])
            assert body == expected[job_id]
        else:
            assert json.loads(body)["error"]["code"] in ("not_found", "gone")
    for j in jobs:  # every one deleted: record and file
        assert client.get(f"/v1/videos/{j['id']}").status_code == 404
        assert not (videos_of(server) / j["file_name"]).exists()


def test_a_download_already_answered_survives_a_delete_of_its_job(server, client):
    (job,) = completed_jobs(client, 1)
    expected = (videos_of(server) / job["file_name"]).read_bytes()
    with server.client() as downloader, downloader.stream("GET", f"/v1/videos/{job['id']}/content") as r:
        assert r.status_code == 200 and int(r.headers["content-length"]) == len(expected)
        assert r.headers["content-type"] == "video/mp4"
        assert client.delete(f"/v1/videos/{job['id']}").status_code == 200
        assert not (videos_of(server) / job["file_name"]).exists()
        assert r.read() == expected


def test_a_job_whose_mp4_is_gone_is_a_410_and_a_deleted_one_a_404(server, client):
    gone, deleted = completed_jobs(client, 2)
    (videos_of(server) / gone["file_name"]).unlink()
    answer = client.get(f"/v1/videos/{gone['id']}/content")
    assert answer.status_code == 410 and answer.json()["error"]["code"] == "gone"
    assert client.delete(f"/v1/videos/{deleted['id']}").status_code == 200
    answer = client.get(f"/v1/videos/{deleted['id']}/content")
    assert answer.status_code == 404 and answer.json()["error"]["code"] == "not_found"
    assert client.delete(f"/v1/videos/{gone['id']}").status_code == 200


# ---- build 6: DELETE of an unfinished job answers once it has stopped ------------------------------------------------
def test_delete_during_the_encode_stops_it_and_answers_cancelled(server, client):
    job = client.post("/v1/videos", data=LONG).json()
    deadline = time.monotonic() + 120
    while (live := client.get(f"/v1/videos/{job['id']}").json()["live"]) is None or live["stage"] != "encode":
        assert live is not None, "the job finished before its encode was seen"
        assert time.monotonic() < deadline
        time.sleep(0.01)
    answer = client.delete(f"/v1/videos/{job['id']}")
    assert answer.status_code == 200, answer.text
    record = answer.json()
    assert record["status"] == "cancelled" and record["live"] is None
    assert record["error"]["code"] == "cancelled" and record["file_name"] is None
    left = sorted(p.name for p in videos_of(server).iterdir() if job["id"] in p.name)
    assert left == [f"{job['id']}.json"]  # no MP4, no temporary file: only the finished job's record (the sidecar)
    assert json.loads((videos_of(server) / left[0]).read_text())["status"] == "cancelled"


def test_the_encode_stops_between_frames_when_cancelled_and_leaves_no_file(tmp_path):
    frames = np.random.default_rng(0).integers(0, 256, (40, 64, 64, 3), dtype=np.uint8)
    audio = np.zeros((2, 40 * 32000 // 24), dtype=np.float32)
    ctx, calls = RenderContext(), []

    def check() -> None:
        calls.append(1)
        if len(calls) == 10:
            ctx.cancel("stop here")
        ctx.check()

    with pytest.raises(RenderCancelled, match="stop here"):
        write_mp4(tmp_path / "a.mp4", frames, audio, check=check)
    assert len(calls) == 10  # it stopped at once, not after the remaining frames
    assert list(tmp_path.iterdir()) == []


# ---- build 6: echoes capped, HEAD /, a deadline for the request head -------------------------------------------------
def assert_capped(answer: httpx.Response, status: int, param_starts: str) -> None:
    assert answer.status_code == status, answer.text[:300]
    assert len(answer.content) < 1500, len(answer.content)
    error = answer.json()["error"]
    assert error["param"].startswith(param_starts) and len(error["param"]) <= 120
    assert "x" * 81 not in answer.text  # at most 80 characters of the value


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "p", "lora": {"name": "x" * 900_000}}, "lora"),
        ({"prompt": "p", "lora": {"x" * 100_000: "a"}}, "lora."),
        ({"prompt": "p", "extra_params": {"x" * 500_000: 1}}, "extra_params."),
        ({"prompt": "p", "x" * 500_000: 1}, "xxx"),
        ({"prompt": "p", "extra_params": {"task": "t2va", "frame_indices": [0] * 50_000}}, "extra_params.frame"),
    ],
)
def test_echoed_values_are_capped_at_80_characters(client, body, param):
    assert_capped(client.post("/v1/videos", json=body), 400, param)


def test_echoed_part_and_query_names_are_capped(server, client):
    name = "x" * 3_000  # a longer part header is refused whole by the multipart parser
    files = [("input_reference", ("a.png", b"x"))]
    body = [("prompt", (None, "p")), (name, (None, "a"))]
    assert_capped(client.post("/v1/videos", files=body + files), 400, "xxx")  # an unknown part name
    assert_capped(client.post("/v1/videos", files=[("prompt", (None, "p")), (name, ("a.png", b"x"))]), 400, "xxx")
    assert_capped(client.get("/v1/videos", params={"x" * 20_000: "1"}), 400, "xxx")


def test_head_of_the_page_answers_like_get_without_a_body(client):
    get, head = client.get("/"), client.head("/")
    assert head.status_code == 200 == get.status_code
    assert head.headers["content-type"] == get.headers["content-type"] and head.content == b""


def test_a_client_sending_its_head_a_line_a_second_is_cut_off(server):
    # body_timeout=2: the head must be complete within 2 s. The client would take 30 s (60 lines); the outcome checked
    # is that the server closed the connection before the head was complete, whenever that was.
    sent = 0
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        try:
            for sent in range(1, 61):
                time.sleep(0.5)
                sock.sendall(f"X-Slow-{sent}: y\r\n".encode())
        except (BrokenPipeError, ConnectionResetError):
            pass
        else:
            sock.settimeout(5)
            with pytest.raises(TimeoutError):  # still open after 30 s: fails the assertion below
                sock.recv(1)
    assert sent < 60


def test_a_kept_alive_connection_still_serves_its_next_request(server):
    with server.client() as c:  # one connection, requests further apart than nothing: the deadline is per head
        for _ in range(3):
            assert c.get("/health").status_code == 200


# ---- build 4: readiness covers the folders the service writes ------------------------------------------------------
def test_a_videos_folder_replaced_by_a_file_makes_the_server_unready_and_a_render_fail_clearly(server, client):
    """A file in place of videos/ refuses root too (chmod would not)."""
    videos = videos_of(server)
    away = videos.with_name("videos.away")
    first = client.post("/v1/videos", data=LONG).json()  # keeps the GPU worker busy
    second = client.post("/v1/videos", data=SMALL).json()
    videos.rename(away)
    try:
        videos.write_bytes(b"not a folder")
        queued = client.get(f"/v1/videos/{second['id']}").json()["status"] == "queued"
        ready = client.get("/ready")
        assert ready.status_code == 503 and "videos folder" in ready.json()["problem"], ready.text
        health = client.get("/health").json()
        assert health["ready"] is False and list(health["unwritable_folders"]) == ["videos"]
        refused = client.post("/v1/videos", data=SMALL)
        assert refused.status_code == 503 and "videos folder" in refused.json()["error"]["message"]
        for job in (first, second):
            job = wait_status(client, job["id"], {"completed", "failed"}, timeout=120)
            if job["id"] == second["id"] and queued:  # rendered after the swap: its MP4 could not be written
                assert job["status"] == "failed"
            if job["status"] == "failed":
                assert job["error"]["code"] == "write_failed" and job["file_name"] is None
                assert "could not be written" in job["error"]["message"]
        assert queued, "the second job had left the queue before the folder was replaced: nothing was shown"
    finally:
        videos.unlink(missing_ok=True)
        away.rename(videos)
    assert client.get("/ready").status_code == 200
    assert client.get("/health").json()["unwritable_folders"] == {}
    for job in client.get("/v1/videos", params={"limit": 100}).json()["data"]:  # no record names a missing MP4
        assert job["status"] != "completed" or (videos / job["file_name"]).is_file()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only folder anyway")
def test_a_read_only_videos_folder_makes_the_server_unready(server, client):
    videos = videos_of(server)
    videos.chmod(0o555)
    try:
        ready = client.get("/ready")
        assert ready.status_code == 503 and "videos folder" in ready.json()["problem"]
    finally:
        videos.chmod(0o755)
    assert client.get("/ready").status_code == 200


def test_the_start_refuses_an_output_folder_whose_videos_folder_cannot_be_written(tmp_path):
    (tmp_path / "videos").write_bytes(b"not a folder")
    with pytest.raises(SettingError) as err:
        check_output_dir(tmp_path)
    assert err.value.setting == "output_dir" and "videos" in str(err.value)


# ---- build 5: a full disk (a file-size limit on a server in a subprocess) -------------------------------------------
LIMIT = 1 << 20  # over SMALL's MP4 and the job store's files, under LONG's MP4
SERVE = """
import resource, socket, sys
from pathlib import Path
resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))  # hard too: the server cannot raise it
import uvicorn
from h3serve.service.app import create_app
from h3serve.service.http import head_deadline_protocol
from service_fixtures import settings, tiny_engine
app = create_app(settings(Path(sys.argv[2])), tiny_engine())
config = uvicorn.Config(app, log_level="warning", http=head_deadline_protocol(120))
uvicorn.Server(config).run(sockets=[socket.socket(fileno=int(sys.argv[1]))])
"""


def limited_server(output: Path, sock: socket.socket) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), str(TESTS)])}
    return subprocess.Popen(
        [sys.executable, "-c", SERVE.format(limit=LIMIT), str(sock.fileno()), str(output)],
        pass_fds=(sock.fileno(),),
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def test_a_render_over_the_disk_limit_fails_clearly_and_loses_nothing(tmp_path):
    output = tmp_path / "out"
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    process = limited_server(output, sock)
    sock.close()  # the child holds its own copy
    try:
        with httpx.Client(base_url=url, timeout=120) as c:
            deadline = time.monotonic() + 120
            while True:
                assert process.poll() is None, process.stderr.read().decode()[-2000:]
                try:
                    if c.get("/health").json()["ready"]:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline
                time.sleep(0.1)
            c = FormClient(base_url=url, timeout=120)
            before = wait_status(c, c.post("/v1/videos", data=SMALL).json()["id"], {"completed"})
            kept = c.get(f"/v1/videos/{before['id']}/content").content
            big = wait_status(c, c.post("/v1/videos", data=LONG).json()["id"], {"completed", "failed"})
            assert big["status"] == "failed", big
            assert big["error"]["code"] == "write_failed" and big["file_name"] is None
            assert "File too large" in big["error"]["message"]
            # No partial file: the earlier MP4, and the two finished jobs' records (sidecars), the failed one's too.
            names = sorted(p.name for p in (output / "videos").iterdir())
            assert names == sorted([before["file_name"], f"{before['id']}.json", f"{big['id']}.json"]), names
            sync = c.post("/v1/videos/sync", data=LONG)  # encoded in the temporary folder: refused the same way
            assert sync.status_code == 500 and sync.json()["error"]["code"] == "write_failed", sync.text
            after = wait_status(c, c.post("/v1/videos", data=SMALL).json()["id"], {"completed"})
            assert c.get(f"/v1/videos/{before['id']}/content").content == kept
            c.close()
    finally:
        process.terminate()
        process.wait(30)
    # Space freed (a server without the limit on the same folder): every earlier job intact, the big render renders.
    with live_server(settings(output)) as s, s.client() as c:
        assert c.get(f"/v1/videos/{before['id']}/content").content == kept
        assert c.get(f"/v1/videos/{after['id']}/content").status_code == 200
        assert c.get(f"/v1/videos/{big['id']}").json()["status"] == "failed"
        again = wait_status(c, c.post("/v1/videos", data=LONG).json()["id"], {"completed", "failed"})
        assert again["status"] == "completed", again
        verify_mp4(output / "videos" / again["file_name"], width=224, height=128, num_frames=again["num_frames"])
