"""Node 0's rendezvous (`parallel.nodes.Rendezvous`) against whoever reaches its port before proving any key, on
loopback: a connection trickling its hello a byte at a time is closed at the handshake's deadline; connections beyond
the handshakes allowed at once are closed at once, with one log line for the lot; a node 0 out of file descriptors
(run in a process of its own under a lowered limit, so that accept really fails with EMFILE) says so, keeps
accepting, and a node joins once the connections are gone; a deeply nested message and an oversized one are refused
with the usual line and a clean close, never a traceback; a listener closed under the rendezvous is named in its
status (/health's `nodes`) and in every wait for a node. Each wait is bounded by what it polls."""

from __future__ import annotations

import contextlib
import logging
import os
import select
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from h3serve.parallel import nodes
from service_fixtures import until
from test_nodes import ROOT, two_free_ports

KEY = "0123456789abcdef" * 3
IDENTITY = {"model": "built-in tiny model", "gpus per node": "1"}
BOUND_S = 60.0  # a bound on a broken run only: every wait below ends as soon as what it polls has happened
LOGGER = "h3serve.parallel.nodes"


def plan(port: int, rank: int) -> nodes.NodePlan:
    return nodes.NodePlan(nnodes=2, node_rank=rank, host="127.0.0.1", port=port, gpus=1, timeout_s=30.0,
                          grace_s=30.0, identity=IDENTITY, key=KEY.encode())  # fmt: skip


def read_to_close(sock: socket.socket) -> tuple[list[dict], str]:
    """The messages node 0 sent before it closed this connection, and how it closed it: 'closed' (an orderly close,
    nothing left unread on its side) or 'reset'."""
    sock.settimeout(BOUND_S)  # a bound on a broken run only: node 0 closes as soon as it refuses
    messages = []
    while True:
        try:
            messages.append(nodes.receive(sock))
        except ConnectionResetError:
            return messages, "reset"
        except ConnectionError:  # the end of the stream
            return messages, "closed"


@pytest.fixture
def rendezvous(caplog) -> Iterator[Callable[..., nodes.Rendezvous]]:
    """A node 0 of two nodes on a free port pair (the rendezvous and its store), made with the arguments given."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    made: list[nodes.Rendezvous] = []

    def make(**limits) -> nodes.Rendezvous:
        made.append(nodes.Rendezvous(plan(two_free_ports(), 0), **limits))
        return made[-1]

    yield make
    for rv in made:
        rv.close()


@pytest.fixture
def thread_errors(monkeypatch) -> list[BaseException]:
    """Exceptions that ended a thread (a traceback in node 0's log)."""
    seen: list[BaseException] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: seen.append(args.exc_value))
    return seen


def lines(caplog, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and text in r.getMessage()]


def test_a_connection_trickling_a_byte_at_a_time_is_closed_at_the_handshake_deadline(rendezvous, caplog):
    rv = rendezvous(handshake_s=0.5)
    # A hello announced at 1,000 bytes, sent a byte at a time, each byte far sooner than the deadline after the last
    # one: a limit per read would never end it, only a deadline for the whole handshake does.
    stream = (1000).to_bytes(4, "big") + b" " * 196
    sent, closed = 0, False
    with socket.create_connection((rv.plan.host, rv.plan.port)) as sock:
        for byte in stream:
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                closed = True
                break
            sent += 1
            if select.select([sock], [], [], 0.02)[0]:  # the drip's pace, cut short by node 0's close
                with contextlib.suppress(ConnectionResetError):
                    assert sock.recv(1) == b""  # closed, told nothing
                closed = True
                break
    assert closed, f"node 0 still held the connection after all {sent} bytes of a hello that never ends"
    assert sent < len(stream)
    assert lines(caplog, "refused a connection from 127.0.0.1:"), caplog.text
    assert lines(caplog, "no handshake within 0.5 s"), caplog.text
    until(lambda: rv.handshaking == 0, "the handshake's end counted")


