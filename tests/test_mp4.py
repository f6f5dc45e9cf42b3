"""MP4 writer and verification helpers, checked with the real libx264/AAC encoders and decoders (CPU, fast)."""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from h3serve.media.encoding import Encoding
from h3serve.media.mp4 import (
    AAC_FRAME_SAMPLES,
    StreamInfo,
    audio_psnr,
    decode_audio,
    decode_frames,
    frame_hashes,
    probe_mp4,
    write_mp4,
)

FPS = 24
SR = 32000
# 17n+5 frames like the model's grid; width and height differ so a transposed axis shows up.
F, H, W = 22, 96, 160
N = round(F / FPS * SR)  # audio samples covering exactly the video's duration


def smooth_frames(f: int = F, h: int = H, w: int = W) -> np.ndarray:
    """Moving low-frequency gradients: the kind of content H.264 compresses well. (F, H, W, 3) uint8."""
    t = np.arange(f)[:, None, None] / f
    y = np.arange(h)[None, :, None] / h
    x = np.arange(w)[None, None, :] / w
    r = 128 + 100 * np.sin(2 * np.pi * (x + t))
    g = 128 + 100 * np.cos(2 * np.pi * (y - t))
    b = 128 + 60 * np.sin(np.pi * (x + y))
    return np.stack(np.broadcast_arrays(r, g, b), axis=-1).round().astype(np.uint8)


def stereo_tone(n: int = N) -> np.ndarray:
    """Different tones left and right, so a channel swap or a mono downmix would show. (2, N) float32."""
    s = np.arange(n) / SR
    return np.stack([0.5 * np.sin(2 * np.pi * 440 * s), 0.3 * np.sin(2 * np.pi * 660 * s)]).astype(np.float32)


