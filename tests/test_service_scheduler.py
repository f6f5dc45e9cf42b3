"""The scheduler and the store below the HTTP layer, with the real tiny engine: the encoder thread overlaps the next
render (shown by order with a held encode, never timed) and the job's own decode (its frames streamed into the MP4),
cancellation in every place a job can be (queued, waiting for the encoder, handing off, encoding, decoding while
encoding), a render failing mid-stream, and the store's table derived from the job record."""

from __future__ import annotations

import contextlib
import io
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from h3serve.media.encoding import Encoding
from h3serve.media.mp4 import encode_mp4
from h3serve.pipeline.context import RenderCancelled
from h3serve.pipeline.request import RequestFields
from h3serve.service.jobs import JobState
from h3serve.service.metrics import Metrics
from h3serve.service.scheduler import Scheduler, Work
from h3serve.service.schemas import JobStatus, VideoJob
from h3serve.service.store import COLUMNS, FIELDS, JobStore, job_record, new_job_id, open_store
from service_fixtures import tiny_engine

PROMPT = "a kettle on a stove, the whistle rising"


@contextlib.contextmanager
def running(
    tmp_path: Path, scheduler_class=Scheduler, engine=None, store_url: str | None = None, **options
) -> Iterator[Scheduler]:
    """A started scheduler over a job store for `tmp_path` (SQLite in it, or PostgreSQL at `store_url`; the tiny engine
    unless `engine`), stopped afterwards."""
    store = open_store(tmp_path, store_url)
    options = {"max_queue": 8, "warmup": False, "encoding": Encoding(threads=1), **options}
    scheduler = scheduler_class(tiny_engine() if engine is None else engine, store, metrics=Metrics(), **options)
    scheduler.start()
    try:
        yield scheduler
    finally:
        scheduler.stop()
        store.close()


def job(scheduler: Scheduler, seed: int, steps: int = 4) -> Work:
    """Queue an async job (record and MP4 file) and return its work item."""
    request = tiny_engine().validate(RequestFields(PROMPT, steps=steps, seed=seed))
    work = Work(new_job_id(), request, persist=True)
    scheduler.submit(work, job_record(work.id, request, "h3serve-tiny"))
    return work


def sync_mp4(scheduler: Scheduler, work: Work) -> bytes:
    """The same request rendered as a sync render: the MP4 bytes."""
    again = Work(new_job_id(), work.request, persist=False)
    scheduler.submit(again)
    return again.future.result(60)


def handing_off(work: Work) -> bool:
    """The job's render has decoded its audio and waits to hand its frames to the encoder (the backlog full)."""
    return work.stream is not None and work.state is JobState.RENDERING


