"""The scheduler and the store below the HTTP layer, with the real tiny engine: the encoder thread overlaps the next
render (measured against encoding on the GPU worker, and shown deterministically with a held encode), cancellation
in every place a job can be (queued, waiting for the encoder, handing off, encoding), and the store's table derived
from the job record."""

from __future__ import annotations

import contextlib
import sqlite3
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from h3serve.pipeline.context import RenderCancelled
from h3serve.service.metrics import Metrics
from h3serve.service.scheduler import Scheduler, Work
from h3serve.service.schemas import JobError, JobStatus, VideoJob
from h3serve.service.store import COLUMNS, FIELDS, JobStore, job_record, new_job_id
from service_fixtures import tiny_engine

PROMPT = "a kettle on a stove, the whistle rising"


@contextlib.contextmanager
def running(tmp_path: Path, scheduler_class=Scheduler, **options) -> Iterator[Scheduler]:
    store = JobStore(tmp_path)
    options = {"max_queue": 8, "warmup": False, "encoder_threads": 1, **options}
    scheduler = scheduler_class(tiny_engine(), store, metrics=Metrics(), **options)
    scheduler.start()
    try:
        yield scheduler
    finally:
        scheduler.stop()
        store.close()


def job(scheduler: Scheduler, seed: int, steps: int = 4) -> Work:
    """Queue an async job (record and MP4 file) and return its work item."""
    request = tiny_engine().validate(PROMPT, steps=steps, seed=seed)
    work = Work(new_job_id(), request, persist=True)
    scheduler.submit(work, job_record(work.id, request, "h3serve-tiny"))
    return work


def sync_mp4(scheduler: Scheduler, work: Work) -> bytes:
    """The same request rendered as a sync render: the MP4 bytes."""
    again = Work(new_job_id(), work.request, persist=False)
    scheduler.submit(again)
    return again.future.result(60)


