"""Several hosts as one group: node 0's rendezvous (`Rendezvous`) and a joining node's side (`join_node`).

torch.distributed's store and its gloo and NCCL transports authenticate nobody, so nothing of theirs is reached before
a node has proved the shared key. Node 0 listens at H3_DIST_INIT_ADDR only. A joining node connects and the two prove
the key to each other (HMAC-SHA256 over fresh nonces from both sides, each side's proof labelled with its role, so
neither can be replayed or reflected; compared with `hmac.compare_digest`). Only then does the joining node send what
it runs (model digest, profile, task type, step cache, adapters, GPUs per node), and node 0 compares it with its own.
A refusal is a message to the other side before the connection closes, and an error or a log line on both sides.

An accepted node keeps its connection. Over it node 0 hands out each start of the group (the store at PORT+1, bound
to the given address only, under a random prefix of that start), and the node reports its ranks' events (ready,
failed, each render's outcome); both sides send a heartbeat each second. The ranks themselves meet in the
torch.distributed group: rank 0 broadcasts each command (a render and its request) to every rank (`workers`).

A node whose connection closes, or that is silent for H3_NODE_GRACE seconds, is lost: node 0's pool fails the render
in flight naming it, says so in `problem` (/health), stops its own ranks and waits for the node to join again, then
starts the group afresh. A joining node that loses node 0 stops its ranks and connects again, for as long as it
runs. What this does not do: encrypt the ranks' traffic (the store, gloo, NCCL) or authenticate it beyond the
unguessable per-start prefix, nor authenticate each message after the handshake: the nodes need a private link.

Messages are JSON objects, each prefixed by its length (4 bytes, big-endian, at most MAX_MESSAGE).
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import hmac
import json
import logging
import queue
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from h3serve.parallel.group import GroupStore
from h3serve.pipeline.context import NodeLost

log = logging.getLogger(__name__)

PROTOCOL = "h3serve-nodes/1"
MAX_MESSAGE = 1 << 20
BEAT_S = 1.0  # heartbeat interval, both ways
HANDSHAKE_S = 10.0  # a connection that has not finished the handshake by then is closed
RETRY_S = 1.0  # a joining node's pause between attempts to reach node 0


class NodeRefused(RuntimeError):
    """A node refused at the rendezvous (on either side): `node` is the joining node's rank where known, `reason` the
    words both sides see."""

    def __init__(self, node: int | None, reason: str):
        super().__init__(reason)
        self.node = node
        self.reason = reason


class NodeMissing(RuntimeError):
    """Node 0 waited `timeout_s` at `address` and these nodes did not join (or a joining node waited for node 0)."""

    def __init__(self, nodes: list[int], address: str, message: str):
        super().__init__(message)
        self.nodes = nodes
        self.address = address


@dataclass(frozen=True)
class NodePlan:
    """This node's place among the nodes, from the settings. `identity`: what every node must run alike (compared at
    the handshake). `key` never travels: only proofs made with it do."""

    nnodes: int
    node_rank: int
    host: str
    port: int
    gpus: int  # per node
    timeout_s: float
    grace_s: float
    identity: dict[str, str]
    key: bytes = field(repr=False)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def world(self) -> int:
        return self.nnodes * self.gpus

    def ranks_of(self, node: int) -> range:
        return range(node * self.gpus, (node + 1) * self.gpus)

    def describe(self, node: int) -> str:
        """`node 1 (rank 1)` or `node 1 (ranks 2-3)`."""
        r = self.ranks_of(node)
        return f"node {node} (rank {r[0]})" if len(r) == 1 else f"node {node} (ranks {r[0]}-{r[-1]})"

    def rendezvous_line(self) -> str:
        """What `check --preflight` and the start say of the rendezvous this node will use."""
        ranks = f"ranks {self.ranks_of(self.node_rank)[0]}-{self.ranks_of(self.node_rank)[-1]} of {self.world}"
        if self.node_rank == 0:
            return (f"rendezvous: node 0 of {self.nnodes} listens on {self.address} (store on port {self.port + 1}); "
                    f"{ranks}; the service runs here")  # fmt: skip
        return f"rendezvous: node {self.node_rank} of {self.nnodes} joins node 0 at {self.address}; {ranks}; no service"


def model_digest(folder: Any) -> str:
    """SHA-256 over the model's configuration and index files (every .json of its component folders, by relative
    path), or the built-in tiny model's name: two nodes with equal digests load the same release."""
    if folder is None:
        return "built-in tiny model"
    digest = hashlib.sha256()
    folders = [folder.root, folder.transformer, folder.text_encoder, folder.tokenizer, folder.processor,
               folder.video_vae, folder.audio_vae, folder.ref_transformer]  # fmt: skip
    seen: set[Path] = set()
    for base in folders:
        if base is None:
            continue
        files = sorted(base.glob("*.json")) if base == folder.root else sorted(base.rglob("*.json"))
        for path in files:
            if path in seen or not path.is_file():
                continue
            seen.add(path)
            digest.update(f"{path.parent.name}/{path.name}\0".encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def identity(folder: Any, profile: Any, task_type: str, step_cache: Any, adapters: tuple, gpus: int) -> dict[str, str]:
    """What every node must run alike, as text: the model's digest, the profile (but its device index), the DiTs
    loaded, the step cache, the adapters, the GPUs per node."""
    values = {k: v for k, v in profile.as_dict().items() if k != "device"}
    return {
        "model": model_digest(folder),
        "profile": json.dumps(values, sort_keys=True, default=str),
        "task_type": str(task_type),
        "step_cache": repr(step_cache),
        "adapters": "; ".join(a.describe() for a in adapters),
        "gpus per node": str(gpus),
    }


def differences(mine: dict[str, str], theirs: Any) -> list[str]:
    """What differs between node 0's identity and a joining node's, one phrase each."""
    if not isinstance(theirs, dict):
        return ["it sent no description of what it runs"]
    out = []
    for name in mine:
        if theirs.get(name) != mine[name]:
            a, b = _short(mine[name]), _short(theirs.get(name))
            what = "model (config and index digest)" if name == "model" else name
            out.append(f"{what}: {b} on the joining node, {a} on node 0")
    return out


def _short(value: Any) -> str:
    text = str(value)
    return text if len(text) <= 80 else text[:77] + "..."


# ---- the wire --------------------------------------------------------------------------------------------------------
def send(sock: socket.socket, message: dict[str, Any]) -> None:
    data = json.dumps(message).encode()
    sock.sendall(len(data).to_bytes(4, "big") + data)


def receive(sock: socket.socket) -> dict[str, Any]:
    """The next message; ConnectionError when the connection closes, ValueError for what is no message of ours."""
    size = int.from_bytes(_exactly(sock, 4), "big")
    if size > MAX_MESSAGE:
        raise ValueError(f"a message of {size} bytes (at most {MAX_MESSAGE})")
    message = json.loads(_exactly(sock, size))
    if not isinstance(message, dict):
        raise ValueError("a message that is not a JSON object")
    return message


def _exactly(sock: socket.socket, n: int) -> bytes:
    parts, got = [], 0
    while got < n:
        part = sock.recv(n - got)
        if not part:
            raise ConnectionError("the connection closed")
        parts.append(part)
        got += len(part)
    return b"".join(parts)


def proof(key: bytes, role: str, node: int, joiner_nonce: str, lead_nonce: str) -> str:
    """HMAC-SHA256 of both nonces, the joining node's rank and the prover's role under the shared key."""
    text = f"{PROTOCOL}|{role}|{node}|{joiner_nonce}|{lead_nonce}".encode()
    return hmac.new(key, text, hashlib.sha256).hexdigest()


def _refuse(sock: socket.socket, reason: str) -> None:
    """Tell the other side why, then close (a side already gone is not told)."""
    with contextlib.suppress(OSError):
        send(sock, {"refused": reason})
    sock.close()


# ---- node 0 ----------------------------------------------------------------------------------------------------------
class Link:
    """Node 0's connection to one joined node."""

    def __init__(self, node: int, sock: socket.socket, peer: str):
        self.node, self.sock, self.peer = node, sock, peer
        self.lock = threading.Lock()
        self.last_seen = time.monotonic()

    def send(self, message: dict[str, Any]) -> None:
        with self.lock:
            send(self.sock, message)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


class Rendezvous:
    """Node 0's side: the listening socket at the given address, the store of the group's starts at PORT+1, the
    joined nodes. `sink` receives each joined node's rank events of the current start (the pool's event queue)."""

    def __init__(self, plan: NodePlan):
        import torch.distributed as dist

        self.plan = plan
        self.sink: Callable[[tuple], None] | None = None
        self._cond = threading.Condition()
        self._links: dict[int, Link] = {}
        self._lost: dict[int, str] = {}  # node -> why, until the group starts again without it lost
        self._generation = 0
        self._closed = False
        self._listener = _listen(plan.host, plan.port)
        # The store binds where we say: torch's own listener would take every interface. Our socket is handed to it
        # by its descriptor, which the store owns from then on (it closes it).
        store_socket = _listen(plan.host, plan.port + 1)
        self._store = dist.TCPStore(
            plan.host,
            plan.port + 1,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=plan.timeout_s),
            master_listen_fd=store_socket.fileno(),
            use_libuv=True,
        )
        store_socket.detach()
        threading.Thread(target=self._accept, name="h3serve-rendezvous", daemon=True).start()
        threading.Thread(target=self._beat, name="h3serve-node-beat", daemon=True).start()
        log.info("%s", plan.rendezvous_line())

    # ---- what the pool asks ---------------------------------------------------------------------------------------
    def missing(self) -> list[int]:
        with self._cond:
            return [n for n in range(1, self.plan.nnodes) if n not in self._links]

    def wait_joined(self, timeout_s: float | None, on_wait: Callable[[str], None] | None = None) -> None:
        """Return once every node has joined; NodeMissing naming the missing ones and the address after `timeout_s`
        (None: wait until closed)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        told: list[int] | None = None
        with self._cond:
            while missing := [n for n in range(1, self.plan.nnodes) if n not in self._links]:
                if self._closed:
                    raise NodeMissing(missing, self.plan.address, "the rendezvous is closed")
                if missing != told and on_wait is not None:
                    told = missing
                    on_wait(self._waiting_text(missing))
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise NodeMissing(missing, self.plan.address, self._waiting_text(missing, timeout_s))
                self._cond.wait(0.5 if left is None else min(0.5, left))

    def _waiting_text(self, missing: list[int], timeout_s: float | None = None) -> str:
        nodes = ", ".join(self.plan.describe(n) for n in missing)
        waited = f"did not join within {timeout_s:g} s" if timeout_s is not None else "has not joined yet"
        lost = "".join(f" (lost: {self._lost[n]})" for n in missing if n in self._lost)
        return f"{nodes} {waited}; waited at {self.plan.address}{lost}"

    def start(self, sink: Callable[[tuple], None]) -> GroupStore:
        """A new start of the group: every joined node is told where to meet (a fresh random prefix), and its ranks'
        events go to `sink`; the events of earlier starts are dropped from now on. Node 0's own meeting place is
        returned."""
        with self._cond:
            self.sink = sink
            self._generation += 1
            for node in [n for n in self._lost if n in self._links]:  # back for this start (one lost since stays)
                del self._lost[node]
            generation = self._generation
            links = list(self._links.values())
        prefix = f"h3serve/{generation}/{secrets.token_hex(16)}"
        message = {"start": {"host": self.plan.host, "port": self.plan.port + 1, "prefix": prefix,
                             "world": self.plan.world}, "generation": generation}  # fmt: skip
        for link in links:
            self._send(link, message)
        return GroupStore(self.plan.host, self.plan.port + 1, prefix, self.plan.host)

    def stop(self) -> None:
        """Every joined node stops its ranks (a restart of the group, or the end)."""
        with self._cond:
            links = list(self._links.values())
        for link in links:
            self._send(link, {"stop": True})

    def problem(self) -> NodeLost | None:
        """The first node lost since the group started (its first rank, and why); None if none."""
        with self._cond:
            for node in sorted(self._lost):
                return NodeLost(node, self.plan.ranks_of(node)[0], self._lost[node])
        return None

    def status(self) -> list[dict[str, Any]]:
        """Each node, for /health: its ranks and whether it has joined (node 0 always has)."""
        with self._cond:
            out = []
            for node in range(self.plan.nnodes):
                r = self.plan.ranks_of(node)
                joined = node == 0 or node in self._links
                entry: dict[str, Any] = {"node": node, "ranks": [r[0], r[-1]], "joined": joined}
                if node in self._lost:
                    entry["lost"] = self._lost[node]
                out.append(entry)
            return out

    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            links = list(self._links.values())
            self._links.clear()
            self._cond.notify_all()
        for link in links:
            self._send(link, {"stop": True})
            link.close()
        self._listener.close()
        del self._store  # the store's server stops with its last reference

    # ---- the threads ------------------------------------------------------------------------------------------------
    def _send(self, link: Link, message: dict[str, Any]) -> None:
        try:
            link.send(message)
        except OSError as err:
            self._lose(link, f"sending to it failed ({err.strerror or err})")

    def _lose(self, link: Link, why: str) -> None:
        with self._cond:
            if self._links.get(link.node) is not link:
                return
            del self._links[link.node]
            if not self._closed:
                self._lost[link.node] = why
                log.error("%s at %s lost: %s", self.plan.describe(link.node), link.peer, why)
            self._cond.notify_all()
        link.close()

    def _accept(self) -> None:
        while True:
            try:
                sock, peer = self._listener.accept()
            except OSError:
                return  # closed
            where = f"{peer[0]}:{peer[1]}"
            threading.Thread(target=self._greet, args=(sock, where), name="h3serve-node-greet", daemon=True).start()

    def _greet(self, sock: socket.socket, peer: str) -> None:
        try:
            link = self._handshake(sock, peer)
        except NodeRefused as err:
            log.error("refused a node from %s: %s", peer, err.reason)
            return
        except (OSError, ValueError) as err:  # gone, silent, or no h3serve node
            log.error("refused a connection from %s: no handshake (%s)", peer, err)
            sock.close()
            return
        threading.Thread(target=self._read, args=(link,), name=f"h3serve-node{link.node}", daemon=True).start()

    def _handshake(self, sock: socket.socket, peer: str) -> Link:
        plan = self.plan
        sock.settimeout(HANDSHAKE_S)
        hello = receive(sock)
        node = hello.get("node")
        if hello.get("protocol") != PROTOCOL or not isinstance(node, int) or not isinstance(hello.get("nonce"), str):
            _refuse(sock, f"not an h3serve node (expected protocol {PROTOCOL})")
            raise NodeRefused(None, f"not an h3serve node (protocol {_short(hello.get('protocol'))})")
        lead_nonce = secrets.token_hex(32)
        send(sock, {"nonce": lead_nonce, "proof": proof(plan.key, "lead", node, hello["nonce"], lead_nonce)})
        answer = receive(sock)
        if "refused" in answer:  # it did not accept our proof
            sock.close()
            raise NodeRefused(node, f"node {node} refused node 0: {_short(answer['refused'])}")
        given = answer.get("proof")
        expected = proof(plan.key, "join", node, hello["nonce"], lead_nonce)
        if not isinstance(given, str) or not hmac.compare_digest(given.encode(), expected.encode()):
            reason = ("it proved no key" if given is None else "its key is not node 0's") + " (H3_NODE_KEY)"
            _refuse(sock, f"node 0 at {plan.address} refused node {node}: {reason}")
            raise NodeRefused(node, f"node {node}: {reason}")
        if not 1 <= node < plan.nnodes:
            reason = (
                f"node rank {node} is not one of the other nodes of H3_NNODES={plan.nnodes} (1 to {plan.nnodes - 1})"
            )
            _refuse(sock, f"node 0 at {plan.address} refused node {node}: {reason}")
            raise NodeRefused(node, reason)
        if found := differences(plan.identity, answer.get("identity")):
            reason = "it runs something else: " + "; ".join(found)
            _refuse(sock, f"node 0 at {plan.address} refused node {node}: {reason}")
            raise NodeRefused(node, f"node {node}: {reason}")
        link = Link(node, sock, peer)
        with self._cond:
            if self._closed:
                _refuse(sock, "node 0 is shutting down")
                raise NodeRefused(node, "closed")
            if node in self._links:
                other = self._links[node].peer
                reason = f"node {node} has already joined (from {other}); a second node {node} is refused"
                _refuse(sock, f"node 0 at {plan.address} refused this node: {reason}")
                raise NodeRefused(node, f"a second node {node} from {peer}: {reason}")
            sock.settimeout(None)
            send(sock, {"accepted": {"nnodes": plan.nnodes, "world": plan.world}})
            # A node lost and back (a quick reconnect) is still lost to the group it left, until the group starts
            # afresh (`start`): the pool must see the loss to restart it.
            self._links[node] = link
            self._cond.notify_all()
        log.info("%s joined from %s", plan.describe(node), peer)
        return link

    def _read(self, link: Link) -> None:
        while True:
            try:
                message = receive(link.sock)
            except (OSError, ValueError) as err:
                self._lose(link, f"its connection closed ({err})")
                return
            link.last_seen = time.monotonic()
            if "event" in message:
                with self._cond:
                    current = message.get("generation") == self._generation and self._links.get(link.node) is link
                sink = self.sink
                if current and sink is not None:
                    sink(_event(message["event"]))

    def _beat(self) -> None:
        while not self._closed:
            time.sleep(BEAT_S)
            with self._cond:
                links = list(self._links.values())
            now = time.monotonic()
            for link in links:
                if now - link.last_seen > self.plan.grace_s:
                    self._lose(link, f"no heartbeat for {self.plan.grace_s:g} s (H3_NODE_GRACE)")
                else:
                    self._send(link, {"beat": True})


def _event(raw: Any) -> tuple:
    """A joined node's rank event as the pool's event tuples are (JSON has lists where they have tuples)."""
    if not isinstance(raw, list) or not raw:
        return ("invalid",)
    if raw[0] == "outcome" and len(raw) == 5 and raw[3] == "error" and isinstance(raw[4], list):
        raw = [*raw[:4], tuple(raw[4])]
    if raw[0] == "failed" and len(raw) == 3 and isinstance(raw[2], list):
        raw = [*raw[:2], tuple(raw[2])]
    return tuple(raw)


def _listen(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(16)
    return sock


# ---- a joining node --------------------------------------------------------------------------------------------------
def connect(plan: NodePlan) -> tuple[socket.socket, str]:
    """A connection to node 0 that has passed the handshake, and this node's address toward node 0 (where its ranks
    listen). NodeRefused when either side refuses; OSError when node 0 cannot be reached."""
    sock = socket.create_connection((plan.host, plan.port), timeout=HANDSHAKE_S)
    try:
        sock.settimeout(HANDSHAKE_S)
        nonce = secrets.token_hex(32)
        send(sock, {"protocol": PROTOCOL, "node": plan.node_rank, "nonce": nonce})
        answer = receive(sock)
        if "refused" in answer:
            raise NodeRefused(plan.node_rank, str(answer["refused"]))
        lead_nonce, given = answer.get("nonce"), answer.get("proof")
        if not isinstance(lead_nonce, str) or not isinstance(given, str):
            raise NodeRefused(plan.node_rank, f"{plan.address} is not an h3serve node 0 (no key proof)")
        expected = proof(plan.key, "lead", plan.node_rank, nonce, lead_nonce)
        if not hmac.compare_digest(given.encode(), expected.encode()):
            _refuse(sock, "the keys differ (H3_NODE_KEY): node 0's proof does not match this node's key")
            raise NodeRefused(plan.node_rank, f"node 0 at {plan.address} does not hold this node's key (H3_NODE_KEY)")
        send(sock, {"proof": proof(plan.key, "join", plan.node_rank, nonce, lead_nonce), "identity": plan.identity})
        answer = receive(sock)
        if "refused" in answer:
            raise NodeRefused(plan.node_rank, str(answer["refused"]))
        if "accepted" not in answer:
            raise NodeRefused(plan.node_rank, f"{plan.address} answered no acceptance")
        sock.settimeout(None)
        return sock, sock.getsockname()[0]
    except BaseException:
        sock.close()
        raise


class NodeSession:
    """A joined node's connection, read in a thread: `inbox` gets each message, then None when it closes."""

    def __init__(self, sock: socket.socket, bind: str):
        self.sock, self.bind = sock, bind
        self.inbox: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.lock = threading.Lock()
        threading.Thread(target=self._read, name="h3serve-node0-link", daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                self.inbox.put(receive(self.sock))
            except (OSError, ValueError):
                self.inbox.put(None)
                return

    def send(self, message: dict[str, Any]) -> bool:
        try:
            with self.lock:
                send(self.sock, message)
            return True
        except OSError:
            return False

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


def join_node(plan: NodePlan, ranks: Callable[[GroupStore, int], Any], stopping: threading.Event) -> None:
    """A joining node's life: reach node 0 (for H3_NODE_TIMEOUT at first, then for as long as it runs), prove the
    key, and run this node's ranks for each start node 0 hands out (`ranks(store, generation)` starts them and
    returns an object with `events()`, `dead()` and `stop()`: `workers.NodeRanks`); when node 0 is lost, stop them
    and join again. Returns when `stopping` is set; NodeRefused on a refusal, NodeMissing when node 0 never
    answered."""
    deadline = time.monotonic() + plan.timeout_s
    joined_once = False
    last_error = ""
    while not stopping.is_set():
        try:
            sock, bind = connect(plan)
        except OSError as err:
            last_error = err.strerror or str(err)
            if not joined_once and time.monotonic() > deadline:
                raise NodeMissing([0], plan.address, f"node 0 did not answer at {plan.address} within "
                                  f"{plan.timeout_s:g} s ({last_error})") from None  # fmt: skip
            stopping.wait(RETRY_S)
            continue
        except NodeRefused as err:
            if not joined_once:
                raise
            log.error("node 0 at %s refused this node: %s; trying again", plan.address, err.reason)
            stopping.wait(RETRY_S)
            continue
        joined_once = True
        log.info("node %d joined node 0 at %s (this node's ranks listen on %s)", plan.node_rank, plan.address, bind)
        why = _serve(plan, NodeSession(sock, bind), ranks, stopping)
        if not stopping.is_set():
            log.warning("node 0 at %s lost (%s); joining again", plan.address, why)


def _serve(plan: NodePlan, session: NodeSession, ranks: Callable[[GroupStore, int], Any], stopping: threading.Event):
    """Run this node's ranks for node 0 until the connection is lost (returns why) or `stopping` is set."""
    current, generation = None, 0
    last_seen = next_beat = time.monotonic()
    try:
        while not stopping.is_set():
            try:
                message = session.inbox.get(timeout=0.05)
            except queue.Empty:
                message = {}
            if message is None:
                return "its connection closed"
            now = time.monotonic()
            if message:
                last_seen = now
            if "start" in message:
                if current is not None:
                    current.stop()
                start, generation = message["start"], int(message["generation"])
                store = GroupStore(str(start["host"]), int(start["port"]), str(start["prefix"]), session.bind)
                current = ranks(store, generation)
            elif "stop" in message and current is not None:
                current.stop()
                current = None
            if current is not None:
                for event in current.events():
                    session.send({"event": list(event), "generation": generation})
                if (dead := current.dead()) is not None:
                    rank, text = dead
                    session.send({"event": ["dead", rank, text], "generation": generation})
                    current.stop()
                    current = None
            if now >= next_beat:
                next_beat = now + BEAT_S
                if not session.send({"beat": True}):
                    return "sending to it failed"
            if now - last_seen > plan.grace_s:
                return f"no heartbeat for {plan.grace_s:g} s (H3_NODE_GRACE)"
        return "stopping"
    finally:
        if current is not None:
            current.stop()
        session.close()
