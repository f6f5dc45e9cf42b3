"""Each job's events, for `GET /v1/videos/{id}/events` (server-sent events): queued, each stage as it starts, each
forward's progress, each preview, and the end (completed, failed or cancelled).

`JobEvents` is one job's log: ids from 1 in order, at most `limit` events kept. When it is full the oldest progress
event goes first; stage changes, previews and the end are kept while any progress event is left to drop, and the end
is never dropped. The render only appends (under a lock held for an append), so a slow or absent reader never slows
it: a reader that falls behind misses the progress events dropped meanwhile, and resumes from any id it saw
(`Last-Event-ID`). `Events` holds the logs of the jobs the scheduler knows, the latest preview of each (kept until
the job is deleted), and forgets the oldest finished jobs' logs beyond `keep` (their records still say how they ended).
"""

from __future__ import annotations

import collections
import json
import threading
from dataclasses import dataclass
from typing import Any

LIMIT = 256  # events one job's log keeps
KEEP = 256  # finished jobs whose logs are kept (and their previews, until deleted)
TERMINAL = ("completed", "failed", "cancelled")
DROPPABLE = "progress"


@dataclass(frozen=True)
class Event:
    id: int
    name: str  # queued, stage, progress, preview, completed, failed, cancelled
    data: dict[str, Any]

    def wire(self) -> str:
        """The event as `text/event-stream` lines."""
        return f"id: {self.id}\nevent: {self.name}\ndata: {json.dumps(self.data, separators=(',', ':'))}\n\n"


class JobEvents:
    def __init__(self, limit: int = LIMIT):
        self.limit = limit
        self._events: collections.deque[Event] = collections.deque()
        self._next = 1
        self._lock = threading.Lock()
        self.dropped = 0  # progress events dropped to stay within the limit
        self.ended = False

    def publish(self, name: str, data: dict[str, Any]) -> Event:
        with self._lock:
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
        """The events after `last_id`, and whether the log has ended (nothing will follow them)."""
        with self._lock:
            return [e for e in self._events if e.id > last_id], self.ended


class Events:
    """The logs and latest previews of the jobs the scheduler knows (see the module docstring)."""

    def __init__(self, keep: int = KEEP, limit: int = LIMIT):
        self.keep = keep
        self.limit = limit
        self._logs: dict[str, JobEvents] = {}
        self._previews: dict[str, bytes] = {}
        self._finished: collections.deque[str] = collections.deque()
        self._lock = threading.Lock()

    def log(self, job_id: str) -> JobEvents | None:
        with self._lock:
            return self._logs.get(job_id)

    def publish(self, job_id: str, name: str, data: dict[str, Any]) -> None:
        with self._lock:
            log = self._logs.get(job_id)
            if log is None:
                log = self._logs[job_id] = JobEvents(self.limit)
            if name in TERMINAL:
                self._finished.append(job_id)
                while len(self._finished) > self.keep:
                    old = self._finished.popleft()
                    self._logs.pop(old, None)
                    self._previews.pop(old, None)
        log.publish(name, data)

    def set_preview(self, job_id: str, png: bytes) -> None:
        with self._lock:
            self._previews[job_id] = png

    def preview(self, job_id: str) -> bytes | None:
        with self._lock:
            return self._previews.get(job_id)

    def forget(self, job_id: str) -> None:
        """A deleted job: its log and preview go."""
        with self._lock:
            self._logs.pop(job_id, None)
            self._previews.pop(job_id, None)
