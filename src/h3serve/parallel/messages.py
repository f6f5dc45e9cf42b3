"""What the processes of a split tell each other: typed messages, frozen dataclasses, and one codec for them.

    events (a rank to the pool)   Ready, Failed, Progress, Outcome; Dead (a joined node's rank that exited)
    commands (the pool to ranks)  Call (a method of every rank's `workers.RankWorker`), Stop, Tick

Every transport carries a message as `encode` writes it: a dict of its fields and its class name under "type". The
process queues of one host (`Mailbox`) and rank 0's broadcast of a command in the group carry that dict as it is;
the nodes' connection (`nodes`) carries it as JSON, and nothing there is unpickled. `decode` is the way back on
every transport: a class looked up by name among `MESSAGES` (nothing else is built) and each field checked against
its annotation, so an unknown or malformed message is a `MessageError` naming what is wrong, never a guess.

A field marked LOCAL holds an object of this host (rank 0's engine description, a render's frames in shared
memory, a request): it travels only where `encode` and `decode` are told `local=True`, the process queues and the
group's broadcast. On the nodes' connection it must be empty: rank 0, whose results and description those are,
always runs on node 0, and commands never travel over that connection.
"""

from __future__ import annotations

import dataclasses
import enum
import queue
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from h3serve.errors import shown
from h3serve.pipeline import context

if typing.TYPE_CHECKING:
    from h3serve.checkpoint.adapters import Adapter
    from h3serve.pipeline.admission import Admission
    from h3serve.pipeline.budget import Budget
    from h3serve.pipeline.rules import RequestRules


class MessageError(ValueError):
    """What arrived is no message of ours: `kind` the type it named (None when it named none), `field` the field at
    fault (None for the message as a whole), `problem` what is wrong with it."""

    def __init__(self, kind: str | None, field: str | None, problem: str):
        where = (
            "a message" if kind is None else f"message {kind}" + ("" if field is None else f", field {shown(field)}")
        )
        super().__init__(f"{where}: {problem}")
        self.kind, self.field, self.problem = kind, field, problem


# The metadata of a field that holds an object of this host: it never crosses the nodes' connection (see above).
LOCAL: Mapping[str, bool] = types.MappingProxyType({"local": True})


@dataclass(frozen=True)
class EngineInfo:
    """Rank 0's engine as it describes itself at start: what `ParallelEngine` tells of itself in the parent."""

    name: str
    admission: Admission
    rules: RequestRules
    adapters: tuple[Adapter, ...]
    merge_seconds: float
    budget: Budget

    @classmethod
    def of(cls, engine: Any) -> EngineInfo:
        return cls(engine.name, engine.admission, engine.rules, engine.adapters, engine.merge_seconds,
                   engine.memory_budget())  # fmt: skip


# ---- events ----------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Ready:
    """A rank has loaded its engine; rank 0 says what it is."""

    rank: int
    info: EngineInfo | None = dataclasses.field(default=None, metadata=LOCAL)


@dataclass(frozen=True)
class Failed:
    """A rank failed to start. `input_error`: on what it was given to load (a ValueError or OSError), not the GPUs."""

    rank: int
    message: str
    input_error: bool = False


@dataclass(frozen=True)
class Progress:
    """Rank 0's progress through call `seq` (a render)."""

    seq: int
    stage: str
    done: int
    total: int

    def stage_progress(self) -> context.Progress:
        return context.Progress(self.stage, self.done, self.total)


class Ended(enum.StrEnum):
    DONE = "done"
    CANCELLED = "cancelled"
    ERROR = "error"


@dataclass(frozen=True)
class Outcome:
    """How call `seq` ended on `rank`. An error has the rank's message and the count of collectives it had entered
    (ranks that failed at different counts left the group out of step); `result` is rank 0's return value."""

    seq: int
    rank: int
    ended: Ended
    error: str | None = None
    calls: int = 0
    result: Any = dataclasses.field(default=None, metadata=LOCAL)


@dataclass(frozen=True)
class Dead:
    """A joined node's rank whose process ended other than by a stop, and how (`workers.NodeRanks.dead`)."""

    rank: int
    text: str