def wait_for(condition, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


# ---- the overlap, shown by order, and cancellation wherever a job is ---------------------------------------------
class HeldEncoder(Scheduler):
    """The real scheduler whose encoder waits, inside the encode step, until the test lets it write the MP4."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.in_encode = threading.Event()
        self.release = threading.Event()

    def _write(self, work: Work):
        self.in_encode.set()
        assert self.release.wait(60), "the test never released the encoder"
        return super()._write(work)


def test_the_worker_renders_the_next_jobs_while_the_encoder_writes_the_previous_ones_mp4(tmp_path):
    """The overlap the encoder thread is for, by order and not by the clock: with the first job's MP4 held inside its
    encode, the worker still renders the next two (the second then waits for the encoder, the third, its audio
    decoded, waits to hand its frames off), and once released all four complete, each MP4 the same request's sync
    render, byte for byte."""
    with running(tmp_path, HeldEncoder) as scheduler:
        works = [job(scheduler, seed) for seed in range(4)]
        assert scheduler.in_encode.wait(30)  # the first job is in its encode, held there
        wait_for(lambda: works[1].result is not None and handing_off(works[2]), "the next two renders")
        assert not works[0].future.done() and scheduler.store.get(works[0].id).status == JobStatus.IN_PROGRESS
        assert scheduler.depth == 1  # the fourth waits for the worker, which waits to hand the third off
        scheduler.release.set()
        for work in works:
            assert work.future.result(60) == f"{work.id}.mp4"
        assert [scheduler.store.get(w.id).status for w in works] == [JobStatus.COMPLETED] * 4
        for work in works:
            assert (scheduler.store.videos / f"{work.id}.mp4").read_bytes() == sync_mp4(scheduler, work)


def test_cancel_works_while_a_job_waits_hands_off_or_encodes(tmp_path):
    with running(tmp_path, HeldEncoder) as scheduler:
        store, videos = scheduler.store, scheduler.store.videos
        renders = scheduler.metrics.registry.get_sample_value
        first, second, third = job(scheduler, 1), job(scheduler, 2), job(scheduler, 3)
        queued = job(scheduler, 4)
        assert scheduler.in_encode.wait(30)  # the first is in its encode
        # While it encodes, the worker renders the next two: the second waits for the encoder, the third (the
        # backlog being full) waits to hand its frames off. The fourth waits in the queue.
        wait_for(lambda: second.result is not None and handing_off(third), "the next two renders")
        assert store.get(first.id).status == JobStatus.IN_PROGRESS and not first.future.done()
        assert scheduler.depth == 1

        for work in (queued, second, third):
            assert scheduler.cancel(work.id, "cancelled by the test")
            record = store.get(work.id)
            assert (record.status, record.error.code) == (JobStatus.CANCELLED, "cancelled"), record
            with pytest.raises(RenderCancelled):
                work.future.result(0)
        assert scheduler.depth == 0
        assert renders("h3serve_renders_total", {"outcome": "cancelled"}) == 2  # the two that had rendered

        # Cancelled while encoding: the encode cannot stop midway, so `cancel` returns once it has, and its file goes.
        cancelled = []
        canceller = threading.Thread(target=lambda: cancelled.append(scheduler.cancel(first.id, "cancelled mid-MP4")))
        canceller.start()
        wait_for(lambda: first.ctx.cancelled, "the cancel to reach the encoding job")
        assert canceller.is_alive()  # waiting for the encode
        scheduler.release.set()
        canceller.join(60)
        assert cancelled == [True]
        record = store.get(first.id)
        assert (record.status, record.error.code, record.error.message) == (
            JobStatus.CANCELLED,
            "cancelled",
            "cancelled mid-MP4",
        )
        # No MP4, no partial file: only the finished jobs' records beside where their MP4s would be.
        assert record.file_name is None and [p for p in videos.iterdir() if p.suffix != ".json"] == []
        assert sorted(p.stem for p in videos.glob("*.json")) == sorted(w.id for w in (first, second, third, queued))

        # The scheduler goes on: the next job completes, with its file.
        after = job(scheduler, 5)
        assert after.future.result(60) == f"{after.id}.mp4"
        assert store.get(after.id).status == JobStatus.COMPLETED and (videos / f"{after.id}.mp4").is_file()
        assert renders("h3serve_renders_total", {"outcome": "completed"}) == 1
        assert renders("h3serve_renders_total", {"outcome": "cancelled"}) == 3


def test_a_sync_render_cancelled_while_encoding_gives_no_bytes(tmp_path):
    with running(tmp_path, HeldEncoder) as scheduler:
        request = tiny_engine().validate(RequestFields(PROMPT, steps=2, seed=0))
        work = Work(new_job_id(), request, persist=False)
        scheduler.submit(work)
        assert scheduler.in_encode.wait(30)
        work.ctx.cancel("the client disconnected")  # as the sync route does on a disconnect or its timeout
        scheduler.release.set()
        with pytest.raises(RenderCancelled, match="the client disconnected"):
            work.future.result(60)


def test_a_shutdown_fails_every_unfinished_job_with_the_reason(tmp_path, backend):
    with running(tmp_path, HeldEncoder, store_url=backend.url) as scheduler:
        store = scheduler.store
        works = [job(scheduler, seed) for seed in range(4)]
        assert scheduler.in_encode.wait(30)
        wait_for(lambda: works[1].result is not None and handing_off(works[2]), "the next two renders")
        stopper = threading.Thread(target=scheduler.stop)
        stopper.start()
        wait_for(lambda: works[0].ctx.cancelled, "the stop to reach the encoding job")
        scheduler.release.set()
        stopper.join(60)
        for work in works:  # encoding, waiting for the encoder, handing off, queued
            record = store.get(work.id)
            assert (record.status, record.error.code) == (JobStatus.FAILED, "interrupted"), record
        # No MP4 left; SQLite's store keeps each finished job's record beside where its MP4 would be (PostgreSQL's
        # store has none: the database is restored from its own backups, not rebuilt from the folder).
        sidecars = sorted(f"{w.id}.json" for w in works) if backend.url is None else []
        assert sorted(p.name for p in store.videos.iterdir()) == sidecars


# ---- frames streamed into the encode while the render decodes them ------------------------------------------------
class EncodeSeen(Scheduler):
    """The real scheduler, noting for each job whether its encode began before its render had returned."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.began: dict[str, bool] = {}
        self.in_encode = threading.Event()

    def _write(self, work: Work):
        self.began[work.id] = work.result is None
        self.in_encode.set()
        return super()._write(work)


def frames_through(scheduler: Scheduler, monkeypatch, after_put=None) -> None:
    """Each render's sink (the scheduler's) behind one whose `put` first waits until the encoder has begun the job's
    MP4 (so the order below is not the clock's), then hands the frames on, then calls `after_put(ctx)`."""
    engine = scheduler.engine
    real = engine.render

    def render(request, ctx):
        sink = ctx.frames_to

        class Behind:
            def begin(self, *args):
                sink.begin(*args)

            def put(self, frames):
                assert scheduler.in_encode.wait(30), "the encoder never began this job's MP4"
                sink.put(frames)
                if after_put is not None:
                    after_put(ctx)

        ctx.frames_to = Behind()
        return real(request, ctx)

    monkeypatch.setattr(engine, "render", render)


def test_a_jobs_frames_stream_into_its_mp4_while_it_decodes(tmp_path, monkeypatch):
    """The encode overlaps the job's own decode, by order: its first frames wait until the encoder has begun its MP4,
    which it began before the render returned. The MP4 is byte for byte the encode of the same request's frames
    returned whole."""
    with running(tmp_path, EncodeSeen) as scheduler:
        whole = scheduler.engine.render  # the engine's own, before the wrap: frames returned whole
        frames_through(scheduler, monkeypatch)
        work = job(scheduler, 7)
        assert work.future.result(60) == f"{work.id}.mp4"
        assert scheduler.began == {work.id: True}
        assert scheduler.store.get(work.id).status == JobStatus.COMPLETED
        result = whole(work.request)
        assert result.frames is not None
        expected = io.BytesIO()
        media = {"fps": result.fps, "sample_rate": result.sample_rate}
        encode_mp4(expected, result.frames, result.audio, **media, encoding=Encoding(threads=1))
        assert (scheduler.store.videos / f"{work.id}.mp4").read_bytes() == expected.getvalue()


def test_a_render_failing_while_its_frames_stream_fails_the_job_once_and_keeps_no_file(tmp_path, monkeypatch):
    def broken(ctx):
        raise RuntimeError("the decode broke after its first frames")

    with running(tmp_path, EncodeSeen) as scheduler:
        real = scheduler.engine.render
        frames_through(scheduler, monkeypatch, broken)
        work = job(scheduler, 8)
        with pytest.raises(RuntimeError, match="the decode broke"):
            work.future.result(60)
        assert scheduler.began == {work.id: True}
        record = scheduler.store.get(work.id)
        assert (record.status, record.error.code) == (JobStatus.FAILED, "render_failed")
        assert record.error.message.startswith("the render failed"), record.error.message  # the render's, not the MP4's
        assert record.file_name is None and [p for p in scheduler.store.videos.iterdir() if p.suffix != ".json"] == []
        outcomes = scheduler.metrics.registry.get_sample_value
        assert outcomes("h3serve_renders_total", {"outcome": "failed"}) == 1
        monkeypatch.setattr(scheduler.engine, "render", real)  # the scheduler goes on
        after = job(scheduler, 9)
        assert after.future.result(60) == f"{after.id}.mp4"


def test_a_cancel_while_the_frames_stream_ends_the_job_once(tmp_path, monkeypatch):
    """Cancelled while its render decodes and the encoder reads its frames: one outcome (cancelled, counted once),
    no MP4 and no partial file, and the next job completes."""
    ids: list[str] = []
    answers: list[bool] = []

    def cancel(ctx):
        if not answers:
            wait_for(lambda: ids, "the job's id")
            answers.append(scheduler.cancel(ids[0], "cancelled mid-decode", wait=0))

    with running(tmp_path, EncodeSeen) as scheduler:
        real = scheduler.engine.render
        frames_through(scheduler, monkeypatch, cancel)
        work = job(scheduler, 10)
        ids.append(work.id)
        with pytest.raises(RenderCancelled):
            work.future.result(60)
        assert answers == [True]
        record = scheduler.store.get(work.id)
        assert (record.status, record.error.code, record.error.message) == (
            JobStatus.CANCELLED,
            "cancelled",
            "cancelled mid-decode",
        )
        assert record.file_name is None and [p for p in scheduler.store.videos.iterdir() if p.suffix != ".json"] == []
        outcomes = scheduler.metrics.registry.get_sample_value
        assert outcomes("h3serve_renders_total", {"outcome": "cancelled"}) == 1
        assert outcomes("h3serve_renders_total", {"outcome": "failed"}) is None
        events, _ = scheduler.events.log(work.id).since(0)
        assert events[-1].name == "cancelled"  # the render winding down published nothing after the end
        assert work.sink is None and work.stream is None  # nor holds its frames
        monkeypatch.setattr(scheduler.engine, "render", real)
        after = job(scheduler, 11)
        assert after.future.result(60) == f"{after.id}.mp4"


def test_a_render_failing_while_it_waits_for_the_encoder_fails_at_once_not_after_the_encode_ahead(
    tmp_path, monkeypatch
):
    """The first job's MP4 held in its encode; the second, handed off when its audio was decoded, fails in its decode:
    it is taken back from the encoder's queue and failed on the worker then (logged, no file), while the first still
    encodes; the first then completes."""

    def broken(ctx):
        raise RuntimeError("the decode broke while the encoder was busy")

    with running(tmp_path, HeldEncoder) as scheduler:
        first = job(scheduler, 12)
        assert scheduler.in_encode.wait(30)  # the first is in its encode, held there
        frames_through(scheduler, monkeypatch, broken)  # (its encoder has begun: the first job's, held)
        second = job(scheduler, 13)
        with pytest.raises(RuntimeError, match="the encoder was busy"):
            second.future.result(60)
        assert not first.future.done()  # failed before the encode ahead of it ended
        record = scheduler.store.get(second.id)
        assert (record.status, record.error.code) == (JobStatus.FAILED, "render_failed")
        assert second.stream is None and second.sink is None  # its frames let go
        scheduler.release.set()
        assert first.future.result(60) == f"{first.id}.mp4"
        assert sorted(p.name for p in scheduler.store.videos.iterdir() if p.suffix != ".json") == [f"{first.id}.mp4"]


# ---- the store ------------------------------------------------------------------------------------------------------
def test_the_store_columns_are_the_job_record_fields(tmp_path):
    """SQLite's table; every field's round trip, against both stores, is in test_store_backends.py."""
    assert tuple(VideoJob.model_fields) == FIELDS
    store = JobStore(tmp_path)
    try:
        db = sqlite3.connect(tmp_path / "jobs.sqlite3")
        table = [(row[1], row[2], bool(row[3])) for row in db.execute("PRAGMA table_info(jobs)")]
        db.close()
        assert [name for name, _, _ in table] == [c.name for c in COLUMNS]
        assert {name for name, _, _ in table} >= {"error_code", "error_message", "stage_durations", "cached_steps"}
        kinds = {name: kind for name, kind, _ in table}
        assert (kinds["progress"], kinds["inference_time_s"], kinds["prompt"]) == ("INTEGER", "REAL", "TEXT")
        not_null = {name for name, _, flag in table if flag}
        assert {"id", "status", "created_at", "seed"} <= not_null and "completed_at" not in not_null
    finally:
        store.close()
