"""One render split over several processes (Ulysses sequence parallelism, gloo on the CPU) on the tiny model, whose
4 attention heads divide by 2 and 4: the same frames, audio and MP4 bytes as one process for every task, the step
cache on; a rank that fails, a worker that dies, a cancel; the settings' refusals. The workers are real spawned
processes running the real engine; `parallel_fixtures.faulty_engine` only arms a fault for a named prompt."""

from __future__ import annotations

import io
import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from h3serve.accel.profile import Profile
from h3serve.media.mp4 import encode_mp4
from h3serve.model.tiny import TINY_DIT
from h3serve.parallel.group import row_ranges
from h3serve.parallel.plan import check_split
from h3serve.parallel.workers import ParallelEngine, WorkerError, WorkerSpec
from h3serve.pipeline.context import RenderCancelled, RenderContext
from h3serve.pipeline.engine import Engine
from h3serve.pipeline.request import RequestFields
from h3serve.settings import SettingsError, load_settings
from h3serve.vocab import TaskType
from parallel_fixtures import FAULT_ALL, FAULT_ONE, FAULT_TEXT, faulty_engine, tile_batching_engine
from service_fixtures import png_bytes
from test_ref2va_render import wav
from test_stepcache_engine import CACHING

CPU = Profile.for_device("cpu")
PROMPT = "A red fox trots through fresh snow at dawn."


def spec(num_gpus: int, **kwargs) -> WorkerSpec:
    return WorkerSpec(None, CPU, num_gpus, task_type=TaskType.BOTH, step_cache=CACHING, cpu_threads=1, **kwargs)


@pytest.fixture(scope="module")
def one():
    """The one-process render, at one thread as each worker: a CPU GEMM split over threads can round a row
    differently with the row count (seen at 2 threads: one value of 914 audio samples in a Ref2VA render)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield Engine.load(None, CPU, task_type=TaskType.BOTH, step_cache=CACHING)
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def two():
    engine = ParallelEngine(spec(2), engine_factory=faulty_engine)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def four():
    engine = ParallelEngine(spec(4))
    yield engine
    engine.close()


# Each request's packed rows do not divide by 2 or 4, so the ranks hold uneven row counts.
REQUESTS = {
    "t2va": dict(task="t2va", steps=10, seed=1, num_frames=22),
    "fl2va": dict(task="fl2va", steps=8, seed=2, keyframes=[png_bytes(96, 64, 1), png_bytes(96, 64, 2)]),
    "ref2va": dict(task="ref2va", steps=8, seed=3, references=[png_bytes(80, 48, 3), wav()]),
    # 2 x 2 decode tiles per window, 2 windows: 8 tiles dealt over the ranks (not only whole windows)
    "t2va-tiles": dict(task="t2va", steps=8, seed=4, num_frames=39, width=448, height=320),
}


def mp4_bytes(result) -> bytes:
    buffer = io.BytesIO()
    encode_mp4(buffer, result.frames, result.audio, fps=result.fps, sample_rate=result.sample_rate)
    return buffer.getvalue()


@pytest.mark.parametrize("task", REQUESTS)
def test_a_split_render_is_bit_for_bit_the_one_process_render(one, two, four, task):
    reference = one.render(one.validate(RequestFields(PROMPT, **REQUESTS[task])))
    assert reference.step_cache.cached, "the step cache must skip forwards for this test to cover it"
    for engine in (two, four):
        result = engine.render(engine.validate(RequestFields(PROMPT, **REQUESTS[task])))
        rows = result.split
        assert len(rows) == engine.num_gpus and len(set(rows)) > 1, rows  # uneven: no padding anywhere
        assert rows == tuple(b - a for a, b in row_ranges(sum(rows), engine.num_gpus))
        np.testing.assert_array_equal(result.frames, reference.frames)
        np.testing.assert_array_equal(result.audio, reference.audio)
        assert result.step_cache.cached == reference.step_cache.cached
        assert mp4_bytes(result) == mp4_bytes(reference)


def test_ranks_decoding_their_tiles_in_batches_give_the_one_process_frames(one):
    """Each rank's tiles of a window in batches of 2 (`parallel.ranks.DealtTiles`: each rank decodes its own through
    `video_decode.rank_tiles`): 2 x 2 tiles per window dealt over 2 ranks, so each rank runs one batch a window."""
    engine = ParallelEngine(spec(2), engine_factory=tile_batching_engine)
    try:
        request = REQUESTS["t2va-tiles"]
        result = engine.render(engine.validate(RequestFields(PROMPT, **request)))
        np.testing.assert_array_equal(result.frames, one.render(one.validate(RequestFields(PROMPT, **request))).frames)
    finally:
        engine.close()


def test_a_split_render_hands_a_sink_its_audio_then_its_frames_whole(two, tmp_path):
    """`ParallelEngine` with `RenderContext.frames_to`: rank 0's frames reach the parent whole, so the sink gets the
    audio and then every frame at once; the MP4 is the bytes of the array's."""
    from h3serve.media.mp4 import Mp4Writer, write_mp4

    request = two.validate(RequestFields(PROMPT, **REQUESTS["t2va"]))
    whole = two.render(request)
    writer = Mp4Writer(tmp_path / "streamed.mp4")
    streamed = two.render(request, RenderContext(frames_to=writer))
    writer.finish()
    assert streamed.frames is None and writer.frames == len(whole.frames)
    write_mp4(tmp_path / "whole.mp4", whole.frames, whole.audio, fps=whole.fps, sample_rate=whole.sample_rate)
    assert (tmp_path / "streamed.mp4").read_bytes() == (tmp_path / "whole.mp4").read_bytes()


