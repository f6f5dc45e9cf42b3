"""The messages between the processes of a split (`parallel.messages`): every type sent through both transports
and received equal, the multiprocessing queue between two processes (`Mailbox`, to a spawned process that sends
each back) and the authenticated node link over loopback (a joining node's real loop, `nodes.join_node`, to node 0's
`Rendezvous`); what is not a message of ours refused by the codec naming the type and the field, and on the node
link by losing the node that sent it, with the reason, and nothing else breaking."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch.multiprocessing as mp

from h3serve.accel.profile import Profile
from h3serve.parallel import messages, nodes
from h3serve.parallel.messages import (
    Call,
    Dead,
    Ended,
    EngineInfo,
    Failed,
    Mailbox,
    MessageError,
    Outcome,
    Progress,
    Ready,
    Stop,
    Tick,
)
from h3serve.pipeline.engine import Engine
from parallel_fixtures import echo
from service_fixtures import until
from test_nodes import two_free_ports
from test_nodes_hostile import BOUND_S, plan, read_to_close

# One of every type, as a joined node may send it: every local field empty (rank 0's objects stay on node 0).
WIRE = [
    Ready(1),
    Failed(2, "ValueError: no such checkpoint", input_error=True),
    Failed(3, "RuntimeError: CUDA error"),
    Progress(7, "denoise", 3, 39),
    Outcome(7, 1, Ended.DONE),
    Outcome(7, 2, Ended.CANCELLED),
    Outcome(7, 3, Ended.ERROR, 'RuntimeError: injected fault on rank 3 \u2014 "quoted"', 12),
    Dead(3, "the process (pid 42) on node 1 exited with signal SIGKILL"),
    Call(8, "prepare_tables"),
    Stop(),
    Tick(),
]


def test_the_list_covers_every_message_type():
    assert {type(m) for m in WIRE} == set(messages.MESSAGES.values())


def test_every_message_crosses_the_process_queue_equal_local_fields_included():
    info = EngineInfo.of(Engine.load(None, Profile.for_device("cpu")))
    local = [Ready(0, info), Outcome(9, 0, Ended.DONE, result={"seconds": 1.5, "split": [3, 2]}),
             Call(9, "render", ("a request", 2))]  # fmt: skip
    spawn = mp.get_context("spawn")
    inbox, outbox = Mailbox(spawn), Mailbox(spawn)
    child = spawn.Process(target=echo, args=(inbox, outbox))
    child.start()
    try:
        sent = [*(m for m in WIRE if m != Stop()), *local, Stop()]  # the Stop last: the child sends it back and ends
        for message in sent:
            inbox.put(message)
        back = [until(lambda: outbox.get(timeout=0.1), "a message back", BOUND_S) for _ in sent]
        assert back == sent
        assert back[sent.index(local[0])].info.admission == info.admission
    finally:
        child.join(BOUND_S)
        if child.exitcode is None:
            child.kill()
    assert child.exitcode == 0


class Script:
    """A joined node's ranks (the object `join_node` runs for each start) that report the given events once."""

    def __init__(self, events: list):
        self._events = list(events)

    def events(self) -> list:
        out, self._events = self._events, []
        return out

    def dead(self) -> None:
        return None

    def stop(self) -> None:
        pass


@pytest.fixture
def node0() -> Iterator[tuple[nodes.Rendezvous, int]]:
    port = two_free_ports()
    rendezvous = nodes.Rendezvous(plan(port, 0))
    yield rendezvous, port
    rendezvous.close()


def test_every_message_crosses_the_node_link_equal(node0):
    rendezvous, port = node0
    stopping = threading.Event()
    joiner = threading.Thread(target=nodes.join_node, args=(plan(port, 1), lambda store, g: Script(WIRE), stopping),
                              daemon=True)  # fmt: skip
    joiner.start()
    try:
        rendezvous.wait_joined(BOUND_S)
        received: list = []
        rendezvous.start(received.append)
        until(lambda: len(received) >= len(WIRE), "every message at node 0", BOUND_S)
        assert received == WIRE
        assert [type(m.ended) for m in received if isinstance(m, Outcome)] == [Ended] * 3
        assert rendezvous.problem() is None
    finally:
        stopping.set()
        joiner.join(BOUND_S)


@pytest.mark.parametrize(
    "event, words",
    [
        ({"type": "Shutdown", "rank": 1}, 'a message: unknown type "Shutdown"'),
        (["outcome", 1, 1, "done", None], "a message: not an object (list)"),
        (
            {"type": "Outcome", "seq": "1", "rank": 1, "ended": "done"},
            'message Outcome, field "seq": "1" is not of type int',
        ),
        ({"type": "Ready", "rank": 1, "info": {"name": "x"}}, 'field "info": holds an object of another host'),
    ],
    ids=["unknown type", "no object", "mistyped field", "local field"],
)
def test_what_is_no_message_of_ours_on_the_node_link_loses_that_node_cleanly(node0, event, words, thread_errors):
    rendezvous, port = node0
    sock, _ = nodes.connect(plan(port, 1))
    with sock:
        rendezvous.wait_joined(BOUND_S)
        received: list = []
        rendezvous.start(received.append)
        assert "start" in nodes.receive(sock)
        nodes.send(sock, {"event": event, "generation": 1})
        _, how = read_to_close(sock)  # node 0 closes the link (heartbeats before the close are read past)
    assert how == "closed"
    lost = rendezvous.problem()
    assert lost is not None and lost.node == 1 and "it sent what is no message of ours" in lost.why, lost
    assert words in lost.why
    assert received == [] and rendezvous.missing() == [1] and thread_errors == []


@pytest.fixture
def thread_errors(monkeypatch) -> list[BaseException]:
    seen: list[BaseException] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: seen.append(args.exc_value))
    return seen


def test_the_codec_names_the_type_and_the_field_at_fault():
    cases = [
        ({"type": "Failed", "rank": 1}, "Failed", "message", "missing"),
        ({"type": "Failed", "rank": True, "message": "m"}, "Failed", "rank", "true is not of type int"),
        ({"type": "Dead", "rank": 1, "text": "t", "pid": 4}, "Dead", "pid", "no such field"),
        ({"type": "Outcome", "seq": 1, "rank": 0, "ended": "finished"}, "Outcome", "ended", "is not of type Ended"),
        ({"type": "Outcome", "seq": 1, "rank": 0, "ended": "done", "error": 3}, "Outcome", "error", "str or None"),
        ({"rank": 1}, None, None, "unknown type null"),
    ]
    for data, kind, field, problem in cases:
        with pytest.raises(MessageError) as err:
            messages.decode(data)
        assert (err.value.kind, err.value.field) == (kind, field) and problem in err.value.problem, err.value
    assert messages.decode({"type": "Progress", "seq": 1, "stage": "video", "done": 2, "total": 7}) == Progress(
        1, "video", 2, 7
    )


def test_a_local_field_never_leaves_the_host_and_only_messages_are_encoded():
    with pytest.raises(MessageError, match='field "result": holds an object of this host') as err:
        messages.encode(Outcome(1, 0, Ended.DONE, result=0.5))
    assert err.value.field == "result"
    assert messages.encode(Outcome(1, 0, Ended.DONE, result=0.5), local=True)["result"] == 0.5
    with pytest.raises(MessageError, match="is not a message type"):
        messages.encode(EngineInfo("tiny", None, None, (), 0.0, None))  # type: ignore[arg-type]