def test_connections_beyond_the_handshakes_allowed_at_once_are_closed_with_one_line_and_a_node_joins_after(
    rendezvous, caplog
):
    rv = rendezvous(max_handshakes=2, log_every_s=3600.0)
    address = (rv.plan.host, rv.plan.port)
    held = [socket.create_connection(address) for _ in range(2)]
    for sock in held:
        sock.sendall(b"\0")  # the first byte of a hello, and nothing more
    until(lambda: rv.handshaking == 2, "two handshakes under way")
    for _ in range(4):
        with socket.create_connection(address) as extra:
            assert read_to_close(extra) == ([], "closed")  # closed at once, told nothing
    assert rv.handshaking == 2  # the two slow ones still held
    refusals = lines(caplog, "handshakes are under way (at most 2 at once)")
    assert len(refusals) == 1, refusals  # four refused, one line: the rest are counted for the next
    for sock in held:
        sock.close()
    until(lambda: rv.handshaking == 0, "the slow connections' ends counted")
    sock, _ = nodes.connect(plan(rv.plan.port, 1))
    with sock:
        until(lambda: rv.missing() == [], "node 1 joined")


def test_refusals_before_the_key_is_proved_are_logged_once_per_quiet_time_each(rendezvous, caplog):
    rv = rendezvous(log_every_s=3600.0)
    for _ in range(5):  # a flood of clients that are no h3serve node: each is told, the log has a line
        with socket.create_connection((rv.plan.host, rv.plan.port)) as sock:
            nodes.send(sock, {"protocol": "something else"})
            messages, how = read_to_close(sock)
        assert how == "closed" and "not an h3serve node" in messages[0]["refused"], messages
    assert len(lines(caplog, "not an h3serve node (protocol something else)")) == 1, caplog.text
    with socket.create_connection((rv.plan.host, rv.plan.port)) as sock:  # another check: a line of its own
        nodes.send(sock, {"protocol": nodes.PROTOCOL, "node": 1, "nonce": "n"})
        nodes.receive(sock)
        nodes.send(sock, {"identity": {}})
        assert "it proved no key" in read_to_close(sock)[0][0]["refused"]
    # node 0 logs it after the close this connection saw: polled, not raced
    until(lambda: lines(caplog, "node 1: it proved no key (H3_NODE_KEY)"), "node 0's line for the refusal", BOUND_S)


CHILD = """
import logging, os, resource, sys
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
from h3serve.parallel import nodes
port, key, headroom = int(sys.argv[1]), sys.argv[2].encode(), int(sys.argv[3])
plan = nodes.NodePlan(nnodes=2, node_rank=0, host="127.0.0.1", port=port, gpus=1, timeout_s=30.0, grace_s=30.0,
                      identity={"model": "built-in tiny model", "gpus per node": "1"}, key=key)
rv = nodes.Rendezvous(plan)  # the defaults: a handshake of 10 s, more handshakes at once than this headroom
limit = len(os.listdir("/proc/self/fd")) + headroom
resource.setrlimit(resource.RLIMIT_NOFILE, (limit, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
print(f"file limit {limit}", flush=True)
sys.stdin.read()
rv.close()
"""


def test_out_of_file_descriptors_node_0_says_so_keeps_accepting_and_a_node_joins_once_they_are_gone(tmp_path: Path):
    port, headroom = two_free_ports(), 4
    log_path = tmp_path / "node0.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    with log_path.open("wb") as out:
        child = subprocess.Popen([sys.executable, "-c", CHILD, str(port), KEY, str(headroom)], stdin=subprocess.PIPE,
                                 stdout=out, stderr=subprocess.STDOUT, env=env)  # fmt: skip
    slow: list[socket.socket] = []

    def said(text: str) -> bool:
        log = log_path.read_text(errors="replace")
        assert child.poll() is None, log
        return text in log

    try:
        until(lambda: said("file limit"), "node 0 listening under its lowered file limit")
        # More slow connections than descriptors left: node 0 accepts `headroom` of them, then accept fails.
        for _ in range(headroom + 8):
            slow.append(socket.create_connection(("127.0.0.1", port)))
            slow[-1].sendall(b"\0")
        until(lambda: said("EMFILE"), "node 0 saying it is out of descriptors")
        for sock in slow:
            sock.close()
        until(lambda: said("accepts connections again"), "node 0 accepting again")
        sock, _ = nodes.connect(plan(port, 1))
        with sock:
            until(lambda: said("node 1 (rank 1) joined from 127.0.0.1:"), "node 1 joined")
        log = log_path.read_text(errors="replace")
        assert "could not accept a connection (EMFILE: Too many open files); it pauses and keeps accepting" in log
        assert log.count("could not accept a connection") == 1, log  # once for the run of failures
        assert "Traceback" not in log and "stopped" not in log, log
    finally:
        for sock in slow:
            sock.close()
        child.stdin.close()
        child.wait(BOUND_S)


