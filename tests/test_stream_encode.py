"""Frames streamed to the encoder as the decode makes them (`RenderContext.frames_to`, `media.mp4.Mp4Writer`): the
MP4 is byte for byte the one written from the whole array, the engine hands over one decode window's frames at a
time and keeps none, the audio comes first, and a failed or cancelled render leaves no file."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from h3serve.accel.profile import Profile
from h3serve.media.mp4 import FrameStream, Mp4Writer, encode_mp4, write_mp4
from h3serve.media.yuv import rgb_to_i420
from h3serve.pipeline.context import RenderCancelled, RenderContext
from h3serve.pipeline.engine import Engine
from h3serve.pipeline.request import RequestFields

PROMPT = "a tram crosses a bridge in the rain"


@pytest.fixture(scope="module")
def engine():
    return Engine.load(None, Profile.for_device("cpu"))


class Recording:
    """A sink that keeps what it was handed, and hands it on to `inner`."""

    def __init__(self, inner=None):
        self.inner, self.calls = inner, []

    def begin(self, audio, sample_rate, fps, width, height):
        self.calls.append(("begin", audio.shape, sample_rate, fps, width, height))
        if self.inner is not None:
            self.inner.begin(audio, sample_rate, fps, width, height)

    def put(self, frames):
        self.calls.append(("put", frames.copy()))
        if self.inner is not None:
            self.inner.put(frames)


def test_a_streamed_render_writes_the_bytes_of_the_whole_one(engine, tmp_path):
    request = engine.validate(RequestFields(PROMPT, steps=4, seed=7, num_frames=56))  # 17 latents: 3 decode windows
    whole = engine.render(request)
    windows = engine.components.video_vae.cfg.decode_plan(17)[1]
    assert windows == 3
    writer = Mp4Writer(tmp_path / "streamed.mp4")
    sink = Recording(writer)
    streamed = engine.render(request, RenderContext(frames_to=sink))
    writer.finish()
    assert streamed.frames is None  # the engine kept none
    np.testing.assert_array_equal(streamed.audio, whole.audio)
    # The audio first, then a run of frames per window (the last window's carried tail with it), nothing larger.
    assert sink.calls[0] == ("begin", whole.audio.shape, whole.sample_rate, whole.fps, request.width, request.height)
    chunks = [c[1] for c in sink.calls[1:]]
    assert len(chunks) == windows + 1 and max(len(c) for c in chunks) < len(whole.frames) / 2
    # In the encoder's layout, converted where they were decoded: the whole video's frames, converted.
    assert chunks[0].shape[1:] == (request.height * 3 // 2, request.width)
    np.testing.assert_array_equal(np.concatenate(chunks), rgb_to_i420(torch.from_numpy(whole.frames)).numpy())
    write_mp4(tmp_path / "whole.mp4", whole.frames, whole.audio, fps=whole.fps, sample_rate=whole.sample_rate)
    assert (tmp_path / "streamed.mp4").read_bytes() == (tmp_path / "whole.mp4").read_bytes()
    assert writer.frames == len(whole.frames)


def test_a_frame_stream_in_chunks_encodes_the_bytes_of_the_array(tmp_path):
    rng = np.random.default_rng(0)
    frames = rng.integers(0, 256, (9, 32, 48, 3), dtype=np.uint8)
    audio = (rng.standard_normal((2, 12_000)) * 0.1).astype(np.float32)
    whole = io.BytesIO()
    encode_mp4(whole, frames, audio)
    stream = FrameStream(48, 32, depth=8)
    for start in (0, 4, 5):
        stream.put(frames[start : {0: 4, 4: 5, 5: 9}[start]])
    stream.close()
    write_mp4(tmp_path / "a.mp4", stream, audio)
    assert (tmp_path / "a.mp4").read_bytes() == whole.getvalue()
    with pytest.raises(ValueError, match=r"uint8 \(n, 32, 48, 3\)"):
        FrameStream(48, 32).put(frames[:, :, :40])
    with pytest.raises(ValueError, match="even"):
        FrameStream(47, 32)


def test_a_cancelled_streamed_render_leaves_no_file_and_keeps_an_old_one(engine, tmp_path):
    path = tmp_path / "out.mp4"
    path.write_bytes(b"the previous render")
    writer = Mp4Writer(path)
    request = engine.validate(RequestFields(PROMPT, steps=3, seed=1, num_frames=56))

    class Cancelling(Recording):
        def put(self, frames):
            super().put(frames)
            ctx.cancel("client went away")  # after the first window's frames reached the encoder

    ctx = RenderContext(frames_to=Cancelling(writer))
    with pytest.raises(RenderCancelled) as err:
        engine.render(request, ctx)
    writer.abort(err.value)
    assert path.read_bytes() == b"the previous render"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.mp4"]  # no temporary file left behind


def test_the_writer_refuses_a_missing_folder_before_rendering_and_an_encoder_error_reaches_the_render(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Mp4Writer(tmp_path / "nowhere" / "a.mp4")
    writer = Mp4Writer(tmp_path / "a.mp4")
    with pytest.raises(ValueError, match=r"\[-1, 1\]"):
        writer.begin(np.full((2, 100), 2.0, dtype=np.float32), 32_000, 24, 32, 32)
    writer = Mp4Writer(tmp_path / "b.mp4")
    writer.begin(np.zeros((2, 1000), dtype=np.float32), 32_000, 24, 32, 32)
    with pytest.raises(ValueError, match="chunk of frames"):
        writer.put(np.zeros((2, 30, 32, 3), dtype=np.uint8))
    writer.put(np.zeros((2, 32, 32, 3), dtype=np.uint8))
    assert writer.finish() == tmp_path / "b.mp4" and (tmp_path / "b.mp4").stat().st_size > 0
