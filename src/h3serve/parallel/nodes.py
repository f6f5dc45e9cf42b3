"""Several hosts as one group: node 0's rendezvous (`Rendezvous`) and a joining node's side (`join_node`).

torch.distributed's store and its gloo and NCCL transports authenticate nobody, so nothing of theirs is reached before
a node has proved the shared key. Node 0 listens at H3_DIST_INIT_ADDR only. A joining node connects and the two prove
the key to each other (HMAC-SHA256 over fresh nonces from both sides, each side's proof labelled with its role, so
neither can be replayed or reflected; compared with `hmac.compare_digest`). Only then does the joining node send what
it runs (model digest, profile, task type, step cache, adapters, GPUs per node), and node 0 compares it with its own.
A refusal is a message to the other side before the connection closes, and an error or a log line on both sides.

An accepted node keeps its connection. Over it node 0 hands out each start of the group (the store at PORT+1, bound
to the given address only, under a random prefix of that start), and the node reports its ranks' events
(`parallel.messages`: Ready, Failed, each call's Outcome, Dead, as `messages.encode` writes them; a node that sends
what `messages.decode` refuses is lost); both sides send a heartbeat each second. The ranks themselves meet in the
torch.distributed group: rank 0 broadcasts each command (a render and its request) to every rank (`workers`).

A node whose connection closes, or that is silent for H3_NODE_GRACE seconds, is lost (how each kind of dead peer is
noticed: `workers`' docstring): node 0's pool fails the render in flight naming it, says so in `problem` (/health),
stops its own ranks and waits for the node to join again, then starts the group afresh. A joining node that loses
node 0 stops its ranks and connects again, for as long as it runs. What this does not do: encrypt the ranks' traffic
(the store, gloo, NCCL) or authenticate it beyond the unguessable per-start prefix, nor authenticate each message
after the handshake: the nodes need a private link.

Messages are JSON objects, each prefixed by its length (4 bytes, big-endian, at most MAX_MESSAGE; at most
HANDSHAKE_MESSAGE before the key is proved), nested at most MAX_DEPTH deep (checked before parsing).

Node 0's port is open to whoever reaches it, before any proof: so the whole handshake has one deadline (HANDSHAKE_S
from the accept, however the bytes trickle in), at most MAX_HANDSHAKES connections are handshaken at once (more are
closed at once), the lines such connections cause are logged at most once per LOG_EVERY_S with a count, and the accept
loop outlives every error of the OS (out of descriptors: it backs off and accepts again, and says both in the log). A
listener that stops for good (its socket closed under it) is in `status` (/health's `nodes`) and in every wait for a
node from then on.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
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

from h3serve.errors import shown
from h3serve.parallel import messages
from h3serve.parallel.group import GroupStore
from h3serve.pipeline.context import NodeLost

log = logging.getLogger(__name__)

PROTOCOL = "h3serve-nodes/2"  # 2: the ranks' events as `parallel.messages` (1 sent tuples)
MAX_MESSAGE = 1 << 20
BEAT_S = 1.0  # heartbeat interval, both ways
HANDSHAKE_S = 10.0  # a connection that has not finished the whole handshake this long after its accept is closed
MAX_HANDSHAKES = 32  # connections handshaken at once (a joining node needs one); more are closed at once
HANDSHAKE_MESSAGE = 64 << 10  # a message before the key is proved (a hello, an identity: a few KiB)
MAX_DEPTH = 16  # arrays and objects nested in one message (ours nest 3 deep); json's parser recurses on each
LOG_EVERY_S = 10.0  # lines of one kind caused by connections that never handshake: at most one per this, with a count
ACCEPT_PAUSE_S = 0.05  # after a failed accept (out of descriptors): the first pause, doubled up to ACCEPT_PAUSE_MAX_S
ACCEPT_PAUSE_MAX_S = 1.0
# accept's errors that mean the listening socket itself is gone (closed or shut down under the loop), not a passing
# shortage (EMFILE, ENFILE, ENOBUFS, ENOMEM) or one connection's trouble (ECONNABORTED, EPROTO, ...)
LISTENER_GONE = frozenset({errno.EBADF, errno.EINVAL, errno.ENOTSOCK})
RETRY_S = 1.0  # a joining node's pause between attempts to reach node 0


# The settings a refusal may name (`NodeRefused.setting`), as node 0 sends them to a joining node: which of its own
# settings the operator of the refused node has to change.
REFUSAL_ECHO_CHARS = 2000  # the most of node 0's refusal a joining node repeats
REFUSAL_SETTINGS = frozenset({"node_key", "node_rank", "nnodes", "model", "dist_init_addr"})


class NodeRefused(RuntimeError):
    """A node refused at the rendezvous (on either side): `node` is the joining node's rank where known, `reason` the
    words both sides see; `unproved`: the check that refused a connection before it proved the key (anyone may cause
    those, as often as they like: node 0 logs them at most once per LOG_EVERY_S each), None after the proof;
    `setting`: the setting at fault (one of REFUSAL_SETTINGS: the key for a failed proof, the node rank for a second
    node of one rank, the model for a node that runs something else)."""

    def __init__(self, node: int | None, reason: str, unproved: str | None = None, setting: str = "node_rank"):
        super().__init__(reason)
        self.node = node
        self.reason = reason
        self.unproved = unproved
        self.setting = setting


class BadMessage(ValueError):
    """What arrived is no message of ours: `rule` is the rule it broke ('size', 'depth', 'text' or 'object'), `size`
    its length in bytes, `limit` the bound of that rule (None for 'text' and 'object')."""

    def __init__(self, rule: str, size: int, limit: int | None, message: str):
        super().__init__(message)
        self.rule, self.size, self.limit = rule, size, limit


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


def identity(
    folder: Any, profile: Any, task_type: str, step_cache: Any, adapters: tuple, gpus: int, library: Any = None
) -> dict[str, str]:
    """What every node must run alike, as text: the model's digest, the profile (but its device index), the DiTs
    loaded, the step cache, the adapters (merged, and declared for run time), the GPUs per node."""
    values = {k: v for k, v in profile.as_dict().items() if k != "device"}
    return {
        "model": model_digest(folder),
        "profile": json.dumps(values, sort_keys=True, default=str),
        "task_type": str(task_type),
        "step_cache": repr(step_cache),
        "adapters": "; ".join(a.describe() for a in adapters),
        "run-time adapters": ""
        if library is None
        else "; ".join(e.describe() for e in library.catalog.entries.values()),
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
def send(sock: socket.socket, message: dict[str, Any], deadline: float | None = None) -> None:
    """`deadline` (time.monotonic()): TimeoutError once it has passed."""
    data = json.dumps(message).encode()
    if deadline is not None:
        sock.settimeout(_left(deadline))
    sock.sendall(len(data).to_bytes(4, "big") + data)


def receive(sock: socket.socket, limit: int = MAX_MESSAGE, deadline: float | None = None) -> dict[str, Any]:
    """The next message of at most `limit` bytes, read whole by `deadline` (time.monotonic(); None: the socket's own
    timeout); ConnectionError when the connection closes, TimeoutError when the deadline passes, BadMessage for what
    is no message of ours (refused by its length before its body is read)."""
    size = int.from_bytes(_exactly(sock, 4, deadline), "big")
    if size > limit:
        raise BadMessage("size", size, limit, f"a message of {size} bytes (at most {limit})")
    return decode(_exactly(sock, size, deadline))


def decode(data: bytes) -> dict[str, Any]:
    """A message's body as its JSON object; BadMessage for anything else. The nesting is counted before json parses
    it (json's parser recurses once per level, and a deep enough message would end in RecursionError)."""
    try:
        text = data.decode()
    except UnicodeDecodeError:
        raise BadMessage("text", len(data), None, "a message that is not UTF-8 text") from None
    if _too_deep(text, MAX_DEPTH):
        raise BadMessage("depth", len(data), MAX_DEPTH, f"a message nested more than {MAX_DEPTH} deep")
    try:
        message = json.loads(text)
    except ValueError as err:  # JSONDecodeError, or a number beyond int's digit limit
        raise BadMessage("text", len(data), None, f"a message that is not JSON ({err})") from None
    if not isinstance(message, dict):
        raise BadMessage("object", len(data), None, "a message that is not a JSON object")
    return message


def _too_deep(text: str, limit: int) -> bool:
    """Whether arrays and objects nest more than `limit` deep in `text` (JSON), brackets inside strings not counted;
    counted on the decoded text, so no encoding trick hides a bracket from this count that json would see."""
    if text.count("[") + text.count("{") <= limit:  # our own messages: no need to walk them
        return False
    depth, in_string, escaped = 0, False, False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            if depth > limit:
                return True
        elif char in "]}":
            depth -= 1
    return False


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the handshake's deadline passed")
    return left


def _exactly(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    parts, got = [], 0
    while got < n:
        if deadline is not None:  # one deadline for every read: a byte now and then does not extend it
            sock.settimeout(_left(deadline))
        part = sock.recv(min(n - got, 1 << 16))
        if not part:
            raise ConnectionError("the connection closed")
        parts.append(part)
        got += len(part)
    return b"".join(parts)


def proof(key: bytes, role: str, node: int, joiner_nonce: str, lead_nonce: str) -> str:
    """HMAC-SHA256 of both nonces, the joining node's rank and the prover's role under the shared key."""
    text = f"{PROTOCOL}|{role}|{node}|{joiner_nonce}|{lead_nonce}".encode()
    return hmac.new(key, text, hashlib.sha256).hexdigest()


def _refuse(sock: socket.socket, reason: str, setting: str = "node_rank") -> None:
    """Tell the other side why and which of its settings is at fault (REFUSAL_SETTINGS), then close (a side already
    gone is not told)."""
    with contextlib.suppress(OSError):
        send(sock, {"refused": reason, "setting": setting})
    sock.close()


def _refusal(node: int, answer: dict[str, Any]) -> NodeRefused:
    """Node 0's refusal as a joining node raises it: the setting named where it is one of REFUSAL_SETTINGS."""
    setting = answer.get("setting")
    # Echoed as `shown` writes a value: the other side has not proved the key yet, and its words reach a terminal.
    # (Capped well above node 0's own reasons, which name a model's differences; control characters escaped.)
    reason = shown(answer["refused"], REFUSAL_ECHO_CHARS)
    if isinstance(answer["refused"], str) and reason.startswith('"') and reason.endswith('"'):
        reason = reason[1:-1]
    return NodeRefused(node, reason, setting=setting if setting in REFUSAL_SETTINGS else "node_rank")


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


class Throttle:
    """Log lines of one kind at most once every `every_s`: the first at once, the later ones counted, the count said
    with the next line let through or by `flush` (so a flood of connections is a line now and then, not a flood)."""

    def __init__(self, every_s: float):
        self.every_s = every_s
        self._lock = threading.Lock()
        self._next: dict[str, float] = {}  # kind -> when its next line may be logged
        self._held: dict[str, tuple[int, str]] = {}  # kind -> (lines held back, the last of them)

    def error(self, kind: str, text: str) -> None:
        now = time.monotonic()
        with self._lock:
            if now < self._next.get(kind, 0.0):
                self._held[kind] = (self._held.get(kind, (0, ""))[0] + 1, text)
                return
            held, _ = self._held.pop(kind, (0, ""))
            self._next[kind] = now + self.every_s
        log.error("%s%s", text, f" ({held} more like it since the last such line)" if held else "")

    def flush(self) -> None:
        """Say the count of each kind held back whose quiet time is over."""
        now = time.monotonic()
        with self._lock:
            due = [(kind, *self._held.pop(kind)) for kind in list(self._held) if now >= self._next[kind]]
            for kind, _, _ in due:
                self._next[kind] = now + self.every_s
        for _, held, last in due:
            log.error("%d more like this since the last such line, the last: %s", held, last)


class Rendezvous:
    """Node 0's side: the listening socket at the given address, the store of the group's starts at PORT+1, the
    joined nodes. `sink` receives each joined node's rank events of the current start (the pool's event queue).
    `handshake_s`: the deadline of a connection's whole handshake, from its accept; `max_handshakes`: connections
    handshaken at once; `log_every_s`: the quiet time of the lines a flood of failed connections causes."""

    def __init__(self, plan: NodePlan, *, handshake_s: float = HANDSHAKE_S, max_handshakes: int = MAX_HANDSHAKES,
                 log_every_s: float = LOG_EVERY_S):  # fmt: skip
        import torch.distributed as dist

        if not handshake_s > 0:
            raise ValueError(f"handshake_s: {handshake_s!r}: a deadline of more than 0 s")
        if max_handshakes < 1:
            raise ValueError(f"max_handshakes: {max_handshakes!r}: at least 1")
        self.plan = plan
        self.handshake_s, self.max_handshakes = handshake_s, max_handshakes
        self.sink: Callable[[messages.Message], None] | None = None
        self._cond = threading.Condition()
        self._links: dict[int, Link] = {}
        self._lost: dict[int, str] = {}  # node -> why, until the group starts again without it lost
        self._generation = 0
        self._closed = False
        self._handshaking = 0  # connections accepted whose handshake has not ended
        self._listener_down: str | None = None  # why the listener stopped for good (with its address: the log's)
        self._listener_why = ""  # the same without the address (/health's)
        self._said = Throttle(log_every_s)
        self._wake = threading.Event()  # set by close: ends the accept loop's pause
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

    @property
    def handshaking(self) -> int:
        """Connections accepted whose handshake has not ended yet."""
        with self._cond:
            return self._handshaking

    @property
    def listener_down(self) -> str | None:
        """Why node 0's listener stopped for good (no node can join until node 0 starts again); None while it runs."""
        with self._cond:
            return self._listener_down

    def wait_joined(self, timeout_s: float | None, on_wait: Callable[[str], None] | None = None) -> None:
        """Return once every node has joined; NodeMissing naming the missing ones and the address after `timeout_s`
        (None: wait until closed)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        told: list[int] | None = None
        with self._cond:
            while missing := [n for n in range(1, self.plan.nnodes) if n not in self._links]:
                if self._closed:
                    raise NodeMissing(missing, self.plan.address, "the rendezvous is closed")
                if self._listener_down is not None:  # nobody can join any more: waiting on would hide it
                    raise NodeMissing(missing, self.plan.address, self._waiting_text(missing))
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
        down = "" if self._listener_down is None else f"; {self._listener_down}"
        return f"{nodes} {waited}; waited at {self.plan.address}{lost}{down}"

    def start(self, sink: Callable[[messages.Message], None]) -> GroupStore:
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
        """Each node, for /health: its ranks and whether it has joined (node 0 always has); node 0's entry has
        `listener` (why) once its listener has stopped for good."""
        with self._cond:
            out = []
            for node in range(self.plan.nnodes):
                r = self.plan.ranks_of(node)
                joined = node == 0 or node in self._links
                entry: dict[str, Any] = {"node": node, "ranks": [r[0], r[-1]], "joined": joined}
                if node in self._lost:
                    entry["lost"] = self._lost[node]
                if node == 0 and self._listener_down is not None:  # /health answers without a key: no address
                    entry["listener"] = f"stopped ({self._listener_why}); no node can join until node 0 restarts"
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
        self._wake.set()
        with contextlib.suppress(OSError):  # wakes the accept loop (close alone would leave it blocked in accept)
            self._listener.shutdown(socket.SHUT_RDWR)
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
        """Accept connections for as long as the rendezvous is open. An error of the OS does not end it: out of
        descriptors (EMFILE, ENFILE) or buffers, it pauses (doubling up to ACCEPT_PAUSE_MAX_S) and accepts again,
        saying so once per run of failures and again when it accepts; only a listening socket gone under it ends it,
        and that is recorded (`listener_down`)."""
        failing: int | None = None  # the errno of the current run of failed accepts
        failures, pause = 0, ACCEPT_PAUSE_S
        try:
            while not self._closed:
                try:
                    sock, peer = self._listener.accept()
                except OSError as err:
                    if self._closed:
                        return
                    if self._listener.fileno() < 0 or err.errno in LISTENER_GONE:
                        self._stopped(_os_text(err))
                        return
                    failures += 1
                    if err.errno != failing:
                        failing = err.errno
                        log.error("the rendezvous at %s could not accept a connection (%s); it pauses and keeps "
                                  "accepting", self.plan.address, _os_text(err))  # fmt: skip
                    self._wake.wait(pause)
                    pause = min(2 * pause, ACCEPT_PAUSE_MAX_S)
                    continue
                if failing is not None:
                    log.warning("the rendezvous at %s accepts connections again (after %d failed attempts)",
                                self.plan.address, failures)  # fmt: skip
                    failing, failures, pause = None, 0, ACCEPT_PAUSE_S
                self._admit(sock, f"{peer[0]}:{peer[1]}")
        finally:
            if not self._closed and self.listener_down is None:  # ended by anything else: still no node can join
                self._stopped("its accept loop ended")

    def _stopped(self, why: str) -> None:
        with self._cond:
            self._listener_why = why
            self._listener_down = (f"node 0 no longer accepts connections at {self.plan.address} ({why}); no node can "
                                   "join until node 0 is started again")  # fmt: skip
            self._cond.notify_all()
        log.error("the rendezvous stopped: %s", self._listener_down)

    def _admit(self, sock: socket.socket, peer: str) -> None:
        """Handshake a new connection in a thread of its own, unless MAX_HANDSHAKES are under way: then it is closed
        at once, told nothing (a joining node refused for that tries again, as when node 0 cannot be reached)."""
        deadline = time.monotonic() + self.handshake_s
        with self._cond:
            busy = self._handshaking
            if busy < self.max_handshakes:
                self._handshaking += 1
        if busy >= self.max_handshakes:
            sock.close()
            self._said.error("busy", f"refused a connection from {peer}: {busy} handshakes are under way (at most "
                                     f"{self.max_handshakes} at once)")  # fmt: skip
            return
        try:
            threading.Thread(target=self._greet, args=(sock, peer, deadline), name="h3serve-node-greet",
                             daemon=True).start()  # fmt: skip
        except RuntimeError as err:  # no thread to be had
            with self._cond:
                self._handshaking -= 1
            sock.close()
            self._said.error("thread", f"refused a connection from {peer}: no thread for its handshake ({err})")

    def _greet(self, sock: socket.socket, peer: str, deadline: float) -> None:
        try:
            try:
                link = self._handshake(sock, peer, deadline)
            finally:
                with self._cond:
                    self._handshaking -= 1
        except NodeRefused as err:
            if err.unproved is None:
                log.error("refused a node from %s: %s", peer, err.reason)
            else:
                self._said.error(err.unproved, f"refused a node from {peer}: {err.reason}")
            return
        except TimeoutError:  # before OSError, whose kind it is
            self._said.error("slow", f"refused a connection from {peer}: no handshake within {self.handshake_s:g} s")
            sock.close()
            return
        except BadMessage as err:  # told why, then closed: a node of another version learns what it sent wrong
            self._said.error("message", f"refused a connection from {peer}: no handshake ({err})")
            _refuse(sock, f"node 0 at {self.plan.address} refused this connection: {err}", "dist_init_addr")
            return
        except (OSError, ValueError) as err:  # gone, or no h3serve node
            self._said.error("gone", f"refused a connection from {peer}: no handshake ({err})")
            sock.close()
            return
        threading.Thread(target=self._read, args=(link,), name=f"h3serve-node{link.node}", daemon=True).start()

    def _handshake(self, sock: socket.socket, peer: str, deadline: float) -> Link:
        plan = self.plan
        hello = receive(sock, HANDSHAKE_MESSAGE, deadline)
        node = hello.get("node")
        if hello.get("protocol") != PROTOCOL or not isinstance(node, int) or not isinstance(hello.get("nonce"), str):
            _refuse(sock, f"not an h3serve node (expected protocol {PROTOCOL})", "dist_init_addr")
            raise NodeRefused(None, f"not an h3serve node (protocol {_short(hello.get('protocol'))})", "protocol")
        lead_nonce = secrets.token_hex(32)
        send(sock, {"nonce": lead_nonce, "proof": proof(plan.key, "lead", node, hello["nonce"], lead_nonce)}, deadline)
        answer = receive(sock, HANDSHAKE_MESSAGE, deadline)
        if "refused" in answer:  # it did not accept our proof
            sock.close()
            raise NodeRefused(node, f"node {node} refused node 0: {_short(answer['refused'])}", "our proof")
        given = answer.get("proof")
        expected = proof(plan.key, "join", node, hello["nonce"], lead_nonce)
        if not isinstance(given, str) or not hmac.compare_digest(given.encode(), expected.encode()):
            check = "no key" if given is None else "another key"
            reason = ("it proved no key" if given is None else "its key is not node 0's") + " (H3_NODE_KEY)"
            _refuse(sock, f"node 0 at {plan.address} refused node {node}: {reason}", "node_key")
            raise NodeRefused(node, f"node {node}: {reason}", check, "node_key")
        if not 1 <= node < plan.nnodes:
            reason = (
                f"node rank {node} is not one of the other nodes of H3_NNODES={plan.nnodes} (1 to {plan.nnodes - 1})"
            )
            _refuse(sock, f"node 0 at {plan.address} refused node {node}: {reason}", "nnodes")
            raise NodeRefused(node, reason, setting="nnodes")
        if found := differences(plan.identity, answer.get("identity")):
            reason = "it runs something else: " + "; ".join(found)
            _refuse(sock, f"node 0 at {plan.address} refused node {node}: {reason}", "model")
            raise NodeRefused(node, f"node {node}: {reason}", setting="model")
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
            send(sock, {"accepted": {"nnodes": plan.nnodes, "world": plan.world}}, deadline)
            sock.settimeout(None)
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
                try:
                    event = messages.decode(message["event"])
                except messages.MessageError as err:  # no node of ours sends it: nothing more is read from it
                    self._lose(link, f"it sent what is no message of ours ({err})")
                    return
                with self._cond:
                    current = message.get("generation") == self._generation and self._links.get(link.node) is link
                sink = self.sink
                if current and sink is not None:
                    sink(event)

    def _beat(self) -> None:
        while not self._closed:
            time.sleep(BEAT_S)
            self._said.flush()
            with self._cond:
                links = list(self._links.values())
            now = time.monotonic()
            for link in links:
                if now - link.last_seen > self.plan.grace_s:
                    self._lose(link, f"no heartbeat for {self.plan.grace_s:g} s (H3_NODE_GRACE)")
                else:
                    self._send(link, {"beat": True})


def _os_text(err: OSError) -> str:
    """`EMFILE: Too many open files`: the errno's name, which the log can be searched for, and its words."""
    name = errno.errorcode.get(err.errno, str(err.errno)) if err.errno is not None else type(err).__name__
    return f"{name}: {err.strerror or err}"


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
    deadline = time.monotonic() + HANDSHAKE_S
    sock = socket.create_connection((plan.host, plan.port), timeout=HANDSHAKE_S)
    try:
        nonce = secrets.token_hex(32)
        send(sock, {"protocol": PROTOCOL, "node": plan.node_rank, "nonce": nonce}, deadline)
        answer = receive(sock, HANDSHAKE_MESSAGE, deadline)
        if "refused" in answer:
            raise _refusal(plan.node_rank, answer)
        lead_nonce, given = answer.get("nonce"), answer.get("proof")
        if not isinstance(lead_nonce, str) or not isinstance(given, str):
            raise NodeRefused(plan.node_rank, f"{plan.address} is not an h3serve node 0 (no key proof)",
                              setting="dist_init_addr")  # fmt: skip
        expected = proof(plan.key, "lead", plan.node_rank, nonce, lead_nonce)
        if not hmac.compare_digest(given.encode(), expected.encode()):
            _refuse(sock, "the keys differ (H3_NODE_KEY): node 0's proof does not match this node's key", "node_key")
            raise NodeRefused(plan.node_rank, f"node 0 at {plan.address} does not hold this node's key (H3_NODE_KEY)",
                              setting="node_key")  # fmt: skip
        send(sock, {"proof": proof(plan.key, "join", plan.node_rank, nonce, lead_nonce), "identity": plan.identity},
             deadline)  # fmt: skip
        answer = receive(sock, HANDSHAKE_MESSAGE, deadline)
        if "refused" in answer:
            raise _refusal(plan.node_rank, answer)
        if "accepted" not in answer:
            raise NodeRefused(plan.node_rank, f"{plan.address} answered no acceptance", setting="dist_init_addr")
        sock.settimeout(None)
        return sock, sock.getsockname()[0]
    except BadMessage as err:
        sock.close()
        raise NodeRefused(
            plan.node_rank, f"{plan.address} is not an h3serve node 0 ({err})", setting="dist_init_addr"
        ) from None
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
                dead = current.dead()
                for event in [*current.events(), *([dead] if dead is not None else [])]:
                    session.send({"event": messages.encode(event), "generation": generation})
                if dead is not None:
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