def psnr_u8(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(255**2 / mse)


def top_level_atoms(data: bytes) -> list[str]:
    """Names of the top-level ISO BMFF boxes, in file order."""
    names, pos = [], 0
    while pos + 8 <= len(data):
        size, kind = struct.unpack(">I4s", data[pos : pos + 8])
        if size == 1:  # 64-bit size follows the type
            size = struct.unpack(">Q", data[pos + 8 : pos + 16])[0]
        elif size == 0:  # box runs to the end of the file
            size = len(data) - pos
        assert size >= 8, f"corrupt box size {size} at offset {pos}"
        names.append(kind.decode("latin-1"))
        pos += size
    assert pos == len(data), "top-level boxes do not tile the file"
    return names


def dir_entries(folder: Path) -> list[str]:
    return sorted(os.listdir(folder))  # includes dot-files, where a temporary file would hide


@pytest.fixture(scope="module")
def clip(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, np.ndarray, np.ndarray]:
    frames, audio = smooth_frames(), stereo_tone()
    path = tmp_path_factory.mktemp("clip") / "clip.mp4"
    assert write_mp4(path, frames, audio) == path
    return path, frames, audio


# --- encode: what the file contains ----------------------------------------------------------------------


def test_stream_facts(clip: tuple[Path, np.ndarray, np.ndarray]) -> None:
    info = probe_mp4(clip[0])
    assert isinstance(info, StreamInfo)
    assert info.video_codec == "h264"
    assert info.video_profile == "Constrained Baseline"  # the default preset, ultrafast: no CABAC, no B-frames
    assert info.pixel_format == "yuv420p"
    assert (info.width, info.height) == (W, H)
    assert info.frame_count == F
    assert info.fps == 24.0
    assert info.audio_codec == "aac"
    assert info.audio_profile == "LC"
    assert info.channels == 2
    assert info.sample_rate == SR
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.width = 1  # type: ignore[misc]


def test_the_profile_follows_the_preset(tmp_path: Path) -> None:
    frames, audio = smooth_frames(), stereo_tone()
    for preset, profile in (("medium", "High"), ("superfast", "High"), ("ultrafast", "Constrained Baseline")):
        path = write_mp4(tmp_path / f"{preset}.mp4", frames, audio, encoding=Encoding(preset=preset))
        assert probe_mp4(path).video_profile == profile, preset


def test_audio_duration_matches_video(clip: tuple[Path, np.ndarray, np.ndarray]) -> None:
    info = probe_mp4(clip[0])
    frames_s = F / FPS
    assert abs(info.video_duration_s - frames_s) <= 1 / FPS
    assert abs(info.audio_duration_s - frames_s) * SR <= AAC_FRAME_SAMPLES
    # Decoded PCM is never shorter than what was written; the decoder may add the last frame's padding
    # (and, across av versions, up to one more frame of priming).
    decoded = decode_audio(clip[0]).shape[1]
    assert N <= decoded < N + 2 * AAC_FRAME_SAMPLES


def test_faststart_puts_moov_before_mdat(clip: tuple[Path, np.ndarray, np.ndarray]) -> None:
    atoms = top_level_atoms(clip[0].read_bytes())
    assert atoms[0] == "ftyp"
    assert "moov" in atoms and "mdat" in atoms
    assert atoms.index("moov") < atoms.index("mdat"), atoms


def test_same_input_gives_same_bytes(clip: tuple[Path, np.ndarray, np.ndarray], tmp_path: Path) -> None:
    path, frames, audio = clip
    # Several encodes: a nondeterministic encoder setting (x264's mbtree under av 19) differed about half the time.
    for i in range(4):
        again = write_mp4(tmp_path / f"again{i}.mp4", frames, audio)
        assert hashlib.sha256(again.read_bytes()).hexdigest() == hashlib.sha256(path.read_bytes()).hexdigest()
    # Torch tensors are the pipeline's native output: same bytes as numpy input.
    from_torch = write_mp4(tmp_path / "torch.mp4", torch.from_numpy(frames), torch.from_numpy(audio))
    assert from_torch.read_bytes() == path.read_bytes()
    # Overwriting an existing file replaces it whole.
    write_mp4(again, frames[:4], audio[:, : 4 * SR // FPS])
    assert probe_mp4(again).frame_count == 4


def test_different_input_gives_different_bytes(clip: tuple[Path, np.ndarray, np.ndarray], tmp_path: Path) -> None:
    # Guards the identity test above against a writer that ignores its input.
    path, frames, audio = clip
    frames = frames.copy()
    frames[-1, 0, 0] ^= 0x40
    assert write_mp4(tmp_path / "other.mp4", frames, audio).read_bytes() != path.read_bytes()


def test_decoded_frames_close_to_input(clip: tuple[Path, np.ndarray, np.ndarray]) -> None:
    path, frames, _ = clip
    decoded = decode_frames(path)
    assert decoded.shape == frames.shape and decoded.dtype == np.uint8
    # crf 18 on smooth gradients measures ~40 dB here; 35 dB catches a colour-matrix or range mismatch
    # (BT.601 vs BT.709, limited vs full range each cost far more) and a frame order or offset error.
    assert psnr_u8(decoded, frames) >= 35.0
    per_frame = [psnr_u8(d, f) for d, f in zip(decoded, frames, strict=True)]
    assert min(per_frame) >= 32.0, per_frame


def test_decoded_audio_close_to_input(clip: tuple[Path, np.ndarray, np.ndarray]) -> None:
    path, _, audio = clip
    decoded = decode_audio(path)
    assert decoded.dtype == np.float32 and decoded.shape[0] == 2
    # AAC-LC at 128 kb/s on two pure tones measures ~44 dB with av 18 and ~35 dB with av 19 (its FFmpeg's
    # encoder); a one-sample offset already drops below 31 dB, and a channel swap far lower.
    assert audio_psnr(decoded, audio) >= 33.0
    assert audio_psnr(decoded[::-1], audio) < 10.0


# --- verification helpers ---------------------------------------------------------------------------------


def test_frame_hashes(clip: tuple[Path, np.ndarray, np.ndarray]) -> None:
    decoded = decode_frames(clip[0])
    hashes = frame_hashes(decoded)
    assert len(hashes) == F
    assert hashes[0] == hashlib.sha256(decoded[0].tobytes()).hexdigest()
    assert len(set(hashes)) == F  # the content moves every frame
    assert frame_hashes(decode_frames(clip[0])) == hashes  # decoding is repeatable
    with pytest.raises(ValueError, match=r"uint8 numpy array of shape \(F, H, W, 3\)"):
        frame_hashes(decoded.astype(np.float32))


def test_audio_psnr_identical_is_inf() -> None:
    a = stereo_tone()
    assert audio_psnr(a, a.copy()) == math.inf
    # Aligned to the shorter length: a longer copy with anything after the end still matches.
    longer = np.concatenate([a, np.ones((2, 500), np.float32)], axis=1)
    assert audio_psnr(longer, a) == math.inf
    assert audio_psnr(a, longer) == math.inf


def test_audio_psnr_on_noise() -> None:
    rng = np.random.default_rng(0)
    a = stereo_tone()
    sigma = 0.01
    noisy = a + rng.normal(0.0, sigma, a.shape).astype(np.float32)
    # Peak 1.0: PSNR = -20 log10(sigma) = 40 dB for white noise of that std.
    assert audio_psnr(a, noisy) == pytest.approx(40.0, abs=0.2)
    assert audio_psnr(a, noisy, peak=2.0) == pytest.approx(40.0 + 20 * math.log10(2.0), abs=0.2)
    assert audio_psnr(a, a + 10 * (noisy - a)) == pytest.approx(20.0, abs=0.2)


@pytest.mark.parametrize(
    ("a", "b", "match"),
    [
        (np.zeros((2, 10), np.float32), np.zeros((1, 10), np.float32), "equal channel counts"),
        (np.zeros((2, 0), np.float32), np.zeros((2, 10), np.float32), "at least 1 sample"),
        (np.zeros(10, np.float32), np.zeros(10, np.float32), r"\(channels, N\)"),
    ],
)
def test_audio_psnr_rejects(a: np.ndarray, b: np.ndarray, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        audio_psnr(a, b)


# --- atomic write -----------------------------------------------------------------------------------------

_FAIL_MID_ENCODE = textwrap.dedent(
    """
    import resource, signal, sys
    import numpy as np
    from h3serve.media.mp4 import write_mp4

    # A real write error partway through: the file-size limit makes write() fail with EFBIG, like a full disk.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (48_000, 48_000))
    rng = np.random.default_rng(0)
    frames = rng.integers(0, 256, (22, 96, 160, 3), dtype=np.uint8)  # noise: ~10 kB a frame
    try:
        write_mp4(sys.argv[1], frames, np.zeros((2, 29333), np.float32))
    except OSError as err:
        print("write failed:", err.errno, err)
        sys.exit(3)
    print("write succeeded")
    """
)


@pytest.mark.skipif(sys.platform != "linux", reason="needs RLIMIT_FSIZE and SIGXFSZ semantics of Linux")
@pytest.mark.parametrize("existing", [False, True])
def test_error_mid_encode_leaves_nothing(tmp_path: Path, existing: bool) -> None:
    dest = tmp_path / "out.mp4"
    if existing:
        dest.write_bytes(b"previous render")
    run = subprocess.run(
        [sys.executable, "-c", _FAIL_MID_ENCODE, str(dest)], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 3, run.stdout + run.stderr
    assert "write failed: 27" in run.stdout  # EFBIG, i.e. the failure happened while writing
    if existing:
        assert dir_entries(tmp_path) == ["out.mp4"]
        assert dest.read_bytes() == b"previous render"
    else:
        assert dir_entries(tmp_path) == []


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root writes into read-only folders")
def test_unwritable_folder(tmp_path: Path) -> None:
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        with pytest.raises(PermissionError, match="cannot write an MP4 into folder"):
            write_mp4(folder / "out.mp4", smooth_frames(2), stereo_tone(2000))
        assert dir_entries(folder) == []
    finally:
        folder.chmod(0o755)


# --- validation -------------------------------------------------------------------------------------------

_FR = smooth_frames(2, 16, 16)
_AU = stereo_tone(2000)


@pytest.mark.parametrize(
    ("frames", "audio", "kwargs", "error", "match"),
    [
        (_FR.astype(np.float32), _AU, {}, ValueError, "frames must have dtype uint8"),
        (_FR[..., 0], _AU, {}, ValueError, r"frames must have shape \(F, H, W, 3\)"),
        (np.concatenate([_FR, _FR[..., :1]], -1), _AU, {}, ValueError, r"\(F, H, W, 3\).*got \(2, 16, 16, 4\)"),
        (_FR[:, :, :15], _AU, {}, ValueError, "must be even.*W=15"),
        (_FR[:, :15], _AU, {}, ValueError, "must be even.*H=15"),
        (_FR[:0], _AU, {}, ValueError, "frames is empty"),
        (list(_FR), _AU, {}, TypeError, "frames must be a numpy array or a torch tensor"),
        (_FR, _AU.astype(np.float64), {}, ValueError, "audio must have dtype float32"),
        (_FR, _AU[:1], {}, ValueError, r"audio must have shape \(2, N\).*got \(1, 2000\)"),
        (_FR, np.ascontiguousarray(_AU.T), {}, ValueError, r"audio must have shape \(2, N\).*got \(2000, 2\)"),
        (_FR, _AU[:, :0], {}, ValueError, "audio is empty"),
        (_FR, np.where(np.arange(2000) == 7, np.nan, _AU).astype(np.float32), {}, ValueError, "NaN or infinite"),
        (_FR, _AU * 2.5, {}, ValueError, r"\[-1, 1\], got a peak of 1.2500"),
        (_FR, _AU, {"sample_rate": 22000}, ValueError, "sample_rate must be one of the AAC rates"),
        (_FR, _AU, {"fps": 0}, ValueError, "fps must be an integer in 1..240"),
        (_FR, _AU, {"fps": 23.976}, ValueError, "fps must be an integer"),
        (_FR, _AU, {"encoding": Encoding(crf=0)}, ValueError, r"crf must be an integer in 1..51"),
        (_FR, _AU, {"encoding": Encoding(threads=0)}, ValueError, "threads must be an integer in 1..64"),
        (_FR, _AU, {"encoding": Encoding(threads=True)}, ValueError, "threads must be an integer"),
        (_FR, _AU, {"encoding": Encoding(segment=7)}, ValueError, r"segment must be 0 \(one stream\) or .* 8\.\."),
        (_FR, _AU, {"encoding": Encoding(preset="quick")}, ValueError, r"x264 preset must be one of .*'veryfast'"),
        (_FR, _AU, {"encoding": Encoding("nvenc", "p4", segment=24)}, ValueError, "nvenc encodes one stream"),
        (_FR, _AU, {"encoding": Encoding(encoder="hevc")}, ValueError, r"encoder must be one of \('x264', 'nvenc'\)"),
        (_FR, _AU, {"encoding": {"crf": 18}}, ValueError, "encoding must be a media.encoding.Encoding, got dict"),
    ],
)
def test_rejects_bad_input(
    tmp_path: Path, frames: object, audio: object, kwargs: dict, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        write_mp4(tmp_path / "out.mp4", frames, audio, **kwargs)  # type: ignore[arg-type]
    assert dir_entries(tmp_path) == []


def test_rejects_bad_destination(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        write_mp4(tmp_path / "missing" / "out.mp4", _FR, _AU)
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(NotADirectoryError, match="is not a folder"):
        write_mp4(tmp_path / "file" / "out.mp4", _FR, _AU)
    (tmp_path / "dir.mp4").mkdir()
    with pytest.raises(IsADirectoryError, match="is a folder"):
        write_mp4(tmp_path / "dir.mp4", _FR, _AU)
    assert dir_entries(tmp_path) == ["dir.mp4", "file"]
    assert dir_entries(tmp_path / "dir.mp4") == []


def test_probe_rejects_file_without_audio(tmp_path: Path) -> None:
    import av

    path = tmp_path / "silent.mp4"
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=24)
        stream.width, stream.height, stream.pix_fmt = 16, 16, "yuv420p"
        for i, rgb in enumerate(_FR):
            frame = av.VideoFrame.from_ndarray(rgb, format="rgb24")
            frame.pts = i
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    with pytest.raises(ValueError, match="has no audio stream"):
        probe_mp4(path)
