"""A job's life as a state machine (`service.jobs`), walked through every move of its table with the real scheduler
and the real tiny engine (a split one over 2 gloo processes for a worker process lost mid-render). Renders pause at a
gate (a stage of the engine's progress, or the start of the encode) so the test acts, and at every step the job's
state, its store row, its event log and its result (the future the API answers from) say the same thing."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from pathlib import Path

import pytest

from h3serve.accel.profile import Profile
from h3serve.parallel.workers import ParallelEngine, RankPlace, WorkerError, WorkerSpec, load_rank_engine
from h3serve.pipeline.context import RenderCancelled
from h3serve.pipeline.request import RequestFields
from h3serve.service.jobs import TRANSITIONS, Hand, IllegalTransition, JobState
from h3serve.service.scheduler import Scheduler, Work, WriteFailed
from h3serve.service.store import job_record, new_job_id
from service_fixtures import tiny_engine, until
from test_service_scheduler import running as scheduler_running

Q, R, H, E = JobState.QUEUED, JobState.RENDERING, JobState.HANDED_OFF, JobState.ENCODING
DONE, FAILED, CANCELLED = JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED
ENDS = ("completed", "failed", "cancelled")
LOST = "a lighthouse whose rank 1 process dies mid-render"  # the prompt `dying_engine` arms

# Each way through a job's life, as the tests below walk it (the states `_transition` moved the job to, in order).
WALKS = {
    "completed": [Q, R, H, E, DONE],
    "cancelled while queued": [Q, CANCELLED],
    "cancelled while rendering": [Q, R, CANCELLED],
    "cancelled while handed off": [Q, R, H, CANCELLED],
    "cancelled while encoding": [Q, R, H, E, CANCELLED],
    "a render that raised": [Q, R, FAILED],
    "a render that raised after its hand-off": [Q, R, H, FAILED],
    "an MP4 its folder refused": [Q, R, H, E, FAILED],
    "a worker process lost mid-render": [Q, R, FAILED],
    "queued at a shutdown": [Q, FAILED],
}


class Gate:
    """A pause: `reached` once the job gets there, held until the test `open`s it; `error`, if given, is raised then
    (a render that breaks at that point)."""

    def __init__(self, stage: str = "", error: Exception | None = None):
        self.stage, self.error = stage, error
        self.reached, self.opened = threading.Event(), threading.Event()

    def pass_(self) -> None:
        self.reached.set()
        assert self.opened.wait(120), "the test never opened the gate"
        if self.error is not None:
            raise self.error

    def open(self) -> None:
        self.opened.set()

    def wait(self) -> None:
        assert self.reached.wait(120), "the job never reached the gate"


class Gated:
    """An engine (the real tiny one, or a split one) whose render of a gated seed pauses at the gate's stage: at its
    first progress report, after the scheduler has taken it. Everything else is the engine's own."""

    def __init__(self, engine):
        self.engine = engine
        self.gates: dict[int, Gate] = {}

    def __getattr__(self, name: str):
        return getattr(self.engine, name)

    def gate(self, seed: int, stage: str, error: Exception | None = None) -> Gate:
        self.gates[seed] = Gate(stage, error)
        return self.gates[seed]

    def render(self, request, ctx=None, on_step=None):
        gate = self.gates.get(request.seed)
        if gate is not None:
            report = ctx.on_progress

            def on_progress(p):
                report(p)
                if p.stage == gate.stage and not gate.reached.is_set():
                    gate.pass_()

            ctx.on_progress = on_progress
        return self.engine.render(request, ctx)


