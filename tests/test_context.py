"""The engine as a service citizen: cancellation at every check point, typed progress, one render at a time,
warmup, and the in-memory MP4 encoder with its contract check."""

from __future__ import annotations

import io
import threading

import numpy as np
import pytest
import torch

from h3serve.accel.profile import Profile
from h3serve.media.encoding import Encoding
from h3serve.media.mp4 import encode_mp4, verify_mp4, write_mp4
from h3serve.pipeline.context import Progress, RenderCancelled, RenderContext
from h3serve.pipeline.engine import STAGES, Engine
from h3serve.pipeline.request import RequestFields


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine.load(None, Profile())


def _request(engine: Engine, steps: int = 5):
    return engine.validate(RequestFields("a lighthouse in a storm, waves and wind", num_frames=22, steps=steps, seed=3))


def test_progress_events_follow_the_stages_in_order(engine):
    events: list[Progress] = []
    engine.render(_request(engine, steps=5), RenderContext(events.append))
    assert [e.stage for e in events if e.done == 0 and e.total == 1][: len(STAGES)] == list(STAGES)
    denoise = [(e.done, e.total) for e in events if e.stage == "denoise" and e.done > 0]
    assert denoise == [(i, 4) for i in range(1, 5)]  # 5 grid points run 4 forwards
    windows = [(e.done, e.total) for e in events if e.stage == "video" and e.done > 0]
    assert windows and windows[-1][0] == windows[-1][1]  # every decode window reported, the last one complete


@pytest.mark.parametrize(
    ("stage", "done"),
    [("text", 0), ("layout", 0), ("denoise", 2), ("video", 0), ("video", 1), ("audio", 0)],
)
def test_cancel_stops_at_the_next_check(engine, stage, done):
    seen: list[Progress] = []

    def on_progress(p: Progress) -> None:
        seen.append(p)
        if (p.stage, p.done) == (stage, done):
            ctx.cancel(f"stop at {stage} {done}")

    ctx = RenderContext(on_progress)
    with pytest.raises(RenderCancelled, match=f"stop at {stage} {done}"):
        engine.render(_request(engine, steps=6), ctx)
    assert (seen[-1].stage, seen[-1].done) == (stage, done)  # nothing ran past the check point


def test_cancel_from_another_thread_and_the_engine_renders_the_same_afterwards(engine):
    request = _request(engine, steps=4)
    reference = engine.render(request)
    ctx = RenderContext()
    started = threading.Event()
    ctx.on_progress = lambda p: started.set() if p.stage == "denoise" and p.done == 1 else None
    outcome: list[BaseException] = []

    def run() -> None:
        try:
            engine.render(_request(engine, steps=400), ctx)
        except BaseException as err:
            outcome.append(err)

    worker = threading.Thread(target=run)
    worker.start()
    assert started.wait(30)
    ctx.cancel("client went away")
    worker.join(30)
    assert not worker.is_alive() and isinstance(outcome[0], RenderCancelled)
    again = engine.render(request)
    np.testing.assert_array_equal(again.frames, reference.frames)
    np.testing.assert_array_equal(again.audio, reference.audio)


def test_one_render_at_a_time(engine):
    """A second render waits for the engine lock; it does not interleave with the first."""
    order: list[str] = []
    first_in = threading.Event()

    def first_progress(p: Progress) -> None:
        if p.stage == "denoise" and p.done == 1:
            first_in.set()
        order.append("first")

    results = []
    t1 = threading.Thread(
        target=lambda: results.append(engine.render(_request(engine, 30), RenderContext(first_progress)))
    )
    t1.start()
    assert first_in.wait(30)
    t2 = threading.Thread(
        target=lambda: results.append(
            engine.render(_request(engine, 3), RenderContext(lambda p: order.append("second")))
        )
    )
    t2.start()
    t1.join(60)
    t2.join(60)
    assert len(results) == 2
    assert order.index("second") > len(order) - order[::-1].index("first") - 1  # every "second" after every "first"


def test_warmup_passes_at_the_models_default_shape_and_fails_closed_on_nan():
    from h3serve.service.warmup import run_warmup  # the startup warmup is the service's

    engine = Engine.load(None, Profile())
    result = run_warmup(engine)
    assert result.passed and result.error is None
    assert result.request == "t2va 224x128 22 frames, 2 grid points (1 DiT forward)"
    with torch.no_grad():
        next(engine.components.dit.parameters()).fill_(float("nan"))
    failed = run_warmup(engine)
    assert not failed.passed and "not finite" in failed.error


def _clip(frames: int = 5):
    rng = np.random.default_rng(0)
    video = rng.integers(0, 256, (frames, 64, 96, 3), dtype=np.uint8)
    audio = (0.2 * np.sin(np.linspace(0, 200, 2 * 8000))).astype(np.float32).reshape(2, -1)
    return video, audio


def test_encode_mp4_to_a_file_object_matches_write_mp4(tmp_path):
    video, audio = _clip()
    buffer = io.BytesIO()
    encode_mp4(buffer, video, audio, encoding=Encoding(threads=2, segment=8))
    path = write_mp4(tmp_path / "a.mp4", video, audio, encoding=Encoding(threads=2, segment=8))
    assert buffer.getvalue() == path.read_bytes()
    info = verify_mp4(io.BytesIO(buffer.getvalue()), width=96, height=64, num_frames=5)
    assert (info.video_codec, info.audio_codec, info.channels) == ("h264", "aac", 2)


def test_encode_mp4_refuses_bad_input_and_writes_nothing():
    video, audio = _clip()
    buffer = io.BytesIO()
    with pytest.raises(ValueError, match="audio samples must lie"):
        encode_mp4(buffer, video, audio * 10)
    assert buffer.getvalue() == b""


def test_verify_mp4_lists_every_mismatch(tmp_path):
    video, audio = _clip()
    path = write_mp4(tmp_path / "a.mp4", video, audio)
    with pytest.raises(ValueError) as err:
        verify_mp4(path, width=128, height=64, num_frames=7)
    assert "width 96 (expected 128)" in str(err.value) and "frame_count 5 (expected 7)" in str(err.value)
    (tmp_path / "junk.mp4").write_bytes(b'{"error": "not a video"}')
    with pytest.raises(ValueError, match="not a readable MP4"):
        verify_mp4(tmp_path / "junk.mp4", width=96, height=64, num_frames=5)