def test_rows_are_split_in_contiguous_near_even_ranges():
    assert row_ranges(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert row_ranges(8, 2) == [(0, 4), (4, 8)]
    with pytest.raises(ValueError, match="at least one row"):
        row_ranges(3, 4)


def test_a_cancel_reaches_every_rank_and_the_next_render_works(one, two):
    started = threading.Event()
    steps: list[tuple[int, int]] = []

    def on_progress(p):
        if p.stage == "denoise" and p.done:
            steps.append((p.done, p.total))
        if p.stage == "denoise" and p.done >= 2:
            started.set()
            ctx.cancel("client went away")

    ctx = RenderContext(on_progress)
    request = two.validate(RequestFields(PROMPT, steps=40, seed=5, num_frames=22))
    with pytest.raises(RenderCancelled, match="client went away"):
        two.render(request, ctx)
    assert started.is_set()
    done, total = steps[-1]
    assert total == 39 and done < total, steps  # stopped inside the denoise, not after its 39 forwards
    assert two.problem is None  # a cancel is agreed: no worker is lost
    again = two.render(two.validate(RequestFields(PROMPT, **REQUESTS["t2va"])))
    np.testing.assert_array_equal(
        again.frames, one.render(one.validate(RequestFields(PROMPT, **REQUESTS["t2va"]))).frames
    )


def test_the_split_engine_has_every_member_of_the_render_engine_interface(two):
    from h3serve.pipeline.engine import RenderEngine
    from test_startup import interface

    assert [m for m in sorted(interface(RenderEngine)) if not hasattr(two, m)] == []
    assert two.num_gpus == 2 and two.problem is None


def test_a_render_failing_on_every_rank_alike_fails_and_the_workers_stay(two):
    pids = [p.pid for p in two.pool.procs]
    with pytest.raises(WorkerError, match="injected fault on rank"):
        two.render(two.validate(RequestFields(FAULT_ALL, steps=4, seed=1)))
    assert two.problem is None and [p.pid for p in two.pool.procs] == pids
    assert two.render(two.validate(RequestFields(PROMPT, steps=3, seed=1))).frames.shape[0] > 0


def test_a_failure_in_a_stage_only_rank_0_runs_ends_it_on_every_rank_and_the_workers_stay(two):
    pids = [p.pid for p in two.pool.procs]
    with pytest.raises(WorkerError, match="rank 0: RuntimeError: injected text-encoder fault on rank 0"):
        two.render(two.validate(RequestFields(FAULT_TEXT, steps=4, seed=1)))
    # The other rank was told and ended the render too: no grace period was waited out, which would have restarted
    # the workers ("failed alone", `workers.ERROR_GRACE_S`); the same processes serve the next render.
    assert two.problem is None and [p.pid for p in two.pool.procs] == pids
    assert two.render(two.validate(RequestFields(PROMPT, steps=3, seed=1))).frames.shape[0] > 0


def test_a_rank_failing_alone_fails_the_render_with_its_message_and_the_workers_restart(two):
    with pytest.raises(WorkerError, match="rank 1: RuntimeError: injected fault on rank 1"):
        two.render(two.validate(RequestFields(FAULT_ONE.format(rank=1), steps=4, seed=1)))
    # The others waited in a collective; the parent ended the render after its grace period ("failed alone"), not
    # after the collective's 600 s timeout (whose error would have come from rank 0).
    assert two.problem is not None and "rank 1 failed alone" in two.problem, two.problem
    with pytest.raises(RuntimeError, match="restarting the GPU workers"):
        two.render(two.validate(RequestFields(PROMPT, steps=3, seed=1)))
    wait_usable(two)
    assert two.render(two.validate(RequestFields(PROMPT, steps=3, seed=1))).frames.shape[0] > 0


def test_a_killed_worker_makes_the_engine_unusable_with_the_reason_then_it_restarts(two):
    victim = two.pool.procs[1]
    os.kill(victim.pid, signal.SIGKILL)
    deadline = time.monotonic() + 60  # a bound on a broken server only: polled, not waited out
    while two.problem is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert two.problem is not None and "rank 1" in two.problem and "SIGKILL" in two.problem, two.problem
    wait_usable(two)
    assert two.pool.procs[1].pid != victim.pid
    assert two.render(two.validate(RequestFields(PROMPT, steps=3, seed=1))).frames.shape[0] > 0


def wait_usable(engine: ParallelEngine, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while engine.problem is not None:
        assert "did not restart" not in engine.problem, engine.problem
        assert time.monotonic() < deadline, engine.problem
        time.sleep(0.1)


# ---- refusals ------------------------------------------------------------------------------------------------------
def test_a_gpu_count_the_heads_do_not_divide_by_is_refused_with_the_allowed_counts():
    with pytest.raises(
        ValueError, match=r"H3_NUM_GPUS \(--num-gpus\): 3: the DiT's 4 attention heads .*allowed: 1, 2, 4"
    ):
        check_split(TINY_DIT, CPU, 3)


def test_a_built_engine_is_checked_against_the_config_it_builds_not_the_tiny_one():
    from h3serve.config import DiTConfig

    wide = DiTConfig.from_json(Path(__file__).parent / "data" / "reference" / "FL2VA" / "transformer" / "config.json")
    with pytest.raises(ValueError, match="56 attention heads do not divide by it") as err:
        ParallelEngine(WorkerSpec(None, CPU, 3), dit_config=wide)
    assert "1, 2, 4, 7, 8, 14, 28, 56" in str(err.value)


def test_more_gpus_than_visible_is_refused():
    many = str(max(2, torch.cuda.device_count() + 1))
    with pytest.raises(
        SettingsError, match=r"H3_NUM_GPUS \(--num-gpus\): \d+ GPUs: only \d+ CUDA device\(s\) are visible"
    ):
        load_settings(env={"H3_NUM_GPUS": many, "H3_DEVICE": "cuda"})
    with pytest.raises(ValueError, match="set device cuda"):
        check_split(TINY_DIT, Profile.for_device("cuda:1"), 2)


def test_the_settings_refuse_humming_and_one_named_gpu_with_several():
    with pytest.raises(SettingsError) as err:
        load_settings(env={"H3_NUM_GPUS": "2", "H3_DEVICE": "cuda:0"}, check_profile=False)
    assert "H3_NUM_GPUS (--num-gpus)" in str(err.value) and "set device cuda" in str(err.value)
    with pytest.raises(SettingsError) as err:
        load_settings(
            env={"H3_NUM_GPUS": "2", "H3_LINEAR_BACKEND": "HUMMING", "H3_DEVICE": "cuda"}, check_profile=False
        )
    assert "linear HUMMING runs on one GPU only" in str(err.value)
    with pytest.raises(SettingsError, match="H3_NUM_GPUS"):
        load_settings(env={"H3_NUM_GPUS": "0"}, check_profile=False)
    assert load_settings(env={"H3_NUM_GPUS": "4", "H3_DEVICE": "cpu"}).num_gpus == 4  # gloo processes on the cpu


def test_the_split_attention_is_one_opaque_call_in_a_compiled_graph():
    """In a process group of one (gloo, this process): a fullgraph compile traces the all-to-all attention as one
    custom op (its fake gives the shape), with no graph break and no recompile as the row count changes."""
    import torch._dynamo.testing

    from h3serve.model import ops
    from h3serve.parallel.group import Group, free_port
    from h3serve.parallel.ranks import UlyssesAttention, _fake_ulysses

    group = Group.join(0, 1, free_port(), torch.device("cpu"), 30)
    try:
        sizes = [0]
        split = UlyssesAttention(ops.sdpa, group, sizes)
        counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")

        @torch.compile(fullgraph=True, backend=counter, dynamic=True)
        def block(x):
            q = x * 2
            return split(q, q + 1, q - 1, False) + 1

        for rows in (10, 17, 33):
            sizes[0] = rows
            x = torch.randn(1, 4, rows, 16)
            assert torch.equal(block(x), ops.sdpa(x * 2, x * 2 + 1, x * 2 - 1, False) + 1)
            eager = split(x, x + 1, x - 1, False)  # compiled code is laid out by the fake: the same strides
            assert eager.stride() == _fake_ulysses(x, x, x, False).stride() and eager.shape == x.shape
            assert eager.transpose(1, 2).is_contiguous()  # rows first, as the out projection reads it
        assert counter.frame_count == 1
    finally:
        group.leave()
