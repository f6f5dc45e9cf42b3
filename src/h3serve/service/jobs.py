"""A job's life in the scheduler, as data: the states (`JobState`), the moves allowed between them (`TRANSITIONS`), and
who may make each move (`HELD_BY`). `Scheduler._transition` is the one place that moves a job, and the one writer of
its record, its events and its result; `check_transition` is the rule it applies first.

    (submitted) -> queued -> rendering -> handed_off -> encoding -> completed
                     |           |            |            |
                     +-----------+------------+------------+-----> failed | cancelled

`handed_off` is a state of its own (beyond the six of the design) because it is where who finishes a job changes: a
job waiting for the encoder is nobody's, so a cancel, a shutdown or the worker (its streaming render failed) ends it at
once, while a job the encoder has taken is the encoder's alone to end. A streaming render goes on decoding in both.
"""

from __future__ import annotations

import enum

from h3serve.service.schemas import JobStatus


class JobState(enum.Enum):
    QUEUED = "queued"  # waiting for the GPU worker
    RENDERING = "rendering"  # on the worker: rendering, or rendered whole and waiting for room in the encoder's backlog
    HANDED_OFF = "handed_off"  # waiting for the encoder; a streaming render still decodes its frames
    ENCODING = "encoding"  # the encoder writes its MP4 (from the frames as they come, or whole)
    COMPLETED = "completed"
    FAILED = "failed"  # a render or encode that failed, an MP4 not written, or a shutdown (code interrupted)
    CANCELLED = "cancelled"

    @property
    def ended(self) -> bool:
        return self in ENDED

    @property
    def status(self) -> JobStatus:
        """What the job's record says in this state."""
        return STATUS.get(self, JobStatus.IN_PROGRESS)


ENDED = frozenset({JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED})
STATUS = {
    JobState.QUEUED: JobStatus.QUEUED,
    JobState.COMPLETED: JobStatus.COMPLETED,
    JobState.FAILED: JobStatus.FAILED,
    JobState.CANCELLED: JobStatus.CANCELLED,
}
_STOPS = {JobState.FAILED, JobState.CANCELLED}

# The moves allowed from each state (None: not submitted yet). A job ends once: an ended state has no move.
TRANSITIONS: dict[JobState | None, frozenset[JobState]] = {
    None: frozenset({JobState.QUEUED}),
    JobState.QUEUED: frozenset({JobState.RENDERING, *_STOPS}),
    JobState.RENDERING: frozenset({JobState.HANDED_OFF, *_STOPS}),
    JobState.HANDED_OFF: frozenset({JobState.ENCODING, *_STOPS}),
    JobState.ENCODING: frozenset({JobState.COMPLETED, *_STOPS}),
    **{state: frozenset() for state in ENDED},
}


class Hand(enum.Enum):
    """Who moves a job on: the GPU worker, the encoder thread, or a client's thread (submit, cancel, a shutdown)."""

    WORKER = "worker"
    ENCODER = "encoder"
    CLIENT = "client"


# Who holds a job in each state, the only hand that may move it on; None: a waiting job, moved by whoever comes first
# (under the scheduler's lock): the worker or the encoder taking it, a cancel, a shutdown.
HELD_BY: dict[JobState | None, Hand | None] = {
    None: None,
    JobState.QUEUED: None,
    JobState.RENDERING: Hand.WORKER,
    JobState.HANDED_OFF: None,
    JobState.ENCODING: Hand.ENCODER,
}


def holds(state: JobState | None, hand: Hand) -> bool:
    """Whether `hand` may move a job in `state` on: it has not ended, and it waits or is `hand`'s."""
    return state not in ENDED and HELD_BY[state] in (None, hand)


class IllegalTransition(Exception):
    """A move the table does not allow, or made by a hand that does not hold the job: a bug in the scheduler."""

    def __init__(self, job_id: str, state: JobState | None, to: JobState, hand: Hand):
        held = HELD_BY.get(state)
        why = "not a move of a job's life" if to not in TRANSITIONS[state] else f"the job is the {held.value}'s"
        super().__init__(f"job {job_id}: {state.value if state else 'new'} -> {to.value} by the {hand.value}: {why}")
        self.job_id, self.state, self.to, self.hand = job_id, state, to, hand


def check_transition(job_id: str, state: JobState | None, to: JobState, hand: Hand) -> None:
    """Raise IllegalTransition unless `hand` may move a job from `state` to `to`."""
    if to not in TRANSITIONS[state] or not holds(state, hand):
        raise IllegalTransition(job_id, state, to, hand)
