"""What open event streams cost a render: one tiny-model async render with no event streams, then the same render with
`--streams` streams on its job (`--stuck` of them never reading, with small receive buffers), each timed by the
server (the record's `inference_time_s`) and by the client (submit to completed), with `/health`'s latency sampled
all along (median and 90th percentile).

The server runs in a child process (the tiny engine, uvicorn on a free loopback port, as `h3serve serve` runs it), so
that the client's sockets do not share its interpreter; the readers are read by one selector thread. Streams past the
server's bound (`service.events.MAX_STREAMS`) are answered 429; the counts of open and refused streams are reported.

A CPU measurement of the service's overhead, not of the model: the tiny model's forwards are milliseconds, so the
events per second are far more than a real render makes, which is what makes the streams' cost visible.

    PYTHONPATH=src python bench/event_streams.py --out bench/results/event_streams.json [--steps 1000]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import selectors
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

MEDIANS = ("render_s", "submit_to_done_s", "health_median_s", "health_p90_s")
PROMPT = "a lighthouse at dusk, waves on the rocks"
CANVAS = {"width": 224, "height": 128}  # the tiny model's (the released default is above its area cap)


def serve(output_dir: Path) -> None:
    """The child: the tiny engine's app on a free port; prints the port, then serves until killed."""
    import uvicorn

    from h3serve.accel.profile import Profile
    from h3serve.pipeline.engine import Engine
    from h3serve.service.app import create_app
    from h3serve.service.http import head_deadline_protocol
    from h3serve.settings import Settings

    settings = Settings(output_dir=output_dir)
    app = create_app(settings, Engine.load(None, Profile()))
    sock = socket.socket()
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind(("127.0.0.1", 0))
    print(sock.getsockname()[1], flush=True)
    config = uvicorn.Config(app, log_level="warning", http=head_deadline_protocol(settings.body_timeout))
    uvicorn.Server(config).run(sockets=[sock])


def open_stream(port: int, job_id: str, rcvbuf: int | None) -> tuple[socket.socket, int]:
    """A GET of the job's events; the socket and the status of its answer."""
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(60)
    sock.connect(("127.0.0.1", port))
    sock.sendall(f"GET /v1/videos/{job_id}/events HTTP/1.1\r\nHost: bench\r\n\r\n".encode())
    head = b""
    while b"\r\n" not in head:
        head += sock.recv(256 if rcvbuf is None else 1)  # a stuck reader takes no more than its status line
    return sock, int(head.split()[1])


def drain(socks: list[socket.socket], stop: threading.Event) -> None:
    """Read every reader's stream as it comes, until each has ended or `stop`."""
    sel = selectors.DefaultSelector()
    for s in socks:
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ)
    while sel.get_map() and not stop.is_set():
        for key, _ in sel.select(timeout=0.5):
            try:
                data = key.fileobj.recv(65536)
            except BlockingIOError:
                continue
            if not data or data.endswith(b"0\r\n\r\n"):  # the chunked body's end
                sel.unregister(key.fileobj)


def one_render(c: httpx.Client, port: int, steps: int, streams: int, stuck: int) -> dict:
    answer = c.post("/v1/videos", json={"prompt": PROMPT, **CANVAS, "num_inference_steps": steps, "seed": 7})
    answer.raise_for_status()
    job_id, start = answer.json()["id"], time.perf_counter()
    opened: list[socket.socket] = []
    statuses: dict[int, int] = {}
    readers: list[socket.socket] = []
    for i in range(streams):
        never_reads = i < stuck  # the stuck ones first: each is sure of its place
        sock, status = open_stream(port, job_id, 4096 if never_reads else None)
        statuses[status] = statuses.get(status, 0) + 1
        opened.append(sock)
        if status == 200 and not never_reads:
            readers.append(sock)
    stop = threading.Event()
    reader = threading.Thread(target=drain, args=(readers, stop), daemon=True)
    reader.start()
    health = []
    while True:
        t = time.perf_counter()
        c.get("/health").raise_for_status()
        health.append(time.perf_counter() - t)
        record = c.get(f"/v1/videos/{job_id}").json()
        if record["status"] not in ("queued", "in_progress"):
            break
        time.sleep(0.1)
    wall = time.perf_counter() - start
    stop.set()
    reader.join(10)
    for sock in opened:
        sock.close()
    p90 = statistics.quantiles(health, n=10)[-1] if len(health) > 1 else health[0]  # a smoke run may sample once
    return {
        "status": record["status"],
        "streams_asked": streams,
        "streams_never_reading": stuck,
        "stream_answers": {str(k): v for k, v in sorted(statuses.items())},
        "render_s": record["inference_time_s"],
        "submit_to_done_s": round(wall, 2),
        "health_samples": len(health),
        "health_median_s": round(statistics.median(health), 4),
        "health_p90_s": round(p90, 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="the result JSON (default: print it)")
    parser.add_argument("--steps", type=int, default=1000, help="the render's num_inference_steps")
    parser.add_argument("--streams", type=int, default=300, help="event streams opened on the render's job")
    parser.add_argument("--stuck", type=int, default=50, help="of those, streams that never read")
    parser.add_argument("--repeats", type=int, default=3, help="pairs of renders, without and with streams, in turn "
                        "(a shared machine's load moves between runs; the medians are reported)")  # fmt: skip
    parser.add_argument("--serve", type=Path, help=argparse.SUPPRESS)  # the child: its output_dir
    args = parser.parse_args()
    if args.serve is not None:
        serve(args.serve)
        return
    with tempfile.TemporaryDirectory(prefix="h3-event-streams-") as tmp:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parents[1] / "src"),
                                                                           os.environ.get("PYTHONPATH")]))}  # fmt: skip
        child = subprocess.Popen([sys.executable, __file__, "--serve", tmp], stdout=subprocess.PIPE, env=env, text=True)
        try:
            port = int(child.stdout.readline())
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600) as c:
                deadline = time.monotonic() + 300
                while True:
                    try:
                        if c.get("/health").json()["ready"]:
                            break
                    except httpx.TransportError:
                        pass
                    if time.monotonic() > deadline or child.poll() is not None:
                        raise RuntimeError("the server did not become ready")
                    time.sleep(0.1)
                runs: dict[str, list[dict]] = {"no_streams": [], "with_streams": []}
                for _ in range(args.repeats):
                    runs["no_streams"].append(one_render(c, port, args.steps, 0, 0))
                    runs["with_streams"].append(one_render(c, port, args.steps, args.streams, args.stuck))
        finally:
            child.terminate()
            child.wait(30)
    result = {
        "date": datetime.date.today().isoformat(),
        "device": f"CPU only ({os.cpu_count()} cores, shared), tiny model: the service's overhead, not the model's",
        "python": platform.python_version(),
        "command": " ".join(sys.argv),
        "render": {**CANVAS, "num_inference_steps": args.steps},
        "runs": runs,
        "median": {
            name: {k: round(statistics.median(r[k] for r in rs), 4) for k in MEDIANS} for name, rs in runs.items()
        },
        "render_ratio_per_pair": [round(w["render_s"] / n["render_s"], 3) for n, w in zip(*runs.values(), strict=True)],
    }
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
