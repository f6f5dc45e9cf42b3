"""Each job's events, for `GET /v1/videos/{id}/events` (server-sent events): queued, each stage as it starts, each
forward's progress, each preview, and the end (completed, failed or cancelled).

`JobEvents` is one job's log: ids from 1 in order, at most `limit` events kept. When it is full the oldest progress
event goes first; stage changes, previews and the end are kept while any progress event is left to drop, and the end
is never dropped. The render only appends (under a lock held for an append), so a slow or absent reader never slows
it: a reader that falls behind misses the progress events dropped meanwhile, and resumes from any id it saw
(`Last-Event-ID`). `Events` holds the logs of the jobs the scheduler knows, forgetting the oldest finished jobs' logs
beyond `keep` (their records still say how they ended), and each job's latest preview, on disk (`previews/<id>.png`
beside `videos/`) until the job is deleted: a preview is one PNG per job, so memory does not grow with the jobs, and
it outlives a restart as the job's record does.

`Streams` bounds and wakes the open event streams of one app. A stream waits on its job's signal on the event loop;
a publish (on the render thread) hands the loop one wake-up if any stream watches that job, and nothing otherwise: the
render's cost per event does not grow with the streams, and no stream polls. The loop sets a job's signal at most
once per WAKE_GAP_S, so however fast a render publishes, each stream writes at most that often, each event's text
made once for all of them. A stream that never reads holds no queue
of its own: it pulls from the job's bounded log when its socket takes more, so what it holds is the transport's
buffer (uvicorn stops writing to a socket that is not read).

In a fleet (a PostgreSQL store: docs/fleet.md, "One API across the fleet") a job's events are made by the server that
holds it, and a client may stream them from any server. The holder's log is the one above; `Relay` copies each event of
a claimed job, with the ids the log gave it, into the database (`job_events`, each job's latest preview PNG in
`job_previews`) and a NOTIFY on commit names the job, so that the other servers wake the streams that watch it, which
read the rows after their last id. Why rows and a short notice rather than the events in NOTIFY payloads: a payload
holds at most 8000 bytes (a preview strip is megabytes), a notice sent while a server's listener reconnects is lost
for it (the rows are not: it reads them again), and the same ids on every server let Last-Event-ID resume anywhere. The
relay runs on a thread of its own, so the render never waits on the database: its backlog is bounded as a log is (the
oldest progress events go first), and a database that does not answer delays the relayed events, never the render.
A job claimed again by another server continues the same ids (`Events.adopt`: its log starts after the stored ones)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import itertools
import json
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from h3serve.files import FileRefused, read_regular
from h3serve.service.store import PLAIN_ID
from h3serve.service.store.claims import Relayed, StoredEvent

log = logging.getLogger(__name__)

LIMIT = 256  # events one job's log keeps
KEEP = 256  # finished jobs whose logs are kept
MAX_STREAMS = 256  # event streams one server holds open at once (each a socket and a waiting coroutine)
# The streams of a job wake at most this often: what came meanwhile goes out as one write. A real render's forward
# takes seconds, but a small one's events come every few milliseconds, and 256 streams each writing each event took
# the loop (and the GIL the render needs) whole: measured on the CPU, bench/event_streams.py.
WAKE_GAP_S = 0.2
PREVIEW_CAP = 64 << 20  # bytes: a preview strip is four frames' PNG (a few MB at the largest canvas)
PREVIEWS = "previews"  # the folder beside videos/ that holds each job's latest preview, <id>.png
TERMINAL = ("completed", "failed", "cancelled")
DROPPABLE = "progress"


@dataclass(frozen=True)
class Event:
    id: int
    name: str  # queued, stage, progress, preview, completed, failed, cancelled
    data: dict[str, Any]

    @functools.cached_property
    def wire(self) -> str:
        """The event as `text/event-stream` lines: made once, however many streams send it."""
        return f"id: {self.id}\nevent: {self.name}\ndata: {json.dumps(self.data, separators=(',', ':'))}\n\n"


class JobEvents:
    def __init__(self, limit: int = LIMIT, history: tuple[StoredEvent, ...] = ()):
        self.limit = limit
        self._events: collections.deque[Event] = collections.deque()
        self._next = 1
        self._lock = threading.Lock()
        self.dropped = 0  # progress events dropped to stay within the limit
        self.ended = False
        for event in history:  # a claimed job's events stored before (its `queued`, an earlier holder's)
            self.publish(event.name, event.data, event.id)

    def publish(self, name: str, data: dict[str, Any], at: int | None = None) -> Event:
        """Append an event (`at`: its id, a stored one's; else the next)."""
        with self._lock:
            if at is not None:
                self._next = max(self._next, at)
            event = Event(self._next, name, data)
            self._next += 1
            self._events.append(event)
            if name in TERMINAL:
                self.ended = True
            while len(self._events) > self.limit:
                victim = next((e for e in self._events if e.name == DROPPABLE), None)
                if victim is None:  # no progress left to drop: the oldest that is not the end
                    victim = next(e for e in self._events if e.name not in TERMINAL)
                self._events.remove(victim)
                self.dropped += 1
            return event

    def since(self, last_id: int) -> tuple[list[Event], bool]:
        """The events after `last_id`, and whether the log has ended (nothing will follow them). From the newest back:
        a reader that keeps up costs the lock only the events it has not seen, not the whole log."""
        with self._lock:
            fresh = []
            for event in reversed(self._events):
                if event.id <= last_id:
                    break
                fresh.append(event)
            return fresh[::-1], self.ended


class Events:
    """The logs and latest previews of the jobs the scheduler knows (see the module docstring). `previews`: the folder
    of the previews (made on the first one); `on_publish(job_id)` is called after each event is logged, on the thread
    that published it (`Streams.poke`)."""

    def __init__(self, previews: Path, keep: int = KEEP, limit: int = LIMIT):
        self.previews = previews
        self.keep = keep
        self.limit = limit
        self.on_publish: Callable[[str], None] | None = None
        self.on_gap: Callable[[], None] | None = None  # `Streams.poke_all`
        self._logs: dict[str, JobEvents] = {}
        self._finished: collections.deque[str] = collections.deque()
        self._lock = threading.Lock()

    def log(self, job_id: str) -> JobEvents | None:
        with self._lock:
            return self._logs.get(job_id)

    def publish(self, job_id: str, name: str, data: dict[str, Any]) -> Event:
        with self._lock:
            log = self._logs.get(job_id)
            if log is None:
                log = self._logs[job_id] = JobEvents(self.limit)
            if name in TERMINAL:
                self._finished.append(job_id)
                while len(self._finished) > self.keep:
                    self._logs.pop(self._finished.popleft(), None)
        event = log.publish(name, data)
        self.poke(job_id)
        return event

    def poke(self, job_id: str) -> None:
        """Wake the streams of `job_id` (an event logged here, or stored by another server: `Scheduler._noticed`)."""
        if self.on_publish is not None:
            self.on_publish(job_id)

    def poke_all(self) -> None:
        """Wake every stream (the fleet's notices may have been missed while the listener reconnected)."""
        if self.on_gap is not None:
            self.on_gap()

    def adopt(self, job_id: str, history: tuple[StoredEvent, ...]) -> None:
        """A job this server has claimed: its log holds the events stored before (its `queued`, an earlier holder's)
        and goes on after their ids, so that every server's streams see one sequence."""
        with self._lock:
            self._logs[job_id] = JobEvents(self.limit, history)

    def moved(self, job_id: str) -> None:
        """This server lost a job's claim to another server: its log goes, and its streams here read the events the
        new holder stores (`app.events` looks for the log at each wake)."""
        with self._lock:
            self._logs.pop(job_id, None)
        self.poke(job_id)

    def _preview_path(self, job_id: str) -> Path:
        # A job's id as the store holds it (store.PLAIN_ID: a plain name); refused here too, so no caller can name a
        # path outside the folder.
        if not PLAIN_ID.fullmatch(job_id):
            raise ValueError(f"not a job id: {job_id!r}")
        return self.previews / f"{job_id}.png"

    def set_preview(self, job_id: str, png: bytes) -> bool:
        """Keep `png` as the job's latest preview: written beside and renamed over the last, so that a reader gets one
        whole PNG or the other. False (logged) when the disk refuses it: the render goes on without it."""
        path = self._preview_path(job_id)
        tmp = path.with_name(f".{path.name}.tmp")
        try:
            self.previews.mkdir(parents=True, exist_ok=True)
            tmp.write_bytes(png)
            os.replace(tmp, path)
        except OSError as err:
            log.warning("the preview of job %s was not kept: %s (%s)", job_id, err.strerror or err, path)
            tmp.unlink(missing_ok=True)
            return False
        return True

    def preview(self, job_id: str) -> bytes | None:
        """The job's latest preview, read as the server wrote it: a regular file of at most PREVIEW_CAP bytes, never
        through a link nor from a FIFO (something put there by hand is no preview: None)."""
        if not PLAIN_ID.fullmatch(job_id):
            return None
        try:
            return read_regular(self._preview_path(job_id), PREVIEW_CAP, follow=False)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except (FileRefused, OSError) as err:
            log.warning("the preview of job %s was not read: %s", job_id, err)
            return None

    def forget(self, job_id: str) -> None:
        """A deleted job: its log and preview go."""
        with self._lock:
            self._logs.pop(job_id, None)
        if PLAIN_ID.fullmatch(job_id):  # (a damaged row's id may be anything: it never had a preview)
            self._preview_path(job_id).unlink(missing_ok=True)


class Relay:
    """Events of claimed jobs on their way to the fleet's database (see the module docstring): `put` (any thread,
    never waits) appends to a backlog that a thread of its own hands to `sink` in batches, in order. A batch the sink
    refuses (the database does not answer) is tried again every `retry_s`, what came meanwhile behind it; beyond
    `limit` waiting events the oldest progress events go first (the rest are kept: stages, previews, ends). `stop`
    sends what is waiting, for at most its `timeout`."""

    def __init__(self, sink: Callable[[list[Relayed]], None], limit: int = 4 * LIMIT, retry_s: float = 0.5):
        self.sink, self.limit, self.retry_s = sink, limit, retry_s
        self.dropped = 0  # progress events dropped to stay within the limit
        self.sent = 0  # events handed to the sink
        self._failing = False  # the sink refused the last batch (logged once, until one goes through)
        self._backlog: collections.deque[Relayed] = collections.deque()
        self._sending = 0  # the backlog's first events, in the sink's hands now: never dropped
        self._cond = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="h3serve-relay", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def put(self, item: Relayed) -> None:
        with self._cond:
            self._backlog.append(item)
            while len(self._backlog) > self.limit:
                waiting = itertools.islice(self._backlog, self._sending, None)
                victim = next((i for i in waiting if i.event.name == DROPPABLE), None)
                if victim is None:
                    break  # only events that must arrive: kept
                self._backlog.remove(victim)
                self.dropped += 1
            self._cond.notify()

    def stop(self, timeout: float = 5.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._backlog and not self._stopping:
                    self._cond.wait()
                if not self._backlog:
                    return
                batch = list(self._backlog)
                self._sending = len(batch)
            try:
                self.sink(batch)
            except Exception as err:
                if not self._failing:
                    log.warning("events not relayed to the fleet yet (%s); retrying every %.1f s", err, self.retry_s)
                    self._failing = True
                with self._cond:
                    self._sending = 0
                    if self._stopping:
                        return  # stopping: what the database does not take now is not waited for
                    self._cond.wait(self.retry_s)
                continue
            if self._failing:
                log.warning("events relayed to the fleet again")
                self._failing = False
            with self._cond:
                for _ in batch:  # the batch is the backlog's front (`put` drops only behind it)
                    self._backlog.popleft()
                self._sending = 0
                self.sent += len(batch)


class Streams:
    """The open event streams of one app (see the module docstring): at most `limit`, each watching one job's signal.
    Used on the event loop, except `poke`, which any publishing thread calls."""

    def __init__(self, limit: int = MAX_STREAMS, gap: float = WAKE_GAP_S):
        self.limit = limit
        self.gap = gap
        self.open = 0  # streams open now
        self.wakes = 0  # wake-ups the loop ran: one per event of a watched job, however many streams watch it
        self._loop: asyncio.AbstractEventLoop | None = None
        self._watches: dict[str, _Watch] = {}

    def claim(self, job_id: str) -> asyncio.Event | None:
        """A stream of `job_id` opens: the signal it waits on, or None when `limit` streams are open."""
        if self.open >= self.limit:
            return None
        self._loop = asyncio.get_running_loop()
        self.open += 1
        watch = self._watches.get(job_id)
        if watch is None:
            watch = self._watches[job_id] = _Watch()
        watch.streams += 1
        return watch.signal

    def release(self, job_id: str) -> None:
        self.open -= 1
        watch = self._watches[job_id]
        watch.streams -= 1
        if watch.streams == 0:
            if watch.timer is not None:
                watch.timer.cancel()
            del self._watches[job_id]

    def release_soon(self, job_id: str) -> None:
        """`release` from any thread (a response finalised by the garbage collector on a worker thread): on the loop,
        which alone touches the counts."""
        loop = self._loop
        if loop is None:
            return
        try:
            here = asyncio.get_running_loop()
        except RuntimeError:
            here = None
        if here is loop:
            self.release(job_id)
            return
        with contextlib.suppress(RuntimeError):  # the loop has closed: no stream is left to count
            loop.call_soon_threadsafe(self.release, job_id)

    def poke(self, job_id: str) -> None:
        """An event of `job_id` was logged (any thread): one wake-up handed to the loop if a stream watches the job."""
        loop = self._loop
        if loop is None or job_id not in self._watches:
            return
        with contextlib.suppress(RuntimeError):  # the loop has closed (the server stopped): no stream left to wake
            loop.call_soon_threadsafe(self._wake, job_id)

    def poke_all(self) -> None:
        """Wake every watched job's streams (any thread)."""
        loop = self._loop
        if loop is None:
            return
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(lambda: [self._wake(job_id) for job_id in list(self._watches)])

    def _wake(self, job_id: str) -> None:
        self.wakes += 1
        watch = self._watches.get(job_id)
        if watch is None or watch.timer is not None:  # nobody watches now, or a wake is already due
            return
        wait = watch.last + self.gap - self._loop.time()
        if wait <= 0:
            self._fire(job_id)
        else:
            watch.timer = self._loop.call_later(wait, self._fire, job_id)

    def _fire(self, job_id: str) -> None:
        watch = self._watches.get(job_id)
        if watch is not None:
            watch.timer, watch.last = None, self._loop.time()
            watch.signal.set()


@dataclass
class _Watch:
    """The streams of one job: how many, the signal they wait on, when it was last set, a wake that is due."""

    signal: asyncio.Event = field(default_factory=asyncio.Event)
    streams: int = 0
    last: float = float("-inf")
    timer: asyncio.TimerHandle | None = None