def wait_for(condition, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


# ---- throughput: the encoder thread against encoding on the GPU worker --------------------------------------------
# Steps chosen so that a tiny render takes about as long as its encode (about 0.2 s each on one core), the case the
# encoder thread is for: it keeps up, and the worker never waits for it. Torch and x264 get one thread each, so that on
# a CPU host the render leaves a core to the encoder, as a GPU render leaves the CPU to it.
THROUGHPUT_STEPS = 40
ROUNDS = 3


@dataclass(frozen=True)
class Run:
    seconds: float  # from queueing the four jobs to the last one completed
    rendering: float  # of that, the seconds the worker spent rendering (the jobs' inference_time_s)
    files: list[bytes]  # the four MP4 files

    @property
    def idle(self) -> float:
        """The worker's time not rendering: waiting for encodes (inline) or, at the end, for the last one."""
        return self.seconds - self.rendering


def _four_jobs(tmp_path: Path, encode_inline: bool, compare: bool) -> Run:
    """Four async jobs queued at once. `compare`: check each MP4 file against the same request's sync render."""
    with running(tmp_path, encode_inline=encode_inline) as scheduler:
        start = time.perf_counter()
        works = [job(scheduler, seed, THROUGHPUT_STEPS) for seed in range(4)]
        for work in works:
            assert work.future.result(120) == f"{work.id}.mp4"
        seconds = time.perf_counter() - start
        records = [scheduler.store.get(w.id) for w in works]
        assert [r.status for r in records] == [JobStatus.COMPLETED] * 4
        files = [(scheduler.store.videos / f"{w.id}.mp4").read_bytes() for w in works]
        if compare:
            for work, mp4 in zip(works, files, strict=True):
                assert mp4 == sync_mp4(scheduler, work), work.request.seed
    return Run(seconds, sum(r.inference_time_s for r in records), files)


def test_the_encoder_thread_finishes_four_queued_jobs_sooner_than_encoding_on_the_gpu_worker(tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        tiny_engine().render(tiny_engine().validate(PROMPT, steps=2, seed=0))  # a process's first render is slower
        # Interleaved rounds, best of each mode: another process on the machine slows one run, not a whole mode.
        runs: dict[bool, list[Run]] = {True: [], False: []}
        for i in range(ROUNDS):
            for inline in (True, False):
                compare = i == 0 and not inline  # once: each async job's MP4 is its sync render's
                runs[inline].append(_four_jobs(tmp_path / f"{inline}-{i}", inline, compare))
    finally:
        torch.set_num_threads(threads)
    inline, overlapped = (min(runs[mode], key=lambda r: r.seconds) for mode in (True, False))
    print(f"four queued async jobs end to end: encoding on the GPU worker {inline.seconds:.2f} s, "
          f"on the encoder thread {overlapped.seconds:.2f} s; the worker not rendering: {inline.idle:.2f} s, "
          f"{overlapped.idle:.2f} s")  # fmt: skip
    for mode in (True, False):
        print(f"  {'inline' if mode else 'overlapped'}: " + ", ".join(f"{r.seconds:.2f} s" for r in runs[mode]))
    assert all(r.files == runs[False][0].files for r in runs[True] + runs[False])  # the same MP4s every time
    assert overlapped.seconds < inline.seconds, runs
    # What a GPU host gains: the worker no longer waits for each encode, only (at the end) for the last one. This
    # holds however busy the CPU is; the end-to-end gain on a CPU host needs a core free for the encoder.
    assert min(r.idle for r in runs[False]) < min(r.idle for r in runs[True]) / 2, runs


# ---- the overlap, shown deterministically, and cancellation wherever a job is --------------------------------------
class HeldEncoder(Scheduler):
    """The real scheduler whose encoder waits, inside the encode step, until the test lets it write the MP4."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.encoding = threading.Event()
        self.release = threading.Event()

    def _write(self, work: Work):
        self.encoding.set()
        assert self.release.wait(60), "the test never released the encoder"
        return super()._write(work)


def test_cancel_works_while_a_job_waits_hands_off_or_encodes(tmp_path):
    with running(tmp_path, HeldEncoder) as scheduler:
        store, videos = scheduler.store, scheduler.store.videos
        renders = scheduler.metrics.registry.get_sample_value
        first, second, third = job(scheduler, 1), job(scheduler, 2), job(scheduler, 3)
        queued = job(scheduler, 4)
        assert scheduler.encoding.wait(30)  # the first is in its encode
        # While it encodes, the worker renders the next two: the second waits for the encoder, the third (the
        # backlog being full) waits on the worker to hand off. The fourth waits in the queue.
        wait_for(lambda: second.result is not None and third.result is not None, "the next two renders")
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
        assert record.file_name is None and list(videos.iterdir()) == []  # no MP4, no partial file

        # The scheduler goes on: the next job completes, with its file.
        after = job(scheduler, 5)
        assert after.future.result(60) == f"{after.id}.mp4"
        assert store.get(after.id).status == JobStatus.COMPLETED and (videos / f"{after.id}.mp4").is_file()
        assert renders("h3serve_renders_total", {"outcome": "completed"}) == 1
        assert renders("h3serve_renders_total", {"outcome": "cancelled"}) == 3


def test_a_sync_render_cancelled_while_encoding_gives_no_bytes(tmp_path):
    with running(tmp_path, HeldEncoder) as scheduler:
        request = tiny_engine().validate(PROMPT, steps=2, seed=0)
        work = Work(new_job_id(), request, persist=False)
        scheduler.submit(work)
        assert scheduler.encoding.wait(30)
        work.ctx.cancel("the client disconnected")  # as the sync route does on a disconnect or its timeout
        scheduler.release.set()
        with pytest.raises(RenderCancelled, match="the client disconnected"):
            work.future.result(60)


def test_a_shutdown_fails_every_unfinished_job_with_the_reason(tmp_path):
    with running(tmp_path, HeldEncoder) as scheduler:
        store = scheduler.store
        works = [job(scheduler, seed) for seed in range(4)]
        assert scheduler.encoding.wait(30)
        wait_for(lambda: works[1].result is not None and works[2].result is not None, "the next two renders")
        stopper = threading.Thread(target=scheduler.stop)
        stopper.start()
        wait_for(lambda: works[0].ctx.cancelled, "the stop to reach the encoding job")
        scheduler.release.set()
        stopper.join(60)
        for work in works:  # encoding, waiting for the encoder, handing off, queued
            record = store.get(work.id)
            assert (record.status, record.error.code) == (JobStatus.FAILED, "interrupted"), record
        assert list(store.videos.iterdir()) == []


# ---- the store ------------------------------------------------------------------------------------------------------
def test_the_store_columns_are_the_job_record_fields(tmp_path):
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

        # Every field round-trips, each set away from its default.
        full = VideoJob(
            id="video_gen_full", object="video", status=JobStatus.FAILED, progress=37, model="m", prompt="p",
            size="224x128", seconds="0.917", quality="high", created_at=5, completed_at=6, expires_at=7,
            error=JobError(code="render_failed", message="m"), media_type="video/mp4", file_name="f.mp4",
            inference_time_s=1.5, stage_durations={"denoise": 0.25}, peak_memory_mb=12.5, num_gpus=2, task="i2va",
            num_frames=22, num_inference_steps=4, seed=3, flow_shift=6.0, audio_flow_shift=2.5, step_cache="server",
            cached_steps=[1, 3],
        )  # fmt: skip
        unset = [f for f in VideoJob.model_fields if getattr(full, f) == VideoJob.model_fields[f].default]
        assert unset == ["object", "media_type"]  # constants: nothing else to set them to
        store.insert(full)
        assert store.get(full.id) == full
        store.update(full.id, error=None, cached_steps=None, status=JobStatus.COMPLETED)
        back = store.get(full.id)
        assert (back.error, back.cached_steps, back.status) == (None, None, JobStatus.COMPLETED)

        # A name that is not a field is refused (a ValueError, which `python -O` keeps), and nothing is written.
        for bad in ({"status; DROP TABLE jobs": "x"}, {"error_code": "x"}, {"id": "other"}):
            with pytest.raises(ValueError, match="cannot set"):
                store.update(full.id, **bad)
        assert store.get(full.id) == back
    finally:
        store.close()