def test_a_deeply_nested_message_is_refused_with_the_refused_line_and_a_clean_close(rendezvous, caplog, thread_errors):
    rv = rendezvous()
    body = b"[" * 30_000 + b"]" * 30_000  # far deeper than json's parser can recurse, within a hello's size
    with socket.create_connection((rv.plan.host, rv.plan.port)) as sock:
        sock.sendall(len(body).to_bytes(4, "big") + body)
        messages, how = read_to_close(sock)
    assert how == "closed"
    assert [m.keys() for m in messages] == [{"refused", "setting"}], messages
    assert f"a message nested more than {nodes.MAX_DEPTH} deep" in messages[0]["refused"]
    assert lines(caplog, f"no handshake (a message nested more than {nodes.MAX_DEPTH} deep)"), caplog.text
    assert thread_errors == []
    assert "Traceback" not in caplog.text


def test_the_nesting_is_counted_outside_strings_only():
    deep = "[" * 40 + "]" * 40
    assert nodes.decode(b'{"a": "' + deep.encode() + b'", "b": "\\"[[[[[[[[[[[[[[[[[[[[\\""}')["a"] == deep
    assert nodes.decode(b'{"a": ' + b"[" * 15 + b"]" * 15 + b"}")["a"]  # 16 deep with the object; ours nest 3
    with pytest.raises(nodes.BadMessage) as err:
        nodes.decode(b'{"a": "\\\\", "b": ' + b"[" * 16 + b"]" * 16 + b"}")  # 17: an escaped backslash ends no string
    assert (err.value.rule, err.value.limit) == ("depth", nodes.MAX_DEPTH)


@pytest.mark.parametrize("size", [100_000, 0xFFFFFFFF], ids=["beyond a hello", "beyond any message"])
def test_an_oversized_message_is_refused_by_its_length_before_its_body(rendezvous, caplog, size):
    rv = rendezvous()
    with socket.create_connection((rv.plan.host, rv.plan.port)) as sock:
        sock.sendall(size.to_bytes(4, "big"))  # the length alone: node 0 must not wait for the body
        messages, how = read_to_close(sock)
    assert how == "closed"
    assert len(messages) == 1 and f"a message of {size} bytes (at most" in messages[0]["refused"], messages
    assert lines(caplog, "refused a connection from 127.0.0.1:"), caplog.text
    assert lines(caplog, f"no handshake (a message of {size} bytes (at most"), caplog.text


def test_a_listener_closed_under_the_rendezvous_is_named_in_its_status_and_every_wait(rendezvous, caplog):
    rv = rendezvous()
    rv._listener.shutdown(socket.SHUT_RDWR)  # the socket taken away under the accept loop (not by `close`)
    entry = until(lambda: "listener" in rv.status()[0] and rv.status()[0], "the stopped listener in the status")
    assert entry["listener"].startswith("stopped (") and rv.plan.address not in entry["listener"], entry
    assert entry["joined"] is True and rv.status()[1] == {"node": 1, "ranks": [1, 1], "joined": False}
    assert lines(caplog, "the rendezvous stopped: node 0 no longer accepts connections"), caplog.text
    with pytest.raises(nodes.NodeMissing) as err:
        rv.wait_joined(None)  # a restart's wait: it would never end
    assert err.value.nodes == [1] and "no node can join until node 0 is started again" in str(err.value)
