"""Several hosts as one group (`parallel.nodes`), on this machine: two "hosts" are two independent process trees, each
started by its own command (`h3serve serve` on node 0, `h3serve serve --node-rank 1` on node 1, each in a session of
its own), each loading its own copy of the tiny checkpoint folder, meeting over loopback with gloo. Their renders are
bit for bit the one-process render (frames, audio and MP4 bytes: the sync and async routes, and `render`); node 1
killed mid-render fails that render naming it, /health turns not ready, a job queued behind it waits, and once node 1
is started again the job completes with the one-process bytes; the refusals (a wrong key, no key, another model, a
second node 1, a node that never comes, node 0 never answering) are said on both sides; nothing listens beyond the
given address. Nothing is mocked: the processes run the real commands."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
import torch

from e2e_fixtures import write_tiny_checkpoint
from h3serve.accel.profile import Profile
from h3serve.parallel import nodes
from h3serve.pipeline.engine import Engine
from h3serve.vocab import TaskType
from service_fixtures import live_server, png_bytes, settings, wait_status
from test_service_ref2va import wav_bytes

ROOT = Path(__file__).resolve().parents[1]
KEY = secrets.token_hex(20)
# The release's rules apply to a model folder: the tiny canvas and 22 frames are asked for.
SHAPE = {"width": "224", "height": "128"}
T2VA = {"prompt": "a lighthouse at dusk, waves below", "num_inference_steps": "4", "seed": "7", **SHAPE,
        "extra_params": json.dumps({"duration": 0.9})}  # fmt: skip
REF = {"prompt": "a red ball rolls past a ticking clock", "num_inference_steps": "3", "seed": "5", **SHAPE,
       "extra_params": json.dumps({"task": "ref2va", "duration": 0.9})}  # fmt: skip


def ref_files() -> list:
    return [("input_references", ("ref.png", png_bytes(96, 64, 3), "image/png")),
            ("input_references", ("ref.wav", wav_bytes(), "audio/wav"))]  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_free_ports(host: str = "127.0.0.1") -> int:
    """A port P with P and P+1 free on `host` (the rendezvous and the group's store)."""
    for _ in range(100):
        with socket.socket() as a:
            a.bind((host, 0))
            port = a.getsockname()[1]
            if port >= 65534:
                continue
            with socket.socket() as b:
                try:
                    b.bind((host, port + 1))
                except OSError:
                    continue
            return port
    raise AssertionError("no two consecutive free ports")


class Node:
    """One "host": a command run in a session of its own (an independent process tree), its output in a log."""

    def __init__(self, name: str, args: list[str], env: dict[str, str], log: Path):
        self.name, self.log_path = name, log
        self.out = log.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "h3serve.cli", *args],
            env=env,
            stdout=self.out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def tree(self) -> list[psutil.Process]:
        try:
            me = psutil.Process(self.proc.pid)
            return [me, *me.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def kill(self) -> None:
        """SIGKILL to the whole tree at once (its session's process group): the host is gone."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)
        self.out.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(30)
        self.kill()

    def wait(self, timeout: float = 120) -> int:
        """Its exit status (a bound on a broken start only)."""
        code = self.proc.wait(timeout)
        self.out.close()
        return code


class Hosts:
    """The environment of the two "hosts" and their commands."""

    def __init__(self, tmp: Path, release: Path, host: str = "127.0.0.1"):
        self.tmp, self.host, self.port = tmp, host, two_free_ports(host)
        self.folders = {n: shutil.copytree(release, tmp / f"node{n}" / "FL2VA") for n in (0, 1)}
        self.started: list[Node] = []
        self.node1: Node | None = None  # the pair's node 1, as (re)started

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def env(self, node: int, **values: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("H3_")}
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
        env["OMP_NUM_THREADS"] = "1"  # each rank at one thread, as the one-process reference (tests/test_parallel)
        base = {"H3_DEVICE": "cpu", "H3_NNODES": "2", "H3_DIST_INIT_ADDR": self.address, "H3_NODE_KEY": KEY,
                "H3_MODEL": str(self.folders[node]), "H3_TASK_TYPE": "both", "H3_NODE_TIMEOUT": "240",
                "H3_NODE_GRACE": "5"}  # fmt: skip
        env.update({k: v for k, v in base.items()})
        for name, value in values.items():
            if value is None:
                env.pop(name, None)
            else:
                env[name] = value
        return env

    def start(self, name: str, args: list[str], node: int, **values: str) -> Node:
        proc = Node(name, args, self.env(node, **values), self.tmp / f"{name}-{len(self.started)}.log")
        self.started.append(proc)
        return proc

    def serve0(self, api_port: int, **values: str) -> Node:
        args = ["serve", "--api-port", str(api_port), "--output-dir", str(self.tmp / "out0"), "--no-startup-warmup"]
        return self.start("node0", args, 0, **values)

    def serve1(self, *extra: str, **values: str) -> Node:
        return self.start("node1", ["serve", "--node-rank", "1", *extra], 1, **values)

    def close(self) -> None:
        for proc in self.started:
            proc.stop()


@pytest.fixture(scope="module")
def release(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("release") / "FL2VA", ref2va=True)


@pytest.fixture(scope="module")
def hosts(tmp_path_factory, release) -> Iterator[Hosts]:
    h = Hosts(tmp_path_factory.mktemp("hosts"), release)
    yield h
    h.close()


@pytest.fixture(scope="module")
def pair(hosts) -> Iterator[tuple[Node, str]]:
    """Node 0 serving, node 1 joined: two commands."""
    api = free_port()
    node0 = hosts.serve0(api)
    hosts.node1 = hosts.serve1()
    url = f"http://127.0.0.1:{api}"
    wait_ready(url, node0)
    yield node0, url


def wait_ready(url: str, node0: Node, timeout: float = 300) -> dict:
    """/health once ready (a bound on a broken start only: polled, not waited out)."""
    deadline = time.monotonic() + timeout
    while True:
        assert node0.proc.poll() is None, node0.log()[-3000:]
        try:
            health = httpx.get(f"{url}/health", timeout=5).json()
            if health["ready"]:
                return health
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, node0.log()[-3000:]
        time.sleep(0.2)


@pytest.fixture(scope="module")
def reference(release, tmp_path_factory) -> dict[str, bytes]:
    """The one-process server's bytes (this process, one thread, as each rank) for the requests the tests send."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    engine = Engine.load(release, Profile.for_device("cpu"), task_type=TaskType.BOTH)
    out = {}
    try:
        with live_server(settings(tmp_path_factory.mktemp("one")), engine) as one, one.client() as c:
            for name, data, files in (("t2va", T2VA, None), ("ref2va", REF, ref_files())):
                r = c.post("/v1/videos/sync", data=data, files=files)
                assert r.status_code == 200, r.text
                out[name] = r.content
    finally:
        torch.set_num_threads(threads)
    return out


def client(url: str) -> httpx.Client:
    from service_fixtures import FormClient

    return FormClient(base_url=url, timeout=300)


# ---- the renders --------------------------------------------------------------------------------------------------
def test_two_hosts_serve_the_one_process_bytes_sync_and_async_and_listen_only_on_the_given_address(
    hosts, pair, reference
):
    node0, url = pair
    with client(url) as c:
        health = c.get("/health").json()
        assert (health["ready"], health["num_gpus"], health["problem"]) == (True, 2, None)
        assert health["nodes"] == [{"node": 0, "ranks": [0, 0], "joined": True},
                                   {"node": 1, "ranks": [1, 1], "joined": True}]  # fmt: skip
        for name, data, files in (("t2va", T2VA, None), ("ref2va", REF, ref_files)):
            r = c.post("/v1/videos/sync", data=data, files=files() if files else None)
            assert r.status_code == 200, r.text
            assert r.headers["x-num-gpus"] == "2"
            assert r.content == reference[name], name  # the MP4 bytes: frames and audio alike
            job = c.post("/v1/videos", data=data, files=files() if files else None).json()
            done = wait_status(c, job["id"], {"completed", "failed"}, timeout=300)
            assert (done["status"], done["num_gpus"]) == ("completed", 2), done
            assert c.get(f"/v1/videos/{job['id']}/content").content == reference[name], name
    # Every listening socket of both trees (the service, the rendezvous, the store, each rank's gloo) is on the given
    # loopback address, and the rendezvous and the store are node 0's.
    listening = listeners(node0, hosts.node1)
    assert listening and {ip for ip, _ in listening} == {"127.0.0.1"}, listening
    assert listening[("127.0.0.1", hosts.port)] == node0.proc.pid
    assert listening[("127.0.0.1", hosts.port + 1)] == node0.proc.pid


def listeners(*trees: Node) -> dict[tuple[str, int], int]:
    """Every listening TCP socket of these process trees: (address, port) -> pid."""
    out = {}
    for tree in trees:
        for proc in tree.tree():
            for conn in proc.net_connections(kind="inet"):
                if conn.status == psutil.CONN_LISTEN:
                    out[(conn.laddr.ip, conn.laddr.port)] = proc.pid
    return out


def host_address() -> str | None:
    """This machine's first IPv4 address outside loopback, or None."""
    for addresses in psutil.net_if_addrs().values():
        for a in addresses:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return a.address
    return None


@pytest.mark.skipif(host_address() is None, reason="this machine has no IPv4 address outside loopback")
def test_on_an_address_outside_loopback_every_rank_and_the_rendezvous_listen_there_only(tmp_path, release, reference):
    """On loopback every listener is on 127.0.0.1 anyway; on the machine's own address the check tells: the
    rendezvous, the store and every rank's gloo listen on that address alone (none on every interface), the API on
    its loopback bind."""
    address = host_address()
    hosts = Hosts(tmp_path, release, host=address)
    try:
        api = free_port()
        node0 = hosts.serve0(api, H3_ALLOW_REMOTE_NODES="true")
        node1 = hosts.serve1(H3_ALLOW_REMOTE_NODES="true")
        url = f"http://127.0.0.1:{api}"
        wait_ready(url, node0)
        with client(url) as c:
            r = c.post("/v1/videos/sync", data=T2VA)
            assert r.status_code == 200 and r.content == reference["t2va"]
        listening = listeners(node0, node1)
        assert listening.pop(("127.0.0.1", api)) == node0.proc.pid
        assert listening and {ip for ip, _ in listening} == {address}, listening
        assert {(address, hosts.port), (address, hosts.port + 1)} <= set(listening)
        assert f"listens on {address}:{hosts.port}" in node0.log()
    finally:
        hosts.close()


def test_node_1_killed_mid_render_fails_it_naming_the_node_and_a_restarted_node_1_brings_the_bytes_back(
    hosts, pair, reference
):
    node0, url = pair
    with client(url) as c:
        long = c.post("/v1/videos", data={**T2VA, "num_inference_steps": "400"}).json()
        queued = c.post("/v1/videos", data=T2VA).json()  # waits behind it: never lost
        deadline = time.monotonic() + 120
        while c.get(f"/v1/videos/{long['id']}").json()["status"] != "in_progress":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        hosts.node1.kill()
        failed = wait_status(c, long["id"], {"completed", "failed"}, timeout=60)
        assert failed["status"] == "failed" and failed["error"]["code"] == "node_lost", failed
        assert "node 1 (rank 1) lost" in failed["error"]["message"], failed
        health = c.get("/health").json()
        assert health["ready"] is False and "node 1 (rank 1)" in health["problem"], health
        assert health["nodes"][1]["joined"] is False and "lost" in health["nodes"][1], health
        r = c.post("/v1/videos/sync", data=T2VA)
        assert r.status_code == 503 and "node 1 (rank 1)" in r.json()["error"]["message"], r.text
        assert c.get(f"/v1/videos/{queued['id']}").json()["status"] == "queued"
        hosts.node1 = hosts.serve1()  # the same command again, on the same "host"
        wait_ready(url, node0)
        done = wait_status(c, queued["id"], {"completed", "failed"}, timeout=300)
        assert done["status"] == "completed", done
        assert c.get(f"/v1/videos/{queued['id']}/content").content == reference["t2va"]
        again = c.post("/v1/videos/sync", data=T2VA)
        assert again.status_code == 200 and again.content == reference["t2va"]
    assert node0.proc.poll() is None  # node 0's service never restarted
    assert "node 1 (rank 1) lost" in node0.log()


def test_node_1_silent_mid_render_is_lost_after_the_grace_and_rejoins_by_itself_when_it_speaks_again(
    hosts, pair, reference
):
    """SIGSTOP to node 1's whole tree: its connection stays open but says nothing (a link that dropped)."""
    node0, url = pair
    node1 = hosts.node1
    with client(url) as c:
        long = c.post("/v1/videos", data={**T2VA, "num_inference_steps": "400"}).json()
        deadline = time.monotonic() + 120
        while c.get(f"/v1/videos/{long['id']}").json()["status"] != "in_progress":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        os.killpg(node1.proc.pid, signal.SIGSTOP)
        try:
            failed = wait_status(c, long["id"], {"completed", "failed"}, timeout=120)
            assert failed["status"] == "failed" and failed["error"]["code"] == "node_lost", failed
            message = failed["error"]["message"]
            assert "node 1 (rank 1) lost: no heartbeat for 5 s (H3_NODE_GRACE)" in message, message
            assert c.get("/health").json()["ready"] is False
        finally:
            os.killpg(node1.proc.pid, signal.SIGCONT)
        wait_ready(url, node0)  # the same node 1 process joined again by itself
        assert node1.proc.poll() is None and "joining again" in node1.log()
        again = c.post("/v1/videos/sync", data=T2VA)
        assert again.status_code == 200 and again.content == reference["t2va"]


# ---- the refusals, on both sides ----------------------------------------------------------------------------------
def refused(proc: Node) -> str:
    assert proc.wait() == 1, proc.log()[-2000:]
    return proc.log()


def test_a_wrong_key_another_model_and_a_second_node_1_are_refused_on_both_sides(hosts, pair):
    node0, url = pair
    wrong = refused(hosts.serve1(H3_NODE_KEY=secrets.token_hex(20)))
    assert f"node 0 at {hosts.address} does not hold this node's key (H3_NODE_KEY)" in wrong, wrong
    # The line names the setting at fault: the key, not the node's rank (H3_NODE_RANK, before 2026-12-07).
    assert "error: H3_NODE_KEY: refused: " in wrong and "H3_NODE_RANK" not in wrong, wrong
    other = hosts.folders[1].parent.parent / "other" / "FL2VA"
    if not other.exists():
        shutil.copytree(hosts.folders[1], other)
        config = other / "transformer" / "config.json"
        config.write_text(config.read_text() + "\n")  # the same weights, another release's config file
    model = refused(hosts.serve1(H3_MODEL=str(other)))
    assert "refused node 1: it runs something else: model (config and index digest)" in model, model
    assert "error: H3_MODEL (--model): refused: " in model, model
    second = refused(hosts.serve1())
    assert "node 1 has already joined" in second and "a second node 1 is refused" in second, second
    assert "error: H3_NODE_RANK (--node-rank): 1: refused: " in second, second
    log = node0.log()
    assert "node 1 refused node 0: the keys differ (H3_NODE_KEY)" in log
    assert "node 1: it runs something else: model (config and index digest)" in log
    assert "a second node 1 from 127.0.0.1" in log
    assert httpx.get(f"{url}/health").json()["ready"] is True  # the joined node 1 was not disturbed


def test_a_node_without_a_key_is_refused_by_its_settings_and_by_node_0(hosts, pair):
    node0, _ = pair
    alone = refused(hosts.serve1(H3_NODE_KEY=None))
    assert "H3_NODE_KEY: required with H3_NNODES=2" in alone, alone
    # A client that speaks the protocol but proves no key, or a guessed one: refused in words, and node 0 says so.
    for answer, said in (({"identity": {}}, "it proved no key"), ({"proof": "00" * 32}, "its key is not node 0's")):
        with socket.create_connection(("127.0.0.1", hosts.port), timeout=10) as sock:
            nodes.send(sock, {"protocol": nodes.PROTOCOL, "node": 1, "nonce": secrets.token_hex(32)})
            challenge = nodes.receive(sock)
            assert set(challenge) == {"nonce", "proof"}
            nodes.send(sock, answer)
            refusal = nodes.receive(sock)
        assert f"refused node 1: {said} (H3_NODE_KEY)" in refusal["refused"], refusal
        deadline = time.monotonic() + 30
        while f"node 1: {said} (H3_NODE_KEY)" not in node0.log():
            assert time.monotonic() < deadline, node0.log()[-2000:]
            time.sleep(0.1)


def test_a_node_that_never_joins_ends_node_0_start_naming_it_and_the_address(hosts, tmp_path):
    lonely = Hosts(tmp_path, hosts.folders[0])
    try:
        node0 = lonely.serve0(free_port(), H3_NODE_TIMEOUT="3")
        text = refused(node0)
        assert f"node 1 (rank 1) did not join within 3 s; waited at 127.0.0.1:{lonely.port}" in text, text
        node1 = lonely.serve1(H3_NODE_TIMEOUT="2")
        text = refused(node1)
        assert f"node 0 did not answer at 127.0.0.1:{lonely.port} within 2 s" in text, text
    finally:
        lonely.close()


# ---- render -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("task", ["t2va", "ref2va"])
def test_render_over_two_hosts_writes_the_one_process_mp4(hosts, pair, tmp_path, task):
    refs = []
    if task == "ref2va":
        (tmp_path / "ref.png").write_bytes(png_bytes(96, 64, 3))
        (tmp_path / "ref.wav").write_bytes(wav_bytes())
        refs = ["--ref", str(tmp_path / "ref.png"), "--ref", str(tmp_path / "ref.wav")]
    args = ["render", "a lighthouse at dusk", "--steps", "3", "--seed", "4", "--width", "224", "--height", "128",
            "--frames", "22", "--no-progress", *refs]  # fmt: skip
    # One node: none of the node settings (each is refused with one node).
    one = hosts.start("one", [*args, "-o", str(tmp_path / "one.mp4")], 0, H3_NNODES="1", H3_DIST_INIT_ADDR=None,
                      H3_NODE_KEY=None, H3_TASK_TYPE=None, H3_NODE_TIMEOUT=None, H3_NODE_GRACE=None)  # fmt: skip
    assert one.wait(300) == 0, one.log()[-2000:]
    other = Hosts(tmp_path / "hosts", hosts.folders[0])  # its own port: the pair's node 0 stays as it is
    try:
        node1 = other.serve1(H3_TASK_TYPE=task if task == "ref2va" else "fl2va")
        node0 = other.start("render0", [*args, "-o", str(tmp_path / "two.mp4")], 0, H3_TASK_TYPE=None)
        assert node0.wait(300) == 0, node0.log()[-3000:]
        assert "| 2 GPUs" in node0.log()
        assert (tmp_path / "two.mp4").read_bytes() == (tmp_path / "one.mp4").read_bytes()
        assert node1.proc.poll() is None  # node 1 outlives node 0's command, ready for the next one
        assert "rendezvous: node 1 of 2 joins node 0" in node1.log()
    finally:
        other.close()


def check(hosts: Hosts, node: int, *flags: str) -> tuple[int, str]:
    out = subprocess.run([sys.executable, "-m", "h3serve.cli", "check", "--preflight", *flags, "--output-dir",
                          str(hosts.tmp / "check"), "--api-port", str(free_port())], env=hosts.env(node),
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert json.loads(out.stdout[: out.stdout.index("\n}") + 2])["node_key"] == "<redacted>"
    return out.returncode, out.stdout + out.stderr


def test_check_preflight_on_each_node_reports_the_rendezvous_it_will_use_and_its_own_share(tmp_path, release):
    hosts = Hosts(tmp_path, release)
    code, text = check(hosts, 0)
    assert code == 0, text
    assert f"rendezvous: node 0 of 2 listens on {hosts.address} (store on port {hosts.port + 1})" in text, text
    assert "this node's share: 1 of the 2 ranks" in text and "rendezvous address)" in text, text
    code, text = check(hosts, 1, "--node-rank", "1")
    assert code == 0, text
    assert f"rendezvous: node 1 of 2 joins node 0 at {hosts.address}; ranks 1-1 of 2; no service" in text, text
    assert "this node's share: 1 of the 2 ranks" in text and "(node 0 serves)" in text, text
    with socket.socket() as taken:  # node 0's check finds the address taken, naming the setting
        taken.bind(("127.0.0.1", hosts.port + 1))
        code, text = check(hosts, 0)
    # The port named is the one taken, as what it is for: the process group's store at PORT+1 of the address.
    store = f"127.0.0.1:{hosts.port + 1} (the process group's store: PORT+1 of {hosts.address}): cannot listen"
    assert code == 1 and f"H3_DIST_INIT_ADDR (--dist-init-addr): {store}" in text, text