class Watched(Scheduler):
    """The real scheduler, noting each job's walk (every state `_transition` moved it to) and pausing the encode of a
    job in `held` at its start until the test opens the gate."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.walked: dict[str, list[JobState]] = {}
        self.held: dict[str, Gate] = {}

    def _transition(self, work, to, hand, **facts):
        with self._cond:
            super()._transition(work, to, hand, **facts)
            self.walked.setdefault(work.id, []).append(to)

    def _write(self, work):
        if work.id in self.held:
            self.held[work.id].pass_()
        return super()._write(work)


def running(tmp_path: Path, engine) -> contextlib.AbstractContextManager[Watched]:
    return scheduler_running(tmp_path, Watched, engine=Gated(engine))


def job(scheduler: Watched, seed: int, hold_encode: bool = False, prompt: str = "a kettle on a stove") -> Work:
    """Queue an async job (record and MP4 file), its encode held at its start if asked."""
    request = scheduler.engine.validate(RequestFields(prompt, steps=4, seed=seed))
    work = Work(new_job_id(), request, persist=True)
    if hold_encode:
        scheduler.held[work.id] = Gate()
    scheduler.submit(work, job_record(work.id, request, "h3serve-tiny"))
    return work


def agree(scheduler: Watched, work: Work, state: JobState) -> None:
    """The job is in `state`, and its store row, its event log and its result say so, each the same."""
    assert work.state is state
    record = scheduler.store.get(work.id)
    events, _ = scheduler.events.log(work.id).since(0)
    ends = [e for e in events if e.name in ENDS]
    assert record.status == state.status and events[0].name == "queued"
    if not state.ended:
        assert not work.future.done() and ends == [], ends
        assert record.completed_at is None and record.error is None and record.file_name is None
        return
    assert work.future.done() and ends == events[-1:]  # one end, the last event
    assert ends[0].name == ends[0].data["status"] == record.status and record.completed_at is not None
    if state is DONE:
        assert work.future.result() == record.file_name == f"{work.id}.mp4" and record.progress == 100
        assert ends[0].data["url"] == f"/v1/videos/{work.id}/content" and record.error is None
        assert (scheduler.store.videos / record.file_name).is_file()
        return
    assert ends[0].data["error"] == record.error.model_dump() and record.file_name is None
    assert not (scheduler.store.videos / f"{work.id}.mp4").exists()
    raised = work.future.exception()
    kind = {"cancelled": RenderCancelled, "interrupted": RenderCancelled, "write_failed": WriteFailed}
    assert isinstance(raised, kind.get(record.error.code, Exception)), (record.error, raised)
    if record.error.code != "render_failed":  # the client's message is the record's
        assert str(raised) == record.error.message


def ended(work: Work) -> bool:
    return work.state is not None and work.state.ended


# ---- the table --------------------------------------------------------------------------------------------------
def test_the_walks_below_take_every_move_of_the_table():
    moves = {(a, b) for a, bs in TRANSITIONS.items() for b in bs}
    walked = {pair for walk in WALKS.values() for pair in zip([None, *walk], walk, strict=False)}
    assert walked == moves


def test_an_illegal_move_raises_and_changes_nothing(tmp_path):
    with running(tmp_path, tiny_engine()) as s:
        work = job(s, 1)
        assert work.future.result(120) == f"{work.id}.mp4"
        agree(s, work, DONE)
        before = (s.store.get(work.id), s.events.log(work.id).since(0)[0])
        with pytest.raises(IllegalTransition) as err:
            s._transition(work, R, Hand.WORKER)
        assert (err.value.job_id, err.value.state, err.value.to) == (work.id, DONE, R)
        assert "completed -> rendering" in str(err.value)
        with pytest.raises(IllegalTransition, match="the job is the encoder's"):  # an encoding job: the encoder's
            s._transition(Work("x", work.request, persist=False, state=E), FAILED, Hand.WORKER)
        assert (s.store.get(work.id), s.events.log(work.id).since(0)[0]) == before
        agree(s, work, DONE)


# ---- every step agrees ---------------------------------------------------------------------------------------
def test_a_job_walks_queued_rendering_handed_off_encoding_completed_and_every_step_agrees(tmp_path):
    with running(tmp_path, tiny_engine()) as s:
        first_render = s.engine.gate(1, "denoise")
        first = job(s, 1, hold_encode=True)  # its encode held: the encoder is busy when the next job is handed off
        first_render.wait()
        agree(s, first, R)
        second_render = s.engine.gate(2, "denoise")
        second = job(s, 2, hold_encode=True)
        agree(s, second, Q)
        first_render.open()
        s.held[first.id].wait()
        agree(s, first, E)
        second_render.wait()
        agree(s, second, R)
        second_render.open()
        until(lambda: second.state is H, "the second job handed off")  # its audio decoded, its frames streaming
        agree(s, second, H)
        s.held[first.id].open()
        s.held[second.id].wait()
        agree(s, first, DONE)
        agree(s, second, E)
        s.held[second.id].open()
        assert second.future.result(120) == f"{second.id}.mp4"
        agree(s, second, DONE)
        assert s.walked[first.id] == s.walked[second.id] == WALKS["completed"]


def test_a_cancel_ends_a_job_in_each_state_and_every_end_agrees(tmp_path):
    with running(tmp_path, tiny_engine()) as s:
        encoding = job(s, 11, hold_encode=True)
        s.held[encoding.id].wait()
        handed = job(s, 12)  # rendered while the encoder is held: waits for it
        gate = s.engine.gate(13, "denoise")
        rendering = job(s, 13)
        queued = job(s, 14)
        gate.wait()  # the worker on the third: the second has rendered and waits for the encoder
        for work, state in ((encoding, E), (handed, H), (rendering, R), (queued, Q)):
            agree(s, work, state)

        # Waiting (for the GPU, for the encoder): ended by the cancel itself, at once.
        for work in (queued, handed):
            assert s.cancel(work.id, "cancelled by the test")
            agree(s, work, CANCELLED)
        # On a thread: the cancel reaches it, and it ends there once it stops (the render at its next step, the
        # encode before its next frame).
        for work, state, release in ((rendering, R, gate), (encoding, E, s.held[encoding.id])):
            assert s.cancel(work.id, "cancelled by the test", wait=0)
            assert work.ctx.cancelled
            agree(s, work, state)
            release.open()
            assert isinstance(work.future.exception(120), RenderCancelled)
            agree(s, work, CANCELLED)
        assert s.walked[queued.id] == WALKS["cancelled while queued"]
        assert s.walked[handed.id] == WALKS["cancelled while handed off"]
        assert s.walked[rendering.id] == WALKS["cancelled while rendering"]
        assert s.walked[encoding.id] == WALKS["cancelled while encoding"]
        after = job(s, 15)  # the scheduler goes on
        assert after.future.result(120) == f"{after.id}.mp4"
        agree(s, after, DONE)


def test_a_render_or_an_encode_that_fails_ends_its_job_once_and_every_end_agrees(tmp_path):
    with running(tmp_path, tiny_engine()) as s:
        bad = s.engine.gate(21, "denoise", RuntimeError("a bad render"))
        broken = job(s, 21)
        bad.wait()
        agree(s, broken, R)
        bad.open()
        assert str(broken.future.exception(120)) == "a bad render"
        agree(s, broken, FAILED)
        assert s.store.get(broken.id).error.code == "render_failed"

        encoding = job(s, 22, hold_encode=True)
        s.held[encoding.id].wait()
        late = s.engine.gate(23, "video", RuntimeError("the decode broke after the hand-off"))
        handed = job(s, 23)  # handed off when its audio was decoded, then its video decode breaks
        late.wait()
        agree(s, handed, H)
        late.open()
        assert "the decode broke" in str(handed.future.exception(120))
        agree(s, handed, FAILED)  # taken back from the encoder's backlog: failed before the encode ahead of it ended
        agree(s, encoding, E)

        videos = s.store.videos
        away = videos.with_name("videos.away")
        videos.rename(away)  # the output folder made unwritable under the held encode (a file in its place)
        try:
            videos.write_bytes(b"not a folder")
            s.held[encoding.id].open()
            assert isinstance(encoding.future.exception(120), WriteFailed)
            agree(s, encoding, FAILED)
        finally:
            videos.unlink()
            away.rename(videos)
        assert s.store.get(encoding.id).error.code == "write_failed"
        assert s.walked[broken.id] == WALKS["a render that raised"]
        assert s.walked[handed.id] == WALKS["a render that raised after its hand-off"]
        assert s.walked[encoding.id] == WALKS["an MP4 its folder refused"]


def test_a_shutdown_fails_a_queued_job_as_interrupted_and_it_agrees(tmp_path):
    with running(tmp_path, tiny_engine()) as s:
        gate = s.engine.gate(24, "denoise")
        busy = job(s, 24)
        gate.wait()
        waiting = job(s, 25)
        agree(s, waiting, Q)
        stopper = threading.Thread(target=s.stop)
        stopper.start()
        until(lambda: ended(waiting), "the stop to end the queued job")
        gate.open()  # the render sees the stop at its next step
        stopper.join(120)
        for work in (waiting, busy):
            agree(s, work, FAILED)
            assert s.store.get(work.id).error.code == "interrupted"
        assert s.walked[waiting.id] == WALKS["queued at a shutdown"]
        assert s.walked[busy.id] == WALKS["a render that raised"]


# ---- a worker process lost mid-render -----------------------------------------------------------------------------
def dying_engine(spec: WorkerSpec, place: RankPlace):
    """An `engine_factory` of the split engine, run in each spawned worker: rank 1 kills itself (SIGKILL) at its second
    DiT forward of a render whose prompt is LOST, so its process is lost mid-render at a known point."""
    engine = load_rank_engine(spec, place)
    if place.rank != 1:
        return engine
    render, state = engine.render, {"armed": False, "calls": 0}

    def armed_render(request, ctx=None, on_step=None):
        state.update(armed=request.prompt == LOST, calls=0)
        return render(request, ctx, on_step)

    def hook(module, args):
        if state["armed"]:
            state["calls"] += 1
            if state["calls"] == 2:  # the second forward: the first went through every collective
                os.kill(os.getpid(), signal.SIGKILL)

    engine.render = armed_render
    for dit in engine.components.dits.values():
        dit.blocks[0].register_forward_pre_hook(hook)
    return engine


@pytest.fixture(scope="module")
def split():
    engine = ParallelEngine(WorkerSpec(None, Profile.for_device("cpu"), 2, cpu_threads=1), engine_factory=dying_engine)
    yield engine
    engine.close()


def test_a_render_whose_worker_process_is_lost_fails_its_job_and_it_agrees(tmp_path, split):
    with running(tmp_path, split) as s:
        gate = s.engine.gate(31, "denoise")
        work = job(s, 31, prompt=LOST)
        gate.wait()
        agree(s, work, R)
        gate.open()
        assert isinstance(work.future.exception(120), WorkerError)
        agree(s, work, FAILED)
        assert s.store.get(work.id).error.code == "render_failed"
        assert s.walked[work.id] == WALKS["a worker process lost mid-render"]
        # The workers start again (`problem` says so meanwhile); the next job renders on them.
        until(lambda: split.problem is None, "the workers started again", bound=240)
        after = job(s, 32)
        assert after.future.result(240) == f"{after.id}.mp4"
        agree(s, after, DONE)