# ---- commands --------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Call:
    """Run `method` of every rank's worker with `args` (`workers.RankWorker.CALLS`), as call `seq`."""

    seq: int
    method: str
    args: tuple = dataclasses.field(default=(), metadata=LOCAL)


@dataclass(frozen=True)
class Stop:
    """Leave the group and exit."""


@dataclass(frozen=True)
class Tick:
    """Nothing to do: rank 0's broadcast while idle with several nodes (the others wait in it)."""


Message = Ready | Failed | Progress | Outcome | Dead | Call | Stop | Tick
MESSAGES: Mapping[str, type] = types.MappingProxyType(
    {cls.__name__: cls for cls in (Ready, Failed, Progress, Outcome, Dead, Call, Stop, Tick)}
)


# ---- the codec -------------------------------------------------------------------------------------------------------
def encode(message: Message, *, local: bool = False) -> dict[str, Any]:
    """`message` as a dict of its fields and "type"; JSON-safe unless `local` (then its local fields are kept as they
    are). MessageError for what is not one of `MESSAGES`, or a local field set with `local` False."""
    kind = type(message).__name__
    if MESSAGES.get(kind) is not type(message):
        raise MessageError(None, None, f"{type(message).__qualname__} is not a message type")
    out: dict[str, Any] = {"type": kind}
    for f in dataclasses.fields(message):
        value = getattr(message, f.name)
        if f.metadata.get("local") and not local:
            if not (value is None or value == ()):
                raise MessageError(kind, f.name, "holds an object of this host; it does not leave the host")
            continue
        out[f.name] = value.value if isinstance(value, enum.Enum) else value
    return out


def decode(data: Any, *, local: bool = False) -> Message:
    """The message `encode` wrote (`local`: as its local fields may be present); MessageError naming the type and
    the field for anything else: no object, an unknown type, a missing, unknown or mistyped field."""
    if not isinstance(data, dict):
        raise MessageError(None, None, f"not an object ({type(data).__name__})")
    kind = data.get("type")
    cls = MESSAGES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise MessageError(None, None, f"unknown type {shown(kind, 80)}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    if unknown := sorted(set(data) - set(fields) - {"type"}, key=str):
        raise MessageError(kind, str(unknown[0])[:80], "no such field")  # a name the other side chose: cut short
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for name, f in fields.items():
        if name not in data:
            if f.default is dataclasses.MISSING:
                raise MessageError(kind, name, "missing")
        elif f.metadata.get("local"):
            if not local:
                raise MessageError(kind, name, "holds an object of another host")
            values[name] = data[name]
        else:
            values[name] = _typed(kind, name, hints[name], data[name])
    return cls(**values)


def _typed(kind: str, name: str, hint: Any, value: Any) -> Any:
    """`value` as a field annotated `hint` takes it: int, float, str, bool, a StrEnum, or a union of them with None."""
    for option in _options(hint):
        if option is type(None) and value is None:
            return None
        if option is bool and isinstance(value, bool):
            return value
        if option is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if option is float and isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if option is str and isinstance(value, str):
            return value
        if isinstance(option, type) and issubclass(option, enum.StrEnum) and value in {m.value for m in option}:
            return option(value)
    raise MessageError(kind, name, f"{shown(value, 80)} is not of type {_name(hint)}")


def _options(hint: Any) -> tuple:
    return typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)


def _name(hint: Any) -> str:
    return " or ".join("None" if o is type(None) else getattr(o, "__name__", str(o)) for o in _options(hint))


class Mailbox:
    """A process queue of one host that carries messages (`encode(local=True)`: a render's tensors go by shared
    memory, as torch.multiprocessing sends them). Picklable into the spawned processes."""

    def __init__(self, spawn: Any):
        self._queue = spawn.Queue()

    def put(self, message: Message) -> None:
        self._queue.put(encode(message, local=True))

    def get(self, timeout: float | None = None) -> Message | None:
        """The next message; None when none came within `timeout` (0: none waiting now)."""
        try:
            data = self._queue.get(timeout=timeout) if timeout != 0 else self._queue.get_nowait()
        except queue.Empty:
            return None
        return decode(data, local=True)

    def cancel_join_thread(self) -> None:
        """Unread messages must not hold up this process's exit."""
        self._queue.cancel_join_thread()
