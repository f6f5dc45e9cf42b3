"""The H.264 encode in segments (`media.h264`): the joined stream decodes frame for frame as the segments do alone,
each segment starts on a keyframe, the bytes depend on the setting and never on how many segments run at once, and
a cancel stops every segment's encoder. The real libx264 through PyAV, on the CPU."""

from __future__ import annotations

import io
import threading

import av
import numpy as np
import pytest
import torch
from tests.test_mp4 import psnr_u8, smooth_frames, stereo_tone

from h3serve.media.encoding import Encoding
from h3serve.media.h264 import Segments
from h3serve.media.mp4 import decode_frames, encode_mp4, verify_mp4, write_mp4

F, H, W = 56, 64, 96


@pytest.fixture(scope="module")
def clip() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(3)
    frames = smooth_frames(F, H, W)
    frames[F // 2 :] = np.clip(frames[F // 2 :].astype(int) + rng.integers(-20, 21, frames[F // 2 :].shape), 0, 255)
    return frames.astype(np.uint8), stereo_tone(round(F / 24 * 32000))


def encode(frames: np.ndarray, audio: np.ndarray, encoding: Encoding) -> bytes:
    buffer = io.BytesIO()
    encode_mp4(buffer, frames, audio, encoding=encoding)
    return buffer.getvalue()


def video_packets(data: bytes) -> list[tuple[int, int, bool]]:
    """(pts, dts, keyframe) of each video packet, in file order, in frames."""
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        scale = stream.time_base * 24
        return [(int(p.pts * scale), int(p.dts * scale), p.is_keyframe) for p in container.demux(stream) if p.size]


def test_a_joined_stream_decodes_frame_for_frame_as_its_segments_alone(clip) -> None:
    frames, audio = clip
    segmented = encode(frames, audio, Encoding(segment=16, threads=1, workers=3))
    verify_mp4(io.BytesIO(segmented), width=W, height=H, num_frames=F)
    joined = decode_frames(io.BytesIO(segmented))
    for start in range(0, F, 16):  # 16, 16, 16 and 8 frames
        alone = decode_frames(io.BytesIO(encode(frames[start : start + 16], audio, Encoding(segment=0, threads=1))))
        np.testing.assert_array_equal(joined[start : start + 16], alone)
    one_stream = decode_frames(io.BytesIO(encode(frames, audio, Encoding(segment=0, threads=1))))
    assert psnr_u8(joined, frames) > max(25.0, psnr_u8(one_stream, frames) - 0.5)  # noise in half: 4:2:0 loses some
    packets = video_packets(segmented)
    assert sorted(p[0] for p in packets) == list(range(F))  # every frame once, at its time
    assert [p[1] for p in packets] == sorted({p[1] for p in packets})  # decode times strictly increase
    assert {p[0] for p in packets if p[2]} == {0, 16, 32, 48}  # a keyframe opens each segment, and only there


def test_the_bytes_follow_the_setting_and_not_the_segments_run_at_once(clip) -> None:
    frames, audio = clip
    one_at_a_time = encode(frames, audio, Encoding(segment=16, workers=1))
    assert encode(frames, audio, Encoding(segment=16, workers=4)) == one_at_a_time
    assert encode(frames, audio, Encoding(segment=16, workers=4)) == one_at_a_time  # and again
    others = [Encoding(segment=24), Encoding(segment=0), Encoding(segment=16, preset="medium")]
    assert len({one_at_a_time, *(encode(frames, audio, e) for e in others)}) == 4


def test_one_stream_has_one_keyframe(clip) -> None:
    frames, audio = clip
    packets = video_packets(encode(frames, audio, Encoding(segment=0)))
    assert [p[0] for p in packets if p[2]] == [0]


def test_a_cancel_stops_every_segments_encoder_and_leaves_no_file(clip, tmp_path) -> None:
    frames, audio = clip
    seen = 0

    def check() -> None:
        nonlocal seen
        seen += 1
        if seen > 40:  # three segments begun
            raise InterruptedError("cancelled")

    with pytest.raises(InterruptedError):
        write_mp4(tmp_path / "out.mp4", frames, audio, encoding=Encoding(segment=8, workers=2), check=check)
    assert list(tmp_path.iterdir()) == []
    assert not [t for t in threading.enumerate() if t.name.startswith("h3serve-h264")]


def test_a_segment_encoder_that_fails_stops_the_encode_with_its_error_instead_of_holding_the_frames(clip) -> None:
    """A segment's encoder whose parameter sets are not the file's refuses to be joined; the writer meets that error
    once the segment's queue is full (it cannot take more), not a hang."""
    frames, _ = clip
    segments = Segments(Encoding(segment=0, threads=1), W, H, 24, header=b"not the file's parameter sets")
    with pytest.raises(RuntimeError, match="other parameter sets than the file's"):
        for i, rgb in enumerate(np.concatenate([frames] * 2)):  # more frames than a segment's queue holds
            frame = av.VideoFrame.from_ndarray(rgb, format="rgb24").reformat(format="yuv420p")
            frame.pts = i
            segments.put(frame)
            list(segments.packets())
    segments.stop()
    assert not [t for t in threading.enumerate() if t.name.startswith("h3serve-h264")]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU machine may have an NVENC engine")
def test_nvenc_is_refused_at_the_settings_where_it_cannot_open_and_x264_is_not():
    from h3serve.settings import EngineSettings, SettingsError, load_settings

    with pytest.raises(SettingsError) as refused:
        load_settings(env={"H3_ENCODER": "nvenc"}, schema=EngineSettings)
    assert "H3_ENCODER (--encoder): encoder nvenc cannot open here" in str(refused.value)
    assert "use encoder x264" in str(refused.value)
    # Without asking the machine (`check`, `ready`) the setting stands; x264 opens everywhere.
    assert load_settings(env={"H3_ENCODER": "nvenc"}, schema=EngineSettings, check_profile=False).encoder == "nvenc"
    assert load_settings(env={}, schema=EngineSettings).encoding == Encoding()


@pytest.mark.parametrize("count", [1, 7, 8, 9, 16, 17])
def test_any_frame_count_joins_into_a_stream_with_every_frame_once(clip, count: int) -> None:
    frames, audio = clip
    data = encode(frames[:count], audio[:, : round(count / 24 * 32000)], Encoding(segment=8, threads=1, workers=2))
    verify_mp4(io.BytesIO(data), width=W, height=H, num_frames=count)
    packets = video_packets(data)
    assert sorted(p[0] for p in packets) == list(range(count))
    assert {p[0] for p in packets if p[2]} == set(range(0, count, 8))
